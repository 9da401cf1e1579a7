"""A backup directory belongs to one job: its owner record, and what to remove.

The chief records the job that first writes a backup or checkpoint directory
in ``tfdist-owner.json`` (written to a temporary name, then linked into place,
so it never replaces anything): the model's architecture (each layer's class
and configuration, its name aside, and the optimizers' classes), a
fingerprint of its variables (their names, shapes and dtypes, in order) and
the cluster shapes that have used it (job names and task counts; an
evaluator is no part of training). A run that finds another model's record
there, or files and no record, is refused with a `tfdist.ConfigError` that
names the first difference (``layer `dense`: activation `relu` here, `tanh`
in the backup``) before anything is read or written: two jobs given one
directory would otherwise resume from each other's state or remove it. Two
models of the same variables differ by architecture alone (an activation, a
dropout rate), so the variables are not enough. A layer that gives no
configuration is known by its class, and the chief says so once. `release` removes only what tfdist wrote: checkpoint files, the state
file and the record, and the directory itself when tfdist created it;
`claim` removes the partial saves a killed run left (`remove_partial`).

Runs of one model count as one job, on any cluster shape: a job restarted on
more or fewer workers (or ps tasks) resumes from its backup, and the chief
adds the new shape to the record's ``clusters``. A job that changed its model
needs a new directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from typing import Any, Iterable

from absl import logging
import keras
import tensorflow as tf

from tfdist import _process
from tfdist.errors import ConfigError
from tfdist.strategy import introspect
from tfdist.strategy import keras_callbacks

__all__ = ["OWNER_FILE", "owner_of", "claim", "clusters", "release",
           "remove_partial"]

#: The owner record in a backup or checkpoint directory.
OWNER_FILE = "tfdist-owner.json"
_TMP_PREFIX = f".{OWNER_FILE}."
# What tfdist writes there: TensorFlow's CheckpointManager's ckpt-N.index,
# ckpt-N.data-*, ckpt-N_temp/ mid-save, the ``checkpoint`` state file and its
# temporary; the owner record's temporaries.
_WRITTEN = re.compile(r"ckpt-\d+(\.index|\.data-\d+-of-\d+|_temp.*)"
                      r"|checkpoint(\.tmp.*)?|" + re.escape(_TMP_PREFIX) + ".*")
# A save cut short: TensorFlow's sharded writer's ckpt-N_temp/ of part-*
# shards (each written to a .tempstate file first), the state file's temporary.
_TEMP_DIR = re.compile(r"ckpt-\d+_temp")
_STATE_TMP = re.compile(r"checkpoint\.tmp[0-9a-f]+")
_SHARD = re.compile(r"part-\d+-of-\d+\.(index|data-\d+-of-\d+)(\.tempstate\d+)?")

Owner = dict[str, Any]


def owner_of(items: Iterable[Any], strategy: tf.distribute.Strategy
             ) -> Owner:
  """The owner record of a job training ``items`` under ``strategy``.

  Args:
    items: what the job saves: Keras models (their layers and variables),
      optimizers (their classes); anything else is not described.
    strategy: the strategy it trains under; ``cluster`` is this run's shape
      (the record keeps every shape seen in ``clusters``).
  """
  items = list(items)
  described = [[str(v.name), [None if d is None else int(d) for d in v.shape],
                str(getattr(v.dtype, "name", v.dtype))]
               for item in items for v in getattr(item, "weights", ())]
  digest = hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]
  layers = [_layer(layer) for item in items
            if isinstance(item, keras.layers.Layer)
            for layer in item._flatten_layers(  # pylint: disable=protected-access
                include_self=False, recursive=True)
            if not isinstance(layer, keras.Model)]  # Its layers are listed.
  unconfigured = tuple(name for name, _, config in layers if config is None)
  if (unconfigured and introspect.is_chief(strategy)
      and _process.once((_say_unconfigured, unconfigured))):
    _say_unconfigured(unconfigured)
  _, _, cluster = introspect.task_of(strategy)
  return {"model": digest, "variables": len(described), "layers": layers,
          "optimizers": [type(item).__name__ for item in items
                         if isinstance(item, keras.optimizers.Optimizer)],
          "cluster": {job: len(tasks) for job, tasks in sorted(cluster.items())
                      if job != "evaluator"}}


def _layer(layer: keras.layers.Layer) -> list[Any]:
  """``[name, class, configuration]``; the configuration as JSON gives it."""
  try:
    config = layer.get_config()
  except Exception:  # pylint: disable=broad-except
    config = None  # Not every custom layer can give one.
  if isinstance(config, dict):
    config = json.loads(json.dumps(
        {k: v for k, v in config.items() if k != "name"}, sort_keys=True,
        default=lambda o: f"<{type(o).__qualname__}>"))
  return [layer.name, type(layer).__name__, config]


def _say_unconfigured(names: tuple[str, ...]) -> None:
  logging.warning(
      "tfdist: layer%s %s give%s no configuration (get_config failed); the "
      "backup directory's owner record knows %s by class and variables",
      "s" * (len(names) > 1), ", ".join(f"`{n}`" for n in names),
      "" if len(names) > 1 else "s", "them" if len(names) > 1 else "it")


def claim(directory: str, owner: Owner, *, strategy: tf.distribute.Strategy,
          field: str, source: str) -> None:
  """Checks that ``directory`` is ``owner``'s; the chief records it there.

  Every worker checks; only the chief writes (creating the directory when it
  is missing), which also proves before training that it can write there.

  Raises:
    ConfigError: another job's record, files without a record, or a
      directory the chief cannot write.
  """
  record = _read(directory, field=field, source=source)
  if record is None:
    # The chief may record its claim between the read and the listing: its
    # record is checked below, as if it had been there first.
    keras_callbacks.refuse_unowned(
        directory, own=lambda n: n.startswith(_TMP_PREFIX) or n == OWNER_FILE,
        writer=f"tfdist (there is no {OWNER_FILE})", refusal=ConfigError,
        field=field, source=source)
    record = _read(directory, field=field, source=source)
  if record is not None:
    _check_same(directory, record, owner, field=field, source=source)
  if introspect.is_chief(strategy):
    remove_partial(directory)  # Left by a killed run: never resumed from.
    seen = clusters(record or {})
    update = None  # A known shape writes nothing, only proves it could.
    if owner["cluster"] not in seen:
      update = {k: v for k, v in (record or owner).items() if k != "cluster"}
      update["clusters"] = [*seen, owner["cluster"]]
    if _write(directory, update, replace=record is not None, field=field,
              source=source):  # Another chief linked a record first.
      claim(directory, owner, strategy=strategy, field=field, source=source)


def clusters(record: Owner) -> list[dict[str, int]]:
  """The cluster shapes that have used a directory, oldest first."""
  if "clusters" in record:
    return list(record["clusters"])
  return [record["cluster"]] if "cluster" in record else []


def release(directory: str, strategy: tf.distribute.Strategy) -> None:
  """Removes what tfdist wrote in ``directory`` (the chief only)."""
  if not introspect.is_chief(strategy) or not os.path.isdir(directory):
    return
  try:
    with open(os.path.join(directory, OWNER_FILE)) as f:
      created = bool(json.load(f).get("created"))
  except (OSError, ValueError, AttributeError):
    return  # Not a directory tfdist claimed: leave it as it is.
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    if _WRITTEN.fullmatch(name) and (_TEMP_DIR.fullmatch(name) is None
                                     or _shards_only(path)):
      _remove(path)
  os.remove(os.path.join(directory, OWNER_FILE))
  if created:
    try:
      os.rmdir(directory)  # Only when empty: what others put there stays.
    except OSError:
      pass


def remove_partial(directory: str, before: Iterable[str] | None = None
                   ) -> None:
  """Removes partial saves from ``directory``, and nothing else.

  Without ``before``: what a killed run left, ``ckpt-N_temp`` directories
  holding only TensorFlow's shards and the state file's temporaries. With
  ``before``, the names there before a save that failed: also the checkpoint
  files that save added.
  """
  for name in _listing(directory):
    path = os.path.join(directory, name)
    if (before is not None and name not in before and _WRITTEN.fullmatch(name)
        or _STATE_TMP.fullmatch(name) and os.path.isfile(path)
        or _TEMP_DIR.fullmatch(name) and _shards_only(path)):
      _remove(path)


def _shards_only(path: str) -> bool:
  """True for a directory of TensorFlow's shards only (or of nothing)."""
  return (os.path.isdir(path) and not os.path.islink(path)
          and all(_SHARD.fullmatch(n) for n in os.listdir(path)))


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    os.remove(path)


