"""Shard policies, chosen on purpose rather than left to ``AUTO``.

Under multi-worker training every worker must read a different part of the
data. TensorFlow's default, ``AutoShardPolicy.AUTO``, tries FILE sharding and
falls back to DATA with a warning when the source is not a list of files.
tfdist decides instead, and records the decision on the dataset's options:

| workers | files the source reads | policy | each worker                   |
|---------|------------------------|--------|-------------------------------|
| 1       | any                    | OFF    | reads everything              |
| n > 1   | at least n             | FILE   | reads its own files           |
| n > 1   | fewer than n, unknown  | DATA   | reads all, keeps every n-th   |

FILE reads each byte once but needs at least one file per worker (more gives
more even shares). DATA works for any source, at the price of every worker
reading and discarding the others' examples.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = ["ShardPolicy", "choose_shard_policy", "files_for_pipeline",
           "set_shard_policy", "shard_by_data", "shard_policy_of"]

ShardPolicy = tf.data.experimental.AutoShardPolicy
_T = TypeVar("_T")


def choose_shard_policy(*, num_workers: int,
                        num_files: int | None) -> ShardPolicy:
  """Applies the table in this module's docstring.

  Args:
    num_workers: input pipelines to feed, e.g.
      ``input_context.num_input_pipelines`` or `tfdist.data.num_input_workers(strategy)`.
    num_files: files the source reads; ``None`` when it reads none or the
      count is unknown (a generator, ``from_tensor_slices``, ``range``).

  Returns:
    ``OFF``, ``FILE`` or ``DATA``; never ``AUTO``.

  Raises:
    ConfigError: ``num_workers`` below 1 or ``num_files`` negative.
  """
  if isinstance(num_workers, bool) or not isinstance(num_workers, int) or (
      num_workers < 1):
    raise ConfigError(field="num_workers", value=num_workers,
                      expected="a positive integer",
                      source="choose_shard_policy")
  if num_files is not None and (isinstance(num_files, bool) or
                                not isinstance(num_files, int) or
                                num_files < 0):
    raise ConfigError(field="num_files", value=num_files,
                      expected="a non-negative integer, or None if unknown",
                      source="choose_shard_policy")
  if num_workers == 1:
    return ShardPolicy.OFF
  if num_files is not None and num_files >= num_workers:
    return ShardPolicy.FILE
  return ShardPolicy.DATA


def set_shard_policy(dataset: tf.data.Dataset,
                     policy: ShardPolicy) -> tf.data.Dataset:
  """Returns ``dataset`` with ``policy`` as its auto-shard policy.

  ``tf.distribute`` reads it in ``experimental_distribute_dataset``; with
  anything but ``AUTO`` there it neither guesses nor warns.
  """
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = policy
  return dataset.with_options(options)


def shard_policy_of(dataset: tf.data.Dataset) -> ShardPolicy:
  """The auto-shard policy ``dataset``'s options carry (``AUTO`` if unset)."""
  return dataset.options().experimental_distribute.auto_shard_policy


def shard_by_data(dataset: tf.data.Dataset,
                  input_context: tf.distribute.InputContext | None
                  ) -> tf.data.Dataset:
  """Keeps this input pipeline's share of ``dataset``, example by example.

  Pipeline ``i`` of ``n`` keeps examples ``i, i + n, i + 2n, ...``. The result
  is marked ``OFF`` so that ``tf.distribute`` does not shard it again.

  Args:
    dataset: the full, unbatched dataset; deterministic order, so that the
      shares are disjoint.
    input_context: from ``distribute_datasets_from_function``; ``None`` or one
      pipeline keeps everything.
  """
  if input_context is not None and input_context.num_input_pipelines > 1:
    dataset = dataset.shard(input_context.num_input_pipelines,
                            input_context.input_pipeline_id)
  return set_shard_policy(dataset, ShardPolicy.OFF)


def files_for_pipeline(files: Sequence[_T],
                       input_context: tf.distribute.InputContext | None
                       ) -> tuple[list[_T], ShardPolicy]:
  """This input pipeline's files, and the policy that chose them.

  With FILE (at least one file per pipeline) pipeline ``i`` of ``n`` gets
  ``files[i::n]``. With DATA it gets every file and must call
  `shard_by_data` on the examples it reads.
  """
  files = list(files)
  n = input_context.num_input_pipelines if input_context is not None else 1
  policy = choose_shard_policy(num_workers=n, num_files=len(files))
  if policy == ShardPolicy.FILE:
    return files[input_context.input_pipeline_id::n], policy
  return files, policy
