"""``tfdist bench --across-hosts`` between two hosts of the network test bed.

Runs the quick preset at 1 Gbit/s between two hosts, and at 10 Gbit/s
between three, and checks the report's shape and meaning, never its speed:
the figures are for the bench (docs/benchmarks.md). Among them the socket
ring's schedules against their model (``raw.schedules``), checked as
tests/test_bench_schedules.py checks the sweep on its own.
"""

import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist.bench import figures
from tfdist.bench import hosts as hosts_lib
from tfdist.bench import report as report_lib
from tfdist.bench import schedules as schedules_lib
from tfdist.ring import socket_ring

import bench_bed
import cluster_utils
import netbed
from test_bench_schedules import check_report
from test_bench_schedules import raw_figures

_BED = netbed.netbed_unavailable_reason()
_RATES = {"1gbit": 1e9 / 8, "10gbit": 1e10 / 8}  # Bytes per second.


@pytest.mark.timeout(400)
@absltest.skipIf(_BED is not None, _BED)
class AcrossHostsTest(parameterized.TestCase):

  # 10 Gbit/s is the three hosts' rate below: one bed run per rate.
  @parameterized.named_parameters(("1gbit", "1gbit"))
  def test_bench_reports_ratios_of_the_link_between_two_hosts(self, rate):
    with tempfile.TemporaryDirectory() as d:
      report, outs, codes = bench_bed.run_on_bed(rate, quick=True, workdir=d,
                                                 timeout=300)
    self.assertEqual(codes, [0, 0], "\n".join(outs))
    self.assertIsNotNone(report, "\n".join(outs))
    report_lib.validate_hosts(report)
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
    self.assertEqual(set(report["targets"]),
                     {f.name for f in figures.of("across_hosts", targeted=True)})
    sweep = report["raw"]["allreduce"]["sweep"]
    for method in hosts_lib.HOSTS_QUICK.methods:
      found = sweep[method]["4"]
      # Two workers: NCCL's bus bandwidth equals the algorithm bandwidth.
      self.assertAlmostEqual(found["busbw"], found["algbw"])
      self.assertAlmostEqual(
          report["raw"]["allreduce"]["fraction_of_link"][method]["4"],
          found["busbw"] / link)
    # Every miss says why, from this run's figures; the ceilings are there
    # (the overlap target is a share of a ceiling already).
    for key, entry in report["targets"].items():
      if not entry["met"]:
        self.assertIn("why", entry, key)
        if key != "training_fraction_of_overlap_ceiling":
          self.assertGreater(entry["machine_ceiling"], 0, key)
    # The step at the link's rate: alone's step plus 2 (n - 1) / n of the
    # gradients' bytes over the link.
    training = report["raw"]["training"]
    self.assertAlmostEqual(
        training["link_step_s"],
        1 / training["steps_per_s"]["alone"] + training["gradient_bytes"] / link)
    self.assertEqual(training["gradient_bytes"], 4 * 8_403_978)
    # Overlapped, the longer of the two; tfdist's step against it.
    self.assertAlmostEqual(
        training["overlap_step_s"],
        max(1 / training["steps_per_s"]["alone"],
            training["gradient_bytes"] / link))
    self.assertAlmostEqual(
        report["headline"]["training_fraction_of_overlap_ceiling"],
        training["steps_per_s"]["tfdist"] * training["overlap_step_s"])
    self.assertAlmostEqual(
        report["headline"]["training_overlap_ceiling_vs_raw"],
        1 / (training["overlap_step_s"] * training["steps_per_s"]["raw"]))
    self.assertEqual(set(report["raw"]["training"]["steps_per_s"]),
                     {"raw", "tfdist", "alone"})
    # The timeline: every recorded step's buckets, in order, each summed
    # after its gradients existed, all of the gradients' bytes; the backward
    # pass ends when its last bucket is ready.
    steps = training["timeline"]
    self.assertLen(steps, hosts_lib.HOSTS_QUICK.timeline_steps)
    for step in steps:
      buckets = step["buckets"]
      self.assertEqual([b["bucket"] for b in buckets],
                       list(range(len(buckets))))
      self.assertGreater(len(buckets), 1)  # 33.6 MB, 25 MiB buckets.
      self.assertEqual(sum(b["bytes"] for b in buckets),
                       training["gradient_bytes"])
      for b in buckets:
        self.assertTrue(0 < b["ready"] <= b["began"] <= b["ended"], b)
      self.assertEqual(step["backward_s"], [0.0, buckets[-1]["ready"]])
    # The projected step beside tfdist's measured one, from this run.
    projected = report["model_check"]["training"]
    self.assertAlmostEqual(projected["measured_s"],
                           1 / training["steps_per_s"]["tfdist"])
    self.assertEqual(projected["bucket_bytes"],
                     [b["bytes"] for b in steps[0]["buckets"]])
    self.assertAlmostEqual(projected["measured_over_predicted"],
                           projected["measured_s"] / projected["predicted_s"])
    self.assertEqual(training["timeline_summary"]["steps"], len(steps))
    busy = sweep["socket"]["4"]["machine_busy"]
    self.assertTrue(0 < busy <= 1, busy)
    # How busy this machine (every host of the bed) was in each variant's
    # windows, and how much of that was the kernel's packet work.
    for variant in ("raw", "tfdist", "alone"):
      busy = training["machine_busy"][variant]
      softirq = training["softirq_share"][variant]
      self.assertTrue(0 <= softirq <= busy <= 1, (variant, busy, softirq))
    # Both raw and tfdist moved gradients through the kernel; alone did not.
    self.assertGreater(training["softirq_share"]["tfdist"], 0)
    chief_out = next(o for o in outs if "across 2 workers" in o)
    self.assertIn("training_speedup_vs_raw", chief_out)
    self._check_schedules(report, chief_out)
    self.assertTrue(any("the chief prints the report" in o for o in outs))


  def test_three_hosts_report_nccl_bus_bandwidth_of_a_ring_of_three(self):
    with tempfile.TemporaryDirectory() as d:
      report, outs, codes = bench_bed.run_on_bed("10gbit", quick=True,
                                                 workdir=d, timeout=300,
                                                 hosts=3)
    self.assertEqual(codes, [0, 0, 0], "\n".join(outs))
    self.assertIsNotNone(report, "\n".join(outs))
    report_lib.validate_hosts(report)
    self.assertEqual(report["raw"]["hosts"],
                     ["198.18.0.11", "198.18.0.12", "198.18.0.13"])
    self.assertLen(report["raw"]["link"]["by_rank"], 3)
    self.assertLess(report["headline"]["link_bytes_per_s"],
                    _RATES["10gbit"] * 1.05)  # The shaped link, not more.
    for method in hosts_lib.HOSTS_QUICK.methods:
      found = report["raw"]["allreduce"]["sweep"][method]["4"]
      # NCCL's bus bandwidth: 2 (n - 1) / n of the algorithm bandwidth.
      self.assertAlmostEqual(found["busbw"], found["algbw"] * 4 / 3)
    self.assertEqual(report["model_check"]["p"], 3)
    self._check_schedules(
        report, next(o for o in outs if "across 3 workers" in o))

  def _check_schedules(self, report: dict, chief_out: str) -> None:
    """Every schedule and the rule beside the model, from the link this
    run measured once; the chief's table says the pick and the targets."""
    schedules = report["raw"]["schedules"]
    sizes_kb = list(hosts_lib.HOSTS_QUICK.schedule_sizes_kb)
    check_report(self, schedules, n=len(report["raw"]["hosts"]),
                 sizes_kb=sizes_kb)
    self.assertEqual(schedules["link"], report["raw"]["link"])
    for kb in sizes_kb:
      self.assertRegex(chief_out, rf"{kb} KiB .* rule "
                       f"{schedules['sizes'][str(kb)]['rule']['pick']} ")
    for key in ("chosen_vs_best", "busbw_fraction"):
      self.assertRegex(chief_out, rf"schedules {key} .* (met|NOT met)")


