"""TFDS datasets, one shard per worker.

`load_tfds` reads a TFDS split for one input pipeline. With an
`InputContext` from ``distribute_datasets_from_function`` it shards by the
table in `tfdist.data.sharding`: FILE (``tfds.ReadConfig(input_context=...)``,
each worker opens only its own files) when the split has at least one file per
pipeline, DATA (read all, keep every n-th example) otherwise.

``tfdist_digits`` (`tfdist.data.synthetic`) is built locally on first use and
needs no network. Other names (``mnist``, ...) go through TFDS as usual: used
where prepared under ``data_dir``, downloaded and prepared otherwise; when
neither works the error names the dataset and the directory. A
``tfds.core.DatasetBuilder`` subclass may stand for a name, e.g. one defined
with ``skip_registration=True`` that ``tfds.builder`` cannot find.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import tensorflow as tf
import tensorflow_datasets as tfds

from tfdist.data.feed import DatasetFn
from tfdist.data.feed import make_dataset_fn
from tfdist.data.feed import MapFn
from tfdist.data import prepare as prepare_lib
from tfdist.data import sharding
from tfdist.data import synthetic
from tfdist.errors import ConfigError

__all__ = ["DatasetName", "load_tfds", "tfds_builder", "tfds_dataset_fn"]

#: A TFDS name, or a builder class standing for one.
DatasetName = str | type[tfds.core.DatasetBuilder]

_SOURCE = "load_tfds"


def tfds_builder(name: DatasetName, *,
                 data_dir: str | os.PathLike[str] | None = None,
                 download: bool = True,
                 download_timeout_s: float | None = 600.0,
                 wait_timeout_s: float = prepare_lib.WAIT_TIMEOUT_SECONDS
                 ) -> tfds.core.DatasetBuilder:
  """A prepared TFDS builder for ``name``: found, built or downloaded.

  Args:
    name: a TFDS name, optionally with config and version
      (``"mnist"``, ``"mnist:3.*.*"``), or ``"tfdist_digits"``; or a
      ``tfds.core.DatasetBuilder`` subclass, constructed here with
      ``data_dir`` (for builders ``tfds.builder`` does not find by name).
    data_dir: the TFDS data directory; TFDS's default (``$TFDS_DATA_DIR`` or
      ``~/tensorflow_datasets``) when omitted, `synthetic.default_data_dir`
      for ``tfdist_digits``.
    download: download and prepare a dataset that is not prepared yet.
    download_timeout_s: the longest wait for that; ``None`` waits as long as
      it takes. A download still running then is abandoned in the
      background.
    wait_timeout_s: in a cluster only the chief prepares (behind a lock in
      the data directory); the other workers wait for it this long, then
      read (`tfdist.data.prepare`).

  Returns:
    The builder, prepared.

  Raises:
    ConfigError: an unknown name, or a dataset that is not prepared and could
      not be downloaded (``download=False``, no network, a timeout, a manual
      download). The message names the dataset and the directory.
  """
  if name in (synthetic.DIGITS_NAME, synthetic.TfdistDigits):
    return synthetic.prepare_digits(data_dir, lock_timeout_s=wait_timeout_s)
  data_dir = os.fspath(data_dir) if data_dir else None
  if isinstance(name, type) and issubclass(name, tfds.core.DatasetBuilder):
    builder_class = name
    builder = builder_class(data_dir=data_dir)
    name = builder.name
    make = lambda: builder_class(data_dir=data_dir)
  elif isinstance(name, str):
    try:
      builder = tfds.builder(name, data_dir=data_dir)
      make = lambda: tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError as e:
      raise ConfigError(
          field="dataset", value=name, source=_SOURCE,
          expected="a name from tfds.list_builders()",
          hint=(f"{synthetic.DIGITS_NAME!r} builds offline; TFDS said: "
                f"{str(e).splitlines()[0]}")) from None
  else:
    raise ConfigError(
        field="dataset", value=f"{name!r} (of type {type(name).__name__})",
        source=_SOURCE,
        expected="a TFDS name or a tfds.core.DatasetBuilder subclass")
  if builder.is_prepared():
    return builder
  where = builder.data_dir
  if not download:
    raise ConfigError(
        field="dataset", value=name, source=_SOURCE,
        expected=f"a dataset prepared under {where}",
        hint=(f"Pass download=True, copy a prepared {name} there, or use "
              f"{synthetic.DIGITS_NAME!r}, which builds offline"))
  root = data_dir or getattr(builder, "_data_dir_root", None) or (
      synthetic.default_data_dir())
  return prepare_lib.prepared(
      make, lambda b: _download_and_prepare(b, name, where,
                                            download_timeout_s),
      name=name.replace("/", "_").replace(":", "_"), data_dir=os.fspath(root),
      timeout_s=wait_timeout_s)


def _download_and_prepare(builder: tfds.core.DatasetBuilder, name: str,
                          where: str, timeout_s: float | None) -> None:
  """Runs ``builder.download_and_prepare`` with a bounded wait."""
  failures: list[BaseException] = []

  def target():
    try:
      builder.download_and_prepare()
    except BaseException as e:  # pylint: disable=broad-except
      failures.append(e)

  # A thread, because TFDS's downloader sets no socket timeouts: with no route
  # to the source a call can block for a very long time.
  thread = threading.Thread(target=target, name=f"tfds-prepare-{name}",
                            daemon=True)
  thread.start()
  thread.join(timeout_s)
  hint = (f"On a machine without network, prepare {name} elsewhere and copy "
          f"its directory under {where}, or use {synthetic.DIGITS_NAME!r}, "
          "which builds offline")
  if thread.is_alive():
    raise ConfigError(
        field="dataset", value=name, source=_SOURCE,
        expected=(f"a dataset prepared under {where}, or downloaded and "
                  f"prepared within download_timeout_s={timeout_s:g} s"),
        hint=hint)
  if failures:
    error = failures[0]
    raise ConfigError(
        field="dataset", value=name, source=_SOURCE,
        expected=(f"a dataset prepared under {where}, or one TFDS can "
                  "download and prepare"),
        hint=(f"Downloading failed with {type(error).__name__}: "
              f"{_first_line(error).rstrip('.')}. {hint}")) from error


def load_tfds(name: DatasetName, *, split: str,
              input_context: tf.distribute.InputContext | None = None,
              data_dir: str | os.PathLike[str] | None = None,
              as_supervised: bool = False,
              shuffle_files: bool = False,
              seed: int | None = None,
              download: bool = True,
              download_timeout_s: float | None = 600.0,
              decoders: Any = None) -> tf.data.Dataset:
  """Reads this input pipeline's share of a TFDS split, unbatched.

  Args:
    name, data_dir, download, download_timeout_s: as in `tfds_builder`.
    split: a split or slice, e.g. ``"train"`` or ``"train[:10%]"``.
    input_context: from ``distribute_datasets_from_function``; ``None`` (or
      one pipeline) reads the whole split.
    as_supervised: ``(image, label)``-style tuples instead of dicts.
    shuffle_files: shuffle the order of this pipeline's files.
    seed: the file-shuffle seed; with DATA sharding 0 when omitted, so that
      every pipeline reads one order and keeps a disjoint share.
    decoders: passed to ``as_dataset``.

  Returns:
    The examples of this pipeline, marked ``OFF`` for auto-sharding when an
    ``input_context`` sharded them.

  Raises:
    ConfigError: from `tfds_builder`, or an unknown split.
  """
  builder = tfds_builder(name, data_dir=data_dir, download=download,
                         download_timeout_s=download_timeout_s)
  num_files = _num_files(
      builder, name if isinstance(name, str) else builder.name, split)
  pipelines = input_context.num_input_pipelines if input_context else 1
  policy = sharding.choose_shard_policy(num_workers=pipelines,
                                        num_files=num_files)
  if policy == sharding.ShardPolicy.DATA and shuffle_files and seed is None:
    # DATA keeps every n-th example of one order, which every pipeline must
    # share for the shares to be disjoint: the file order needs a fixed seed.
    seed = 0
  read_config = tfds.ReadConfig(
      # TFDS caches small datasets in memory by default; a training loop that
      # stops mid-pass then triggers TF's "partially cached" warning.
      try_autocache=False,
      shuffle_seed=seed,
      input_context=input_context if policy == sharding.ShardPolicy.FILE
      else None)
  dataset = builder.as_dataset(
      split=split, as_supervised=as_supervised, shuffle_files=shuffle_files,
      read_config=read_config, decoders=decoders)
  if policy == sharding.ShardPolicy.DATA:
    return sharding.shard_by_data(dataset, input_context)
  if input_context is not None:
    dataset = sharding.set_shard_policy(dataset, sharding.ShardPolicy.OFF)
  return dataset


def tfds_dataset_fn(name: DatasetName, *, split: str, global_batch_size: int,
                    data_dir: str | os.PathLike[str] | None = None,
                    as_supervised: bool = True,
                    map_fn: MapFn | None = None,
                    shuffle_buffer_size: int = 0,
                    seed: int | None = None,
                    repeat: bool = False,
                    drop_remainder: bool = False,
                    download: bool = True) -> DatasetFn:
  """A ``dataset_fn`` of per-replica batches of a TFDS split.

  `load_tfds` with the context, then `tfdist.data.make_dataset_fn`. Give it to
  ``strategy.distribute_datasets_from_function`` or, under
  ParameterServerStrategy, ``coordinator.create_per_worker_dataset``.

  Args:
    name, data_dir, download: as in `tfds_builder`.
    split: as in `load_tfds`.
    global_batch_size: examples per step over all replicas.
    as_supervised: tuples (the default here, what ``model.fit`` takes).
    map_fn: applied to each example before batching.
    shuffle_buffer_size: examples in the shuffle buffer (files are shuffled
      too when it is non-zero).
    seed: shuffle seed.
    repeat: repeat forever.
    drop_remainder: drop the last, smaller batch.

  Returns:
    ``dataset_fn(input_context) -> tf.data.Dataset``.
  """

  def examples_fn(input_context):
    return load_tfds(name, split=split, input_context=input_context,
                     data_dir=data_dir, as_supervised=as_supervised,
                     shuffle_files=bool(shuffle_buffer_size), seed=seed,
                     download=download)

  return make_dataset_fn(
      examples_fn, global_batch_size=global_batch_size,
      drop_remainder=drop_remainder, map_fn=map_fn,
      shuffle_buffer_size=shuffle_buffer_size, seed=seed, repeat=repeat)


def _num_files(builder: tfds.core.DatasetBuilder, name: str,
               split: str) -> int | None:
  """The files ``split`` reads; ``None`` when TFDS does not know them."""
  splits = builder.info.splits
  if not splits:  # e.g. tfds.testing.mock_data without metadata.
    return None
  try:
    return len(splits[split].file_instructions)
  except (KeyError, ValueError, AssertionError) as e:
    raise ConfigError(
        field="split", value=split, source=f"{_SOURCE}({name!r})",
        expected=(f"one of {sorted(splits)}, or a slice such as "
                  f"'{sorted(splits)[0]}[:10%]'"),
        hint=_first_line(e)) from None


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__
