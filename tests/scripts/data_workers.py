"""One worker of a MultiWorkerMirroredStrategy cluster reading tfdist_digits.

Usage: data_workers.py DATA_DIR. Every worker asks for the dataset in DATA_DIR
at once: the chief builds it, the others wait for it (`tfdist.data.prepare`).
Each reads its shard of the ``test`` split through `tfdist.data.distribute`
and prints one JSON line: its replicas and the fingerprints of the examples it
saw. A build shows on stderr as ``tfdist: preparing tfdist_digits``.

Then, on stderr, a line ``--- control ---`` followed by what TensorFlow logs
for a dataset distributed with its default AUTO shard policy, so the test can
tell that the log is captured and that tfdist's part of it has no AUTO warning.
"""

import hashlib
import json
import sys

from absl import logging

import tfdist

strategy = tfdist.make_strategy("multi_worker_mirrored")  # First TF work.

import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tfdist import data  # pylint: disable=g-import-not-at-top

data_dir = sys.argv[1]
logging.set_verbosity(logging.INFO)  # prepare() logs each build it runs.


def examples_fn(ctx):
  return data.load_tfds(data.DIGITS_NAME, split="test", input_context=ctx,
                        data_dir=data_dir).map(lambda ex: ex["image"])


dist = data.distribute(strategy, examples_fn, global_batch_size=64)
seen, batch_sizes = [], set()
for batch in dist:
  for images in strategy.experimental_local_results(batch):
    batch_sizes.add(int(images.shape[0]))
    seen.extend(hashlib.sha1(image.tobytes()).hexdigest()[:16]
                for image in images.numpy())

# A dataset without files, distributed by tfdist: DATA, stated, no warning.
ranged = data.distribute_dataset(
    strategy, tf.data.Dataset.range(64).batch(8, drop_remainder=True))
first = strategy.experimental_local_results(next(iter(ranged)))

print(json.dumps({
    "replicas": strategy.num_replicas_in_sync,
    "input_workers": data.num_input_workers(strategy),
    "batch_sizes": sorted(batch_sizes),
    "seen": seen,
    "ranged_first": [t.numpy().tolist() for t in first],
}))
sys.stdout.flush()

sys.stderr.write("--- control ---\n")
sys.stderr.flush()
control = strategy.experimental_distribute_dataset(
    tf.data.Dataset.range(64).batch(8))
next(iter(control))
