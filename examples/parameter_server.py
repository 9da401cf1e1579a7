"""Trains a digit classifier with ParameterServerStrategy.

The same script runs on every task: ps and worker tasks serve the chief and
end when it finishes; the chief trains.

  tfdist launch --workers 2 --ps 1 -- python examples/parameter_server.py
  sbatch cluster_configs/parameter_server.sbatch   # under SLURM
"""

from tfdist import flags as tfdist_flags
from tfdist import recipes

tfdist_flags.define_flags(default_strategy="parameter_server")
recipes.define_example_flags()


def main(argv):
  del argv
  recipes.quiet_logs()
  strategy = tfdist_flags.strategy_from_flags()
  recipes.train_with_fit(strategy, recipes.example_config())


if __name__ == "__main__":
  tfdist_flags.run(main)