def _listing(directory: str) -> list[str]:
  if not os.path.lexists(directory):
    return []
  if not os.path.isdir(directory):
    return [directory]
  return [n for n in os.listdir(directory) if not n.startswith(_TMP_PREFIX)]


def _read(directory: str, *, field: str, source: str) -> Owner | None:
  path = os.path.join(directory, OWNER_FILE)
  try:
    with open(path) as f:
      record = json.load(f)
  except (FileNotFoundError, NotADirectoryError):
    return None
  except (OSError, ValueError) as e:
    record = e
  if not isinstance(record, dict):
    raise ConfigError(field=field, value=directory, source=source,
                      expected=f"a readable {OWNER_FILE} written by tfdist "
                               f"({str(record)[:120]})",
                      hint=keras_callbacks.FRESH.format(
                          field=field, directory=directory))
  return record


def _check_same(directory: str, record: Owner, owner: Owner, *, field: str,
                source: str) -> None:
  difference = _first_difference(record, owner)
  if difference is None:
    return
  raise ConfigError(
      field=field, value=directory, source=source,
      expected=f"a directory of this job; it holds another job's state "
               f"({difference})",
      hint=keras_callbacks.FRESH.format(field=field, directory=directory))


def _first_difference(record: Owner, owner: Owner) -> str | None:
  """The first way ``owner``'s model differs from ``record``'s, or None.

  A record without ``layers`` (an older tfdist's) is compared by variables.
  """
  if "layers" in record:
    theirs, ours = record["layers"], owner["layers"]
    for i, (there, here) in enumerate(zip(theirs, ours)):
      where = f"layer `{here[0]}` ({i + 1} of {len(ours)})"
      if there[1] != here[1]:
        return f"{where}: a {here[1]} here, a {there[1]} in the backup"
      if there[2] != here[2]:
        keys = sorted({*(there[2] or {}), *(here[2] or {})})
        key = next((k for k in keys if (there[2] or {}).get(k, _NONE)
                    != (here[2] or {}).get(k, _NONE)), "configuration")
        return (f"{where}: {key} {_shown(here[2], key)} here, "
                f"{_shown(there[2], key)} in the backup")
    if len(theirs) != len(ours):
      return f"{len(ours)} layers here, {len(theirs)} in the backup"
    if record.get("optimizers") != owner["optimizers"]:
      return (f"optimizer {'/'.join(owner['optimizers']) or 'none'} here, "
              f"{'/'.join(record.get('optimizers') or []) or 'none'} in the "
              f"backup")
  if record.get("model") != owner["model"]:
    return (f"variables {owner['model']} ({owner['variables']}) here, "
            f"{record.get('model')} ({record.get('variables')}) in the "
            f"backup: their names, shapes or dtypes differ")
  return None


