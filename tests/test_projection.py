"""The alpha-beta model of `tfdist.bench.projection`: closed forms, checked.

Pure arithmetic: no TensorFlow and no timing; one subprocess runs
``tfdist bench --project``.
"""

import json
import math
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
from tfdist.bench import projection

_MB = 1 << 20
# A link with round numbers: 1e9 bytes/s, 10 us a hop.
_LINK = projection.Link(bytes_per_s=1e9, latency_s=1e-5)
_NO_LATENCY = projection.Link(bytes_per_s=1e9, latency_s=0.0)


@pytest.mark.beside
class ClosedFormTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # p, S: 2 (p - 1) alpha + 2 (p - 1) / p * S / B.
      ("two_hosts", 2, 1e9, 2 * 1e-5 + 1.0),
      ("three_hosts", 3, 3e9, 4 * 1e-5 + 4.0),
      ("four_hosts", 4, 4e6, 6 * 1e-5 + 6e-3),
      ("sixty_four", 64, 64e6, 126 * 1e-5 + 126e-3),
      ("empty", 8, 0, 14 * 1e-5),
  )
  def test_ring(self, p, size, expected):
    self.assertAlmostEqual(projection.ring_seconds(p, size, _LINK), expected,
                           places=12)

  @parameterized.named_parameters(
      # p, depth d, bytes factor w: 2 d alpha + w S / B.
      ("two_hosts", 2, 1, 1.0),
      ("three_hosts", 3, 1, 1.5),
      ("four_hosts", 4, 2, 1.5),
      ("five_hosts", 5, 2, 2.0),
      ("eight_hosts", 8, 3, 2.0),
      ("sixty_four", 64, 6, 2.0),
      ("sixty_five", 65, 6, 2.0),
  )
  def test_tree(self, p, depth, factor):
    self.assertEqual(projection.tree_depth(p), depth)
    self.assertEqual(projection.tree_bytes_factor(p), factor)
    self.assertAlmostEqual(projection.tree_seconds(p, 1e9, _LINK),
                           2 * depth * 1e-5 + factor, places=12)

  def test_two_hosts_ring_is_s_over_b_each_way_and_equals_the_tree(self):
    # Two hosts: each sends half the tensor twice (reduce-scatter, then
    # all-gather): 2 * S / 2 / B, and two latencies.
    for size in (1.0, 4 * _MB, 64 * _MB):
      ring = projection.ring_seconds(2, size, _LINK)
      self.assertAlmostEqual(ring, 2 * (1e-5 + size / 2 / 1e9), places=12)
      self.assertAlmostEqual(ring, projection.tree_seconds(2, size, _LINK),
                             places=12)

  def test_link_at_is_line_rate_times_goodput(self):
    link = projection.link_at(10, latency_s=5e-5, goodput=0.9)
    self.assertAlmostEqual(link.bytes_per_s, 10e9 / 8 * 0.9)
    self.assertEqual(link.latency_s, 5e-5)

  def test_bench_models_gradient_bytes(self):
    self.assertEqual(projection.WIDE_MLP.gradient_bytes, 33_615_912)
    self.assertEqual(projection.CNN.gradient_bytes, 227_880)


@pytest.mark.beside
class ShapeTest(parameterized.TestCase):

  @parameterized.product(algorithm=sorted(projection.ALGORITHMS),
                         p=[2, 3, 4, 8, 64])
  def test_time_grows_with_size(self, algorithm, p):
    times = [projection.allreduce_seconds(algorithm, p, s, _LINK)
             for s in (0, 1 * _MB, 4 * _MB, 64 * _MB)]
    self.assertEqual(times, sorted(times))
    self.assertLess(times[0], times[-1])

  @parameterized.named_parameters(("ring", "ring"), ("tree", "tree"))
  def test_time_never_falls_with_hosts(self, algorithm):
    times = [projection.allreduce_seconds(algorithm, p, 16 * _MB, _LINK)
             for p in range(2, 130)]
    for fewer, more in zip(times, times[1:]):
      self.assertLessEqual(fewer, more + 1e-15)

  @parameterized.named_parameters(("ring", "ring"), ("tree", "tree"))
  def test_faster_link_is_faster(self, algorithm):
    for p in (2, 8, 64):
      slow, fast = (projection.allreduce_seconds(
          algorithm, p, 32 * _MB, projection.link_at(g)) for g in (10, 100))
      self.assertLess(fast, slow)

  def test_ring_bandwidth_term_tends_to_twice_the_tensor(self):
    # Bus traffic 2 (p - 1) / p * S: below 2 S, approaching it.
    for p in (2, 8, 64, 1024):
      t = projection.ring_seconds(p, 1e9, _NO_LATENCY)
      self.assertAlmostEqual(t, 2 * (p - 1) / p)
      self.assertLess(t, 2.0)

  def test_unknown_algorithm_names_the_known_ones(self):
    with self.assertRaisesRegex(ValueError, r"\['ring', 'tree'\].*'halving'"):
      projection.allreduce_seconds("halving", 4, 1.0, _LINK)

  @parameterized.named_parameters(("one", 1), ("zero", 0), ("float", 2.0))
  def test_host_count_below_two_is_refused(self, p):
    with self.assertRaisesRegex(ValueError, "p: expected an integer"):
      projection.ring_seconds(p, 1.0, _LINK)

  def test_link_refuses_non_positive_rate(self):
    with self.assertRaisesRegex(ValueError, "bytes_per_s=0"):
      projection.Link(bytes_per_s=0, latency_s=1e-5)


