"""What tfdist knows about objects not its own, kept off them.

A `SideTable` maps an object (a Keras optimizer, a callback) to one kind of
value tfdist keeps about it, so nothing of tfdist's shows on the object:
``dir()``, ``vars()``, ``get_config()`` and Keras's serialization see what
they see under TensorFlow's own strategies. An entry goes when its object
does.

Entries are keyed by ``id()`` and held with a weak reference, so objects
that are not hashable, or that compare equal to another, each have their
own; an object without weak references (``__slots__`` and no
``__weakref__``) is refused with ``TypeError``.

Example:
  >>> created_at = SideTable("where an optimizer was created")
  >>> created_at.set(optimizer, ("train.py", 12))
  >>> created_at.get(optimizer)
  ('train.py', 12)
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

__all__ = ["SideTable"]

_V = TypeVar("_V")


class SideTable(Generic[_V]):
  """One kind of value, per object, for the object's lifetime.

  Safe from several threads with no lock: each call is one operation on a
  dict keyed by ``int``, atomic in CPython (per-dict locked in free-threaded
  builds). A lock would deadlock: the garbage collector may run a weak
  reference's callback, which removes an entry, inside any call, in the
  thread holding it. An ``id`` names one live object: that callback removes
  a dead object's entry before its memory, and so its ``id``, can be used
  again. Values are held strongly: one that refers to its object would keep
  the object alive.

  Args:
    what: the kind of value, as an error names it.
  """

  def __init__(self, what: str):
    self.what = what
    self._entries: dict[int, tuple[weakref.ref, _V]] = {}

  def set(self, obj: Any, value: _V) -> None:
    """Keeps ``value`` for ``obj`` (replacing any) while ``obj`` lives.

    Raises:
      TypeError: ``obj`` cannot be weakly referenced.
    """
    key = id(obj)
    try:
      ref = weakref.ref(obj, lambda _, key=key: self._entries.pop(key, None))
    except TypeError:
      raise TypeError(
          f"tfdist keeps {self.what} beside the object, which needs a weak "
          f"reference to it; {type(obj).__name__} objects have none (give "
          "the class __weakref__ in its __slots__)") from None
    self._entries[key] = (ref, value)

  def get(self, obj: Any, default: _V | None = None) -> _V | None:
    """The value kept for ``obj``, else ``default``."""
    entry = self._entries.get(id(obj))
    return default if entry is None else entry[1]

  def pop(self, obj: Any, default: _V | None = None) -> _V | None:
    """Forgets ``obj``'s value and returns it, else ``default``."""
    entry = self._entries.pop(id(obj), None)
    return default if entry is None else entry[1]

  def __len__(self) -> int:
    """Objects with a value (alive)."""
    return len(self._entries)
