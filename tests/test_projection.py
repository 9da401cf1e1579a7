"""The alpha-beta model of `tfdist.bench.projection`: closed forms, checked.

Pure arithmetic: no TensorFlow and no timing; one subprocess runs
``tfdist bench --project``.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
from tfdist.bench import projection
from tfdist.ring import socket_ring

_MB = 1 << 20
# A link with round numbers: 1e9 bytes/s, 10 us a hop.
_LINK = projection.Link(bytes_per_s=1e9, latency_s=1e-5)
_NO_LATENCY = projection.Link(bytes_per_s=1e9, latency_s=0.0)


def _ring(p, size, link=_LINK):
  return projection.allreduce_seconds("ring", p, size, link)


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
    self.assertAlmostEqual(_ring(p, size), expected, places=12)

  def test_two_hosts_ring_is_s_over_b_each_way(self):
    # Two hosts: each sends half the tensor twice (reduce-scatter, then
    # all-gather): 2 * S / 2 / B, and two latencies.
    for size in (1.0, 4 * _MB, 64 * _MB):
      self.assertAlmostEqual(_ring(2, size), 2 * (1e-5 + size / 2 / 1e9),
                             places=12)

  def test_tfdist_is_the_socket_rings_pick(self):
    for p in (2, 3, 8, 64):
      for size in (4 << 10, 256 << 10, 32 * _MB):
        pick = socket_ring.choose(p, size)
        self.assertEqual(
            projection.allreduce_seconds("tfdist", p, size, _LINK),
            projection.allreduce_seconds(pick, p, size, _LINK))

  def test_link_at_is_line_rate_times_goodput(self):
    link = projection.link_at(10, latency_s=5e-5, goodput=0.9)
    self.assertAlmostEqual(link.bytes_per_s, 10e9 / 8 * 0.9)
    self.assertEqual(link.latency_s, 5e-5)

  def test_bench_models_gradient_bytes(self):
    self.assertEqual(projection.WIDE_MLP.gradient_bytes, 33_615_912)
    self.assertEqual(projection.CNN.gradient_bytes, 227_880)


@pytest.mark.beside
class ShapeTest(parameterized.TestCase):

  @parameterized.product(schedule=list(projection.SCHEDULES),
                         p=[2, 3, 4, 8, 64])
  def test_time_grows_with_size(self, schedule, p):
    times = [projection.allreduce_seconds(schedule, p, s, _LINK)
             for s in (0, 1 * _MB, 4 * _MB, 64 * _MB)]
    self.assertEqual(times, sorted(times))
    self.assertLess(times[0], times[-1])

  def test_ring_time_never_falls_with_hosts(self):
    times = [_ring(p, 16 * _MB) for p in range(2, 130)]
    for fewer, more in zip(times, times[1:]):
      self.assertLessEqual(fewer, more + 1e-15)

  @parameterized.named_parameters(*[(s, s) for s in projection.SCHEDULES])
  def test_faster_link_is_faster(self, schedule):
    for p in (2, 8, 64):
      slow, fast = (projection.allreduce_seconds(
          schedule, p, 32 * _MB, projection.link_at(g)) for g in (10, 100))
      self.assertLess(fast, slow)

  def test_ring_bandwidth_term_tends_to_twice_the_tensor(self):
    # Bus traffic 2 (p - 1) / p * S: below 2 S, approaching it.
    for p in (2, 8, 64, 1024):
      t = _ring(p, 1e9, _NO_LATENCY)
      self.assertAlmostEqual(t, 2 * (p - 1) / p)
      self.assertLess(t, 2.0)

  def test_unknown_schedule_names_the_known_ones(self):
    with self.assertRaisesRegex(ValueError, r"\['doubling', .*'ring', "
                                r"'tfdist'\].*'tree'"):
      projection.allreduce_seconds("tree", 4, 1.0, _LINK)

  @parameterized.named_parameters(("one", 1), ("zero", 0), ("float", 2.0))
  def test_host_count_below_two_is_refused(self, p):
    with self.assertRaisesRegex(ValueError, "p: expected an integer"):
      _ring(p, 1.0)

  def test_link_refuses_non_positive_rate(self):
    with self.assertRaisesRegex(ValueError, "bytes_per_s=0"):
      projection.Link(bytes_per_s=0, latency_s=1e-5)


@pytest.mark.beside
class OverlapTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # backward, buckets, seconds per byte of a bucket, expected finish.
      # One bucket is ready when the pass ends: nothing overlaps.
      ("one_bucket", 1.0, [10], 0.1, 2.0),
      # Two cheap buckets: the first crosses during the pass, the second's
      # sum is the only tail.
      ("hidden", 1.0, [10, 10], 0.01, 1.1),
      # Two dear ones: the link is the bottleneck from the first bucket on.
      ("link_bound", 1.0, [10, 10], 0.1, 2.5),
      # Buckets of unequal size: ready by bytes made (30% then 100%).
      ("uneven", 1.0, [3, 7], 0.1, 1.7),
      ("no_pass", 0.0, [5, 5], 0.1, 1.0),
  )
  def test_overlapped_seconds(self, backward, buckets, per_byte, expected):
    got = projection.overlapped_seconds(
        backward_s=backward, bucket_bytes=buckets,
        allreduce=lambda size: per_byte * size)
    self.assertAlmostEqual(got, expected)

  def test_step_hides_the_all_reduce_behind_the_backward_pass(self):
    w = projection.Workload(name="w", gradient_bytes=int(1e9), compute_s=1.0,
                            backward_share=0.5)
    s = projection.step(w, p=2, link=_NO_LATENCY, schedule="ring",
                        bucket_bytes=int(1e8))
    # Ten buckets of 0.1 s each, ready every 0.05 s: the link is the
    # bottleneck, the pass hides the first bucket's wait only.
    self.assertAlmostEqual(s.allreduce_s, 1.0)
    self.assertAlmostEqual(s.step_s, 0.5 + 0.05 + 1.0)
    self.assertAlmostEqual(s.serial_s, 2.0)
    self.assertAlmostEqual(s.steps_per_s, 1 / s.step_s)
    self.assertAlmostEqual(s.efficiency, 1.0 / s.step_s)

  def test_one_bucket_is_compute_plus_all_reduce(self):
    w = projection.Workload(name="w", gradient_bytes=int(1e9), compute_s=1.0)
    s = projection.step(w, p=2, link=_NO_LATENCY, schedule="ring",
                        bucket_bytes=int(1e9))
    self.assertAlmostEqual(s.step_s, 2.0)
    self.assertAlmostEqual(s.step_s, s.serial_s)

  def test_project_table_covers_every_case(self):
    table = projection.project()
    for name in ("wide_mlp", "cnn"):
      for rate in ("1", "10", "100"):
        for p in ("2", "3", "4", "8", "16", "64"):
          entry = table["steps"][name][rate][p]
          self.assertEqual(set(entry), set(projection.SCHEDULES))
          for s in entry.values():
            self.assertGreater(s["efficiency"], 0)
            self.assertLess(s["efficiency"], 1)
    # The CNN's gradients are one bucket: tfdist's step is its pick's.
    for rate, by_p in table["steps"]["cnn"].items():
      for p, entry in by_p.items():
        self.assertEqual(entry["tfdist"], entry[table["picks"]["cnn"][p]])
    text = projection.format_table(table)
    self.assertIn("| 100 | 64 |", text)
    self.assertIn("| cnn |", text)

  def test_check_sets_measured_beside_predicted(self):
    sweep = {"ring": {"4": {"seconds": 0.01}},
             "none": {"4": {"seconds": 0.03}}}
    got = projection.check(sweep=sweep, link=_NO_LATENCY, p=2)
    row = got["by_size"]["4"]
    self.assertEqual(row["schedule"], "ring")
    self.assertAlmostEqual(row["predicted_s"], 4 * _MB / 1e9)
    self.assertAlmostEqual(row["ring"]["measured_over_predicted"],
                           0.01 / (4 * _MB / 1e9))
    self.assertNotIn("socket", row)

  def test_check_training_predicts_the_overlapped_step(self):
    # Compute 0.1 s, a backward pass of 0.04 s, two buckets of 1e7 bytes
    # over two hosts at 1e9 bytes/s: 0.01 s each.
    training = {
        "steps_per_s": {"alone": 10.0, "tfdist": 1 / 0.08},
        "timeline": [{"backward_s": [0.0, 0.04], "buckets": [
            {"bytes": int(1e7)}, {"bytes": int(1e7)}]}] * 3}
    got = projection.check_training(training=training, link=_NO_LATENCY,
                                    p=2)
    self.assertAlmostEqual(got["predicted_s"], 0.06 + 0.04 + 0.01)
    self.assertAlmostEqual(got["serial_s"], 0.1 + 0.02)
    self.assertAlmostEqual(got["measured_over_predicted"], 0.08 / 0.11)
    self.assertIsNone(projection.check_training(
        training={"steps_per_s": {}}, link=_NO_LATENCY, p=2))


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