_NONE = object()  # A key a configuration does not have.


def _shown(config: dict[str, Any] | None, key: str) -> str:
  if config is None:
    return "(no configuration)"
  value = config.get(key, _NONE)
  if value is _NONE:
    return "(not set)"
  return f"`{value if isinstance(value, str) else json.dumps(value)}`"


def _write(directory: str, record: Owner | None, *, replace: bool, field: str,
           source: str) -> bool:
  """Records ``record`` (``None``: only tries a write) in ``directory``.

  A new record is linked into place, never over another; with ``replace``
  the chief's updated record is renamed over its own.

  Returns:
    True when another process linked a record first.
  """
  try:
    created = not os.path.isdir(directory)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=_TMP_PREFIX)
    try:
      with os.fdopen(fd, "w") as f:
        if record is not None:
          json.dump({"created": created, **record}, f)
      if record is not None and replace:
        os.replace(tmp, os.path.join(directory, OWNER_FILE))
      elif record is not None:
        # A link never replaces an existing file, unlike a rename.
        os.link(tmp, os.path.join(directory, OWNER_FILE))
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
  except FileExistsError:
    return True
  except OSError as e:
    raise ConfigError(field=field, value=directory, source=source,
                      expected="a directory the chief can create and write",
                      hint=f"Writing there failed: {e.strerror or e}"
                      ) from None
  return False
