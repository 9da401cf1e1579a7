"""Distributed input: batch sizes, shard policies and TFDS, stated explicitly.

* `Batching`: the global and per-replica batch sizes, one derived from the
  other with ``strategy.num_replicas_in_sync``.
* `choose_shard_policy`: FILE when there are at least as many files as
  workers, DATA otherwise, OFF for one worker; never ``AUTO``.
* `load_tfds`: this worker's shard of a TFDS split, read with
  ``tfds.ReadConfig(input_context=...)``; ``tfdist_digits`` builds offline.
  A TFDS name or a ``tfds.core.DatasetBuilder`` subclass (`DatasetName`).
* `distribute`: per-replica batches from an ``InputContext`` function through
  ``distribute_datasets_from_function``; `make_dataset_fn` gives the same
  ``dataset_fn`` to APIs that take one (ParameterServerStrategy's
  ``create_per_worker_dataset``).
"""

from tfdist import _lazy

# Public name -> the module that defines it. Names load on first use, so a
# worker that never reads a TFDS name never imports tensorflow_datasets
# (0.3 s of its start-up).
_EXPORTS: dict[str, str] = {
    "Batching": "tfdist.data.batching",
    "batching_for": "tfdist.data.batching",
    "is_tpu_strategy": "tfdist.data.batching",
    "static_batch_size": "tfdist.data.batching",
    "DatasetFn": "tfdist.data.feed",
    "distribute": "tfdist.data.feed",
    "distribute_dataset": "tfdist.data.feed",
    "make_dataset_fn": "tfdist.data.feed",
    "ShardPolicy": "tfdist.data.sharding",
    "choose_shard_policy": "tfdist.data.sharding",
    "files_for_pipeline": "tfdist.data.sharding",
    "set_shard_policy": "tfdist.data.sharding",
    "shard_by_data": "tfdist.data.sharding",
    "shard_policy_of": "tfdist.data.sharding",
    "DIGITS_NAME": "tfdist.data.synthetic",
    "TfdistDigits": "tfdist.data.synthetic",
    "prepare_digits": "tfdist.data.synthetic",
    "DatasetName": "tfdist.data.tfds_input",
    "load_tfds": "tfdist.data.tfds_input",
    "tfds_builder": "tfdist.data.tfds_input",
    "tfds_dataset_fn": "tfdist.data.tfds_input",
    "num_input_workers": "tfdist.strategy.introspect",
}

_lazy.install(globals(), _EXPORTS)
