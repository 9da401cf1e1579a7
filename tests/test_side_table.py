"""`tfdist._compat.side_table`: values kept beside objects, gone with them."""

import gc
import threading

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist._compat.side_table import SideTable

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.


class Plain:
  pass


class Unhashable:
  __hash__ = None


class EqualToAll:
  def __eq__(self, other):
    return True

  def __hash__(self):
    return 0


class Slotted:
  __slots__ = ("x",)


class InACycle:
  def __init__(self):
    self.me = self


class SideTableTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("plain", Plain),
      ("unhashable", Unhashable),
      ("equal_to_all", EqualToAll),
      ("in_a_cycle", InACycle),
  )
  def test_each_object_has_its_own_value_until_it_goes(self, cls):
    table = SideTable("a test value")
    first, second = cls(), cls()
    table.set(first, 1)
    table.set(second, 2)
    self.assertEqual((table.get(first), table.get(second)), (1, 2))
    self.assertEqual(sorted(vars(first)), sorted(vars(cls())))  # Nothing on it.
    self.assertLen(table, 2)
    del first
    gc.collect()  # A cycle goes only with the collector.
    self.assertLen(table, 1)
    self.assertEqual(table.get(second), 2)

  def test_set_replaces_and_pop_forgets(self):
    table = SideTable("a test value")
    obj = Plain()
    self.assertEqual(table.get(obj, "none"), "none")
    table.set(obj, 1)
    table.set(obj, 2)
    self.assertLen(table, 1)
    self.assertEqual(table.pop(obj), 2)
    self.assertIsNone(table.pop(obj))
    self.assertEqual(table.get(obj, "none"), "none")
    del obj
    gc.collect()
    self.assertEmpty(table)

  def test_an_object_without_weak_references_is_refused(self):
    table = SideTable("a test value")
    with self.assertRaisesRegex(
        TypeError, r"tfdist keeps a test value beside the object.*Slotted "
        r"objects have none \(give the class __weakref__ in its __slots__\)"):
      table.set(Slotted(), 1)
    self.assertEmpty(table)

  def test_threads_setting_reading_and_dropping_at_once(self):
    table = SideTable("a test value")
    shared = Plain()
    errors = []

    def work(index):
      try:
        for round_ in range(2000):
          # Freed by the collector, in whichever thread it runs.
          mine = InACycle()
          table.set(mine, (index, round_))
          table.set(shared, index)
          if table.get(mine) != (index, round_):
            errors.append((index, round_, table.get(mine)))
          if round_ % 2:
            table.pop(mine)
          # ``mine`` goes here, each other round with its value.
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join(timeout=60)
    self.assertFalse(any(t.is_alive() for t in threads))
    self.assertEqual(errors, [])
    self.assertIn(table.get(shared), range(8))
    gc.collect()
    self.assertLen(table, 1)  # ``shared`` alone is alive.


if __name__ == "__main__":
  absltest.main()