def _figures(share: float, seconds: float, busy: float) -> dict:
  return {"busbw": share, "seconds": seconds, "machine_busy": busy}


def _explain(key: str, **context) -> dict:
  """What the registry's explainer of ``key`` says of ``context``."""
  figure = figures.get(key)
  return figure.explain(figure, **context)


def _sweep(socket: dict, ring: dict, exchange: dict) -> dict:
  """A two-host sweep whose bus bandwidths are shares of a link of 1 B/s."""
  return {"socket": socket, "socket_bf16": socket, "ring": ring,
          "ring_bf16": ring, "exchange": exchange}


@pytest.mark.beside
class WhyNotTest(parameterized.TestCase):
  """A missed target's ``why`` comes from the same run's figures."""

  @parameterized.named_parameters(
      # The ring alone reaches the link; TensorFlow's hop is the gap.
      ("hop", "allreduce_fraction_of_link",
       {"4": _figures(0.8, 0.005, 0.7), "16": _figures(0.95, 0.017, 0.6)},
       {"4": _figures(0.98, 0.004, 0.7), "16": _figures(0.97, 0.016, 0.6)},
       {"4": _figures(1.0, 0.004, 0.6), "16": _figures(1.0, 0.016, 0.6)},
       {"at_size_mb": "4", "machine_ceiling": 1.0, "machine_busy": 0.7},
       ["lowest at 4 MiB", "TensorFlow's hop cost 1.00 ms",
        "TensorFlow's hop is the gap"],
       ["out of reach", "processors were the limit"]),
      # Even the bytes alone stay under the target, on busy processors.
      ("out_of_reach", "allreduce_fraction_of_link",
       {"4": _figures(0.7, 0.005, 0.95), "16": _figures(0.6, 0.02, 0.96)},
       {"4": _figures(0.75, 0.004, 0.95), "16": _figures(0.7, 0.018, 0.9)},
       {"4": _figures(0.9, 0.004, 0.9), "16": _figures(0.85, 0.016, 0.9)},
       {"at_size_mb": "16", "machine_ceiling": 0.85, "machine_busy": 0.96},
       ["Out of reach on this machine", "processors were the limit"], []),
      # A 16-bit wire moves half the bytes: twice the exchange's share.
      ("bf16", "bf16_fraction_of_link",
       {"4": _figures(1.2, 0.005, 0.8)}, {"4": _figures(1.5, 0.004, 0.8)},
       {"4": _figures(0.95, 0.004, 0.8)},
       {"at_size_mb": "4", "machine_ceiling": 1.9, "machine_busy": 0.8},
       ["exchange x2: half the bytes) 1.90", "The ring's own work is the gap"],
       ["out of reach", "hop is the gap"]),
  )
  def test_allreduce(self, key, socket, ring, exchange, figures, said,
                     unsaid):
    sweep = _sweep(socket, ring, exchange)
    fractions = {m: {s: f["busbw"] for s, f in per.items()}
                 for m, per in sweep.items()}
    out = _explain(key, sweep=sweep, fractions=fractions)
    for name, value in figures.items():
      if isinstance(value, float):
        self.assertAlmostEqual(out[name], value, msg=name)
      else:
        self.assertEqual(out[name], value, name)
    for text in said:
      self.assertIn(text, out["why"])
    for text in unsaid:
      self.assertNotIn(text.lower(), out["why"].lower())

  @parameterized.named_parameters(
      # 200 ms raw, 111 alone, 100 MB at 1 GB/s: 211 ms at the link's rate.
      ("link_bound", {"raw": 5.0, "tfdist": 8.0, "alone": 9.0}, 0.1,
       200 / 211.1, ["Out of reach on these hosts", "0.95x raw at most",
                     "take 106% of raw's step; >= 2x needs 50% or less"]),
      # 500 ms raw, 333 tfdist, 200 alone + 50 over the link.
      ("reachable", {"raw": 2.0, "tfdist": 3.0, "alone": 5.0}, 0.05, 2.0,
       ["250 ms with its 100.0 MB all-reduced", "tfdist saved 67% of that"]),
  )
  def test_training(self, speed, link_s, ceiling, said):
    training = {"steps_per_s": speed, "gradient_bytes": 100e6,
                "link_step_s": 1 / speed["alone"] + link_s}
    out = _explain("training_speedup_vs_raw", training=training)
    self.assertAlmostEqual(out["machine_ceiling"], ceiling, places=3)
    for text in said:
      self.assertIn(text, out["why"])

  def test_overlap(self):
    # 250 ms with tfdist; 200 ms alone, 100 MB at 1 GB/s: 100 ms.
    training = {"steps_per_s": {"raw": 2.0, "tfdist": 4.0, "alone": 5.0},
                "gradient_bytes": 100e6, "link_step_s": 0.3,
                "overlap_step_s": 0.2}
    why = _explain("training_fraction_of_overlap_ceiling",
                   training=training)["why"]
    self.assertIn("a step took 250 ms with tfdist", why)
    self.assertIn("the longer of 200 ms of compute (alone) and 100 ms of its "
                  "100.0 MB over the link: 200 ms, 0.80 of tfdist's step "
                  "(>= 0.85 wanted)", why)
    self.assertNotIn("busy", why)  # No shares measured, none said.
    training.update(machine_busy={"raw": 0.9, "tfdist": 0.97, "alone": 0.8},
                    softirq_share={"raw": 0.1, "tfdist": 0.2, "alone": 0.0})
    why = _explain("training_fraction_of_overlap_ceiling",
                   training=training)["why"]
    self.assertIn("the chief's machine was busy 97% in tfdist's windows "
                  "(softirq 20%), 90% in raw's (softirq 10%), 80% in alone's "
                  "(softirq 0%)", why)
    self.assertIn("Its processors were the limit: with 97% of them busy, "
                  "tfdist's step could be at most 3% faster", why)
    training["machine_busy"]["tfdist"] = 0.5  # Processors to spare.
    why = _explain("training_fraction_of_overlap_ceiling",
                   training=training)["why"]
    self.assertIn("busy 50% in tfdist's windows", why)
    self.assertNotIn("processors were the limit", why)

  def test_overlap_with_a_timeline(self):
    training = {"steps_per_s": {"raw": 2.0, "tfdist": 4.0, "alone": 5.0},
                "gradient_bytes": 100e6, "link_step_s": 0.3,
                "overlap_step_s": 0.2,
                "timeline_summary": {"steps": 5, "backward_s": 0.15,
                                     "first_ready_s": 0.05,
                                     "allreduce_s": 0.1, "hidden": 0.4,
                                     "exposed_s": 0.06,
                                     "bytes_per_s_during": 20e6,
                                     "bytes_per_s_after": 110e6}}
    why = _explain("training_fraction_of_overlap_ceiling",
                   training=training)["why"]
    self.assertIn("the timeline (median of 5 steps): a 150 ms backward pass "
                  "whose first bucket was ready at 50 ms, 100 ms of buckets on the ring, 0.40 of it during the "
                  "pass, 60 ms after it; the ring moved 20 MB/s in the buckets "
                  "it began during the pass, 110 MB/s after; from the first "
                  "bucket on, no step takes less than 200 ms (50 ms of "
                  "compute outside the pass, 50 ms, then the link): 0.80 of "
                  "tfdist's step", why)

  def test_a_miss_without_a_why_is_refused(self):
    report = _whole_report()
    report["targets"]["training_speedup_vs_raw"] = {"met": False}
    with self.assertRaisesRegex(
        report_lib.ReportError,
        r"targets.training_speedup_vs_raw.why \(a target not met\) = None"):
      report_lib.validate_hosts(report)


