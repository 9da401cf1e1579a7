"""``tfdist bench --across-hosts`` between two hosts of the network test bed.

Runs the quick preset at 1 and 10 Gbit/s between two hosts, and at 10 Gbit/s
between three, and checks the report's shape and meaning, never its speed:
the figures are for the bench (docs/benchmarks.md).
"""

import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist.bench import hosts as hosts_lib

import bench_bed
import cluster_utils
import netbed

_BED = netbed.netbed_unavailable_reason()
_RATES = {"1gbit": 1e9 / 8, "10gbit": 1e10 / 8}  # Bytes per second.


@pytest.mark.timeout(400)
@absltest.skipIf(_BED is not None, _BED)
class AcrossHostsTest(parameterized.TestCase):

  @parameterized.named_parameters(("1gbit", "1gbit"), ("10gbit", "10gbit"))
  def test_bench_reports_ratios_of_the_link_between_two_hosts(self, rate):
    with tempfile.TemporaryDirectory() as d:
      report, outs, codes = bench_bed.run_on_bed(rate, quick=True, workdir=d,
                                                 timeout=300)
    self.assertEqual(codes, [0, 0], "\n".join(outs))
    self.assertIsNotNone(report, "\n".join(outs))
    hosts_lib.validate(report)
    # Across the bed's addresses, not loopback.
    self.assertEqual(report["raw"]["hosts"], ["198.18.0.11", "198.18.0.12"])
    # The link measured is the shaped link: tbf lets no stream past it.
    link = report["headline"]["link_bytes_per_s"]
    self.assertLess(link, _RATES[rate] * 1.05)
    self.assertLen(report["raw"]["link"]["by_rank"], 2)
    self.assertGreater(report["raw"]["link"]["hop_latency_s"], 0)
    # The ring model beside the sweep, from this run's alpha and link.
    model = report["model_check"]
    self.assertEqual((model["p"], model["bytes_per_s"]), (2, link))
    self.assertEqual(set(model["by_size"]), {"4"})
    self.assertEqual(set(report["targets"]), {t.key for t in hosts_lib.TARGETS})
    sweep = report["raw"]["allreduce"]["sweep"]
    for method in hosts_lib.HOSTS_QUICK.methods:
      figures = sweep[method]["4"]
      # Two workers: NCCL's bus bandwidth equals the algorithm bandwidth.
      self.assertAlmostEqual(figures["busbw"], figures["algbw"])
      self.assertAlmostEqual(
          report["raw"]["allreduce"]["fraction_of_link"][method]["4"],
          figures["busbw"] / link)
    chief_out = next(o for o in outs if "across 2 workers" in o)
    self.assertIn("training_speedup_vs_raw", chief_out)
    self.assertTrue(any("the chief prints the report" in o for o in outs))


  def test_three_hosts_report_nccl_bus_bandwidth_of_a_ring_of_three(self):
    with tempfile.TemporaryDirectory() as d:
      report, outs, codes = bench_bed.run_on_bed("10gbit", quick=True,
                                                 workdir=d, timeout=300,
                                                 hosts=3)
    self.assertEqual(codes, [0, 0, 0], "\n".join(outs))
    self.assertIsNotNone(report, "\n".join(outs))
    hosts_lib.validate(report)
    self.assertEqual(report["raw"]["hosts"],
                     ["198.18.0.11", "198.18.0.12", "198.18.0.13"])
    self.assertLen(report["raw"]["link"]["by_rank"], 3)
    for method in hosts_lib.HOSTS_QUICK.methods:
      figures = report["raw"]["allreduce"]["sweep"][method]["4"]
      # NCCL's bus bandwidth: 2 (n - 1) / n of the algorithm bandwidth.
      self.assertAlmostEqual(figures["busbw"], figures["algbw"] * 4 / 3)
    self.assertEqual(report["model_check"]["p"], 3)


class AcrossHostsInputTest(absltest.TestCase):

  def test_one_worker_is_refused_with_the_field_named(self):
    result, left = cluster_utils.run_alone(
        [sys.executable, "-m", "tfdist", "bench", "--across-hosts",
         "--quick"], env=cluster_utils.base_env(), cwd=cluster_utils.REPO,
        timeout=120)
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertEqual(left, [])
    line = result.stderr.strip().splitlines()[-1]
    self.assertTrue(line.startswith("tfdist: cluster: "), result.stderr)
    self.assertIn("two or more workers", line)


if __name__ == "__main__":
  absltest.main()
