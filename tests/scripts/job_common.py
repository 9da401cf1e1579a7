"""What the test scripts share: a ps cluster on localhost, data and model.

The data make global batch s the examples [s*G, (s+1)*G) whatever the number
of workers and replicas, so N-replica training must match one device.
"""

import json
import os
import subprocess
import sys

import numpy as np

GLOBAL_BATCH = 8


def local_ps_cluster(num_workers: int, num_ps: int = 1) -> dict:
  """Starts ``num_workers`` worker servers and ``num_ps`` ps servers on
  localhost,
  each in a process of its own (`tfdist.serve`, with its own TF_CONFIG, as
  under tfdist launch); returns this process's config: the chief's.

  The servers die with this process (Linux's parent-death signal), so a
  script that prints its result and ends leaves nothing behind. (TensorFlow's
  own tests run such servers inside the chief's process; there its
  coordinator crashed, SIGSEGV in ``RemoteValue._copy_to_local``, in 1 of
  about 10 runs of this suite.)
  """
  from tfdist import _net  # pylint: disable=g-import-not-at-top
  from tfdist.launch import workers  # pylint: disable=g-import-not-at-top
  ports = _net.free_ports(num_workers + num_ps + 1)
  jobs = {"chief": [f"127.0.0.1:{ports[0]}"],
          "ps": [f"127.0.0.1:{p}" for p in ports[1:num_ps + 1]],
          "worker": [f"127.0.0.1:{p}" for p in ports[num_ps + 1:]]}
  for job in ("worker", "ps"):
    for index in range(len(jobs[job])):
      config = {"cluster": jobs, "task": {"type": job, "index": index}}
      subprocess.Popen(  # pylint: disable=consider-using-with
          [sys.executable, "-c", "import tfdist; tfdist.serve()"],
          env=_net.child_env({"TF_CONFIG": json.dumps(config)}),
          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
          preexec_fn=workers._die_with(os.getpid()))  # pylint: disable=protected-access
  return {"cluster": jobs, "task": {"type": "chief", "index": 0}}


def strategy_options(strategy: str, devices: str) -> dict:
  """Splits the CPU into logical devices; returns the builder's options."""
  if not devices:
    return {}
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  names = devices.split(",")
  tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices("CPU")[0],
      [tf.config.LogicalDeviceConfiguration()] * len(names))
  key = "compute_devices" if strategy == "central_storage" else "devices"
  return {key: names}


def data(n: int):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 6)).astype("float32")
  y = (x @ rng.normal(size=(6, 1)) + 0.1).astype("float32")
  return x, y


def model():
  import keras  # pylint: disable=g-import-not-at-top
  init = keras.initializers.GlorotUniform
  return keras.Sequential([
      keras.Input((6,)),
      keras.layers.Dense(4, activation="tanh", kernel_initializer=init(1)),
      keras.layers.Dense(1, kernel_initializer=init(2)),
  ])


def dataset_fn(x, y, global_batch: int = GLOBAL_BATCH):
  """Per-replica batches cut from global batches in order."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def fn(ctx):
    per_replica = ctx.get_per_replica_batch_size(global_batch)
    width = global_batch // ctx.num_input_pipelines
    start = ctx.input_pipeline_id * width
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        global_batch, drop_remainder=True).repeat()
    ds = ds.map(lambda a, b: (a[start:start + width], b[start:start + width]))
    return ds.unbatch().batch(per_replica, drop_remainder=True)
  return fn


def weights(model_) -> list:
  return np.concatenate([w.numpy().ravel() for w in model_.weights]).tolist()