@pytest.mark.beside
class CrossoverTest(parameterized.TestCase):

  @parameterized.named_parameters(("three", 3), ("eight", 8), ("sixty_four", 64))
  def test_tree_below_ring_above(self, p):
    cross = projection.crossover_bytes(p, _LINK)
    self.assertGreater(cross, 0)
    self.assertTrue(math.isfinite(cross))
    ring, tree = projection.ring_seconds, projection.tree_seconds
    self.assertAlmostEqual(ring(p, cross, _LINK), tree(p, cross, _LINK),
                           places=9)
    self.assertLess(tree(p, cross / 2, _LINK), ring(p, cross / 2, _LINK))
    self.assertGreater(tree(p, cross * 2, _LINK), ring(p, cross * 2, _LINK))

  def test_closed_form_for_many_hosts(self):
    # p >= 5: S* = (2 (p - 1) - 2 log2 p) alpha B p / 2.
    p = 64
    self.assertAlmostEqual(projection.crossover_bytes(p, _LINK),
                           (126 - 12) * 1e-5 * 1e9 * p / 2)

  def test_special_host_counts(self):
    self.assertEqual(projection.crossover_bytes(2, _LINK), 0.0)
    self.assertEqual(projection.crossover_bytes(4, _LINK), math.inf)

  def test_crossover_grows_with_hosts_and_bandwidth(self):
    by_p = [projection.crossover_bytes(p, _LINK) for p in (3, 8, 64)]
    self.assertEqual(by_p, sorted(by_p))
    self.assertLess(projection.crossover_bytes(8, projection.link_at(10)),
                    projection.crossover_bytes(8, projection.link_at(100)))


@pytest.mark.beside
class StepTest(absltest.TestCase):

  def test_step_adds_compute_and_all_reduce(self):
    w = projection.Workload(name="w", gradient_bytes=int(1e9), compute_s=1.0)
    s = projection.step(w, p=2, link=_NO_LATENCY)
    self.assertAlmostEqual(s.allreduce_s, 1.0)
    self.assertAlmostEqual(s.step_s, 2.0)
    self.assertAlmostEqual(s.steps_per_s, 0.5)
    self.assertAlmostEqual(s.efficiency, 0.5)

  def test_project_table_covers_every_case(self):
    table = projection.project()
    for name in ("wide_mlp", "cnn"):
      for rate in ("1", "10", "100"):
        for p in ("2", "3", "4", "8", "64"):
          entry = table["steps"][name][rate][p]
          self.assertEqual(set(entry), {"ring", "tree"})
          for s in entry.values():
            self.assertGreater(s["efficiency"], 0)
            self.assertLess(s["efficiency"], 1)
    self.assertIsNone(table["crossover_bytes"]["10"]["4"])
    text = projection.format_table(table)
    self.assertIn("| 100 | 64 |", text)
    self.assertIn("tree always", text)

  def test_check_sets_measured_beside_predicted(self):
    sweep = {"ring": {"4": {"seconds": 0.01}},
             "none": {"4": {"seconds": 0.03}}}
    got = projection.check(sweep=sweep, link=_NO_LATENCY, p=2)
    row = got["by_size"]["4"]
    self.assertAlmostEqual(row["predicted_s"], 4 * _MB / 1e9)
    self.assertAlmostEqual(row["ring"]["measured_over_predicted"],
                           0.01 / (4 * _MB / 1e9))
    self.assertNotIn("socket", row)


@pytest.mark.beside
class CommandTest(absltest.TestCase):

  def test_bench_project_prints_and_writes_the_table_without_tensorflow(self):
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "projection.json")
      plot_path = os.path.join(d, "projection.png")
      proc = _bench("--json", path, "--plot", plot_path,
                    python_args=("-X", "importtime"))
      self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
      with open(path) as f:
        written = json.load(f)
      with open(plot_path, "rb") as f:
        self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    self.assertEqual(written, json.loads(json.dumps(projection.project())))
    self.assertIn("| 100 | 64 |", proc.stdout)
    self.assertNotIn("tensorflow", proc.stderr)  # -X importtime lists imports.

  def test_unwritable_plot_is_a_one_line_error_before_anything_is_written(self):
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "projection.json")
      proc = _bench("--json", path, "--plot", os.path.join(d, "no", "p.png"))
      self.assertEqual(os.listdir(d), [])
    self.assertEqual(proc.returncode, 2, proc.stderr[-2000:])
    self.assertRegex(proc.stderr.strip().splitlines()[-1],
                     r"^tfdist: --plot: received .*p\.png'; expected a file "
                     "in an existing directory")


def _bench(*args, python_args=()):
  """``python PYTHON_ARGS -m tfdist bench --project ARGS``."""
  return subprocess.run(
      [sys.executable, *python_args, "-m", "tfdist", "bench", "--project",
       *args], capture_output=True, text=True, timeout=120, check=False,
      env=cluster_utils.plotting_env(),
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


if __name__ == "__main__":
  absltest.main()