def _drop_model(schedules: dict) -> None:
  del schedules["sizes"]["4096"]["schedules"]["ring"]["model_s"]


def _whole_report() -> dict:
  """An across-hosts report `report.validate_hosts` accepts."""
  seconds = {name: 4.0 for name in socket_ring.SCHEDULES}
  schedules = schedules_lib.report(raw_figures(
      seconds={**seconds, schedules_lib.RULE: 4.0}, pick="ring",
      cpu_s=[0.1, 0.1]))
  return {"headline": {f.name: 1.0 for f in figures.of("across_hosts")},
          "targets": {f.name: {"met": True}
                      for f in figures.of("across_hosts", targeted=True)},
          "raw": {"allreduce": {"sweep": {}}, "schedules": schedules}}


@pytest.mark.beside
class ValidateSchedulesTest(parameterized.TestCase):
  """`report.validate_hosts` checks the schedules' section's shape."""

  def test_a_whole_section_passes(self):
    report_lib.validate_hosts(_whole_report())

  @parameterized.named_parameters(
      ("missing", dict.clear, "schedules.same_bits = None; expected a bool"),
      ("unknown_pick",
       lambda s: s["sizes"]["4096"]["rule"].update(pick="tree"),
       "schedules.sizes.4096.rule.pick = 'tree'; expected one of"),
      ("no_model", _drop_model,
       "schedules.sizes.4096.ring.model_s = None; expected a positive"),
      ("miss_without_why",
       lambda s: s["targets"]["chosen_vs_best"].update(met=False),
       r"schedules.targets.chosen_vs_best.why \(a target not met\)"),
  )
  def test_a_broken_section_is_refused(self, breaks, said):
    report = _whole_report()
    breaks(report["raw"]["schedules"])
    with self.assertRaisesRegex(report_lib.ReportError, said):
      report_lib.validate_hosts(report)


@pytest.mark.beside  # One short child process, refused.
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
