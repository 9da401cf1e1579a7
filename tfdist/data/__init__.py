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

Example::

    import tfdist
    from tfdist import data

    strategy = tfdist.make_strategy("auto")
    dist = data.distribute(
        strategy,
        lambda ctx: data.load_tfds("tfdist_digits", split="train",
                                   input_context=ctx, as_supervised=True),
        global_batch_size=64)
"""

from tfdist.data.batching import Batching
from tfdist.data.batching import batching_for
from tfdist.data.batching import is_tpu_strategy
from tfdist.data.batching import static_batch_size
from tfdist.data.feed import DatasetFn
from tfdist.data.feed import distribute
from tfdist.data.feed import distribute_dataset
from tfdist.data.feed import make_dataset_fn
from tfdist.data.sharding import ShardPolicy
from tfdist.data.sharding import choose_shard_policy
from tfdist.data.sharding import files_for_pipeline
from tfdist.data.sharding import set_shard_policy
from tfdist.data.sharding import shard_by_data
from tfdist.data.sharding import shard_policy_of
from tfdist.data.synthetic import DIGITS_NAME
from tfdist.data.synthetic import TfdistDigits
from tfdist.data.synthetic import prepare as prepare_digits
from tfdist.data.tfds_input import DatasetName
from tfdist.data.tfds_input import load_tfds
from tfdist.data.tfds_input import tfds_builder
from tfdist.data.tfds_input import tfds_dataset_fn
from tfdist.strategy.introspect import num_input_workers

__all__ = [
    "Batching",
    "DIGITS_NAME",
    "DatasetFn",
    "DatasetName",
    "ShardPolicy",
    "TfdistDigits",
    "batching_for",
    "choose_shard_policy",
    "distribute",
    "distribute_dataset",
    "files_for_pipeline",
    "is_tpu_strategy",
    "load_tfds",
    "make_dataset_fn",
    "num_input_workers",
    "prepare_digits",
    "set_shard_policy",
    "shard_by_data",
    "shard_policy_of",
    "static_batch_size",
    "tfds_builder",
    "tfds_dataset_fn",
]
