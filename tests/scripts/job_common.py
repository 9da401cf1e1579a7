"""What runner_job.py and fit_job.py share: cluster set-up, data and model.

The data make global batch s the examples [s*G, (s+1)*G) whatever the number
of workers and replicas, so N-replica training must match one device.
"""

import numpy as np

GLOBAL_BATCH = 8


def in_process_ps_cluster(num_workers: int) -> dict:
  """Starts worker and ps servers in this process; returns the chief's config."""
  from tfdist.strategy import server as server_lib  # pylint: disable=g-import-not-at-top
  from tfdist import _net  # pylint: disable=g-import-not-at-top
  ports = _net.free_ports(num_workers + 2)
  jobs = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
          "worker": [f"127.0.0.1:{p}" for p in ports[2:]]}
  for job in ("worker", "ps"):
    for index in range(len(jobs[job])):
      server_lib.start_server({"cluster": jobs,
                               "task": {"type": job, "index": index}})
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


def dataset_fn(x, y):
  """Per-replica batches cut from global batches in order."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def fn(ctx):
    per_replica = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
    width = GLOBAL_BATCH // ctx.num_input_pipelines
    start = ctx.input_pipeline_id * width
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        GLOBAL_BATCH, drop_remainder=True).repeat()
    ds = ds.map(lambda a, b: (a[start:start + width], b[start:start + width]))
    return ds.unbatch().batch(per_replica, drop_remainder=True)
  return fn


def weights(model_) -> list:
  return np.concatenate([w.numpy().ravel() for w in model_.weights]).tolist()
