"""The strategy catalog: one table that the flags and the factory both read."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

import tfdist
import tfdist.flags
from tfdist.strategy import catalog

_BUILT = ("central_storage", "default", "mirrored", "multi_worker_mirrored",
          "one_device", "parameter_server", "tpu")


class TableTest(parameterized.TestCase):

  def test_public_lists_keep_their_values(self):
    self.assertEqual(tfdist.STRATEGY_NAMES, ("auto", *_BUILT))
    self.assertEqual(tfdist.flags.STRATEGY_CHOICES,
                     ("auto", "central_storage", "default", "mirrored",
                      "multi_worker_mirrored", "off", "one_device",
                      "parameter_server", "tpu"))
    self.assertEqual(tfdist.flags.ALL_REDUCE_ALGS,
                     ("hierarchical_copy", "nccl", "reduction_to_one_device",
                      "ring"))
    self.assertEqual(catalog.BUILT_NAMES, _BUILT)

  def test_off_is_the_default_strategy(self):
    self.assertIs(catalog.lookup("off"), catalog.CATALOG["default"])

  def test_unknown_name(self):
    with self.assertRaises(KeyError):
      catalog.lookup("horovod")

  def test_every_built_name_has_a_builder(self):
    from tfdist.strategy import factory  # pylint: disable=g-import-not-at-top
    self.assertCountEqual(factory._BUILDERS, catalog.BUILT_NAMES)  # pylint: disable=protected-access

  @parameterized.named_parameters((n, n) for n in _BUILT)
  def test_options_for_reads_the_catalog(self, name):
    from tfdist.strategy import factory  # pylint: disable=g-import-not-at-top
    self.assertIsInstance(factory.options_for(name, {}),
                          catalog.CATALOG[name].options)

  def test_auto_takes_every_builders_options(self):
    every = {f.name for n in _BUILT
             for f in dataclasses.fields(catalog.CATALOG[n].options)}
    self.assertEqual(catalog.option_fields("auto"), every)
    self.assertEqual(catalog.option_fields("default"), frozenset())

  @parameterized.named_parameters(
      (f"{s.name}_{alg}", s.name, alg)
      for s in catalog.CATALOG.values() for alg in s.all_reduce)
  def test_all_reduce_algs_are_valid_options(self, name, alg):
    spec = catalog.CATALOG[name]
    field, value = spec.all_reduce[alg]
    self.assertEqual(getattr(spec.options(**{field: value}), field), value)

  @parameterized.named_parameters(
      (f"{s.name}_{n}", s.name, n)
      for s in catalog.CATALOG.values() if s.gpus
      for n in range(0, (s.gpus.most or 3) + 1))
  def test_gpu_rules_give_valid_options(self, name, n):
    spec = catalog.CATALOG[name]
    spec.options(**spec.gpus.options(n))

  @parameterized.named_parameters(
      ("none", 0, ("/cpu:0",)), ("one", 1, ("/gpu:0",)),
      ("two", 2, ("/gpu:0", "/gpu:1")))
  def test_gpu_devices(self, n, devices):
    self.assertEqual(catalog.gpu_devices(n), devices)

  def test_roles_rule_is_checked(self):
    with self.assertRaises(tfdist.ConfigError) as e:
      catalog.StrategySpec(name="x", options=None, roles="some")
    self.assertEqual(e.exception.field, "roles")


class LightTest(absltest.TestCase):

  def test_catalog_flags_and_startup_helper_load_no_tensorflow(self):
    code = ("import sys, tfdist, tfdist.flags; "
            "from tfdist.strategy import catalog, startup; "
            "tfdist.STRATEGY_NAMES; tfdist.flags.define_flags(); "
            "sys.exit('tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, timeout=120, check=False)
    self.assertEqual(result.returncode, 0, result.stderr[-2000:])


if __name__ == "__main__":
  absltest.main()
