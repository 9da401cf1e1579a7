"""Trains a digit classifier with tfdist's custom-loop Runner.

  python examples/custom_loop.py
  tfdist launch --workers 2 -- python examples/custom_loop.py
"""

from tfdist import flags as tfdist_flags
from tfdist import recipes

tfdist_flags.define_flags()
recipes.define_example_flags()


def main(argv):
  del argv
  recipes.quiet_logs()
  strategy = tfdist_flags.strategy_from_flags()
  recipes.train_with_custom_loop(strategy, recipes.example_config())


if __name__ == "__main__":
  tfdist_flags.run(main)
