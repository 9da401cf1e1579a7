"""Trains a digit classifier with Keras fit under any tf.distribute strategy.

  python examples/keras_fit.py                         # this machine
  tfdist launch --workers 2 -- python examples/keras_fit.py   # 2 local workers
  srun -n 4 python examples/keras_fit.py               # a SLURM step
  python examples/keras_fit.py --strategy=tpu --tpu=local     # a TPU VM
"""

from tfdist import flags as tfdist_flags
from tfdist import recipes

tfdist_flags.define_flags()
recipes.define_example_flags()


def main(argv):
  del argv
  recipes.quiet_logs()
  tfdist_flags.apply_mixed_precision()
  strategy = tfdist_flags.strategy_from_flags()  # First TF work: see README.
  recipes.train_with_fit(
      strategy, recipes.example_config(),
      compile_kwargs=tfdist_flags.training_options().compile_kwargs())


if __name__ == "__main__":
  tfdist_flags.run(main)
