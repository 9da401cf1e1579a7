"""Prepares and reads a tiny local TFDS builder through tfdist, offline.

Usage: tfds_counted.py DATA_DIR WAIT_SECONDS. Each run of the builder's
``_generate_examples`` appends this process's pid to $COUNT_FILE (outside
DATA_DIR); with $FAIL set, it raises instead. Prints one JSON line: the
examples read and the task.
"""

import json
import os
import sys

import numpy as np
import tensorflow_datasets as tfds

from tfdist.data import tfds_input


class CountedNumbers(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({"x": np.int64}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    with open(os.environ["COUNT_FILE"], "a") as f:
      f.write(f"{os.getpid()}\n")
    if os.environ.get("FAIL"):
      raise RuntimeError("the source is broken")
    for i in range(20):
      yield i, {"x": i}


builder = tfds_input.tfds_builder(CountedNumbers, data_dir=sys.argv[1],
                                  wait_timeout_s=float(sys.argv[2]))
xs = sorted(int(e["x"]) for e in
            builder.as_dataset(split="train").as_numpy_iterator())
print(json.dumps({"xs": xs, "pid": os.getpid()}), flush=True)
