"""`tfdist bench --quick` runs and writes a well-formed report and plot.

Benchmarks are not timed tests: nothing here asserts a speed. The quick bench
runs once, in `QuickBenchTest.setUpClass`, and every check reads its output.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils
from tfdist.bench import allreduce
from tfdist.bench import figures
from tfdist.bench import hosts
from tfdist.bench import models
from tfdist.bench import overhead
from tfdist.bench import procs
from tfdist.bench import report as report_lib
from tfdist.bench import runner
from tfdist.bench import scaling
from tfdist.errors import ConfigError
from tfdist.ring import socket_ring

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _marked(mark: str) -> list[int]:
  """PIDs whose environment holds ``mark``: everything the bench started."""
  needle = f"TFDIST_BENCH_TEST_MARK={mark}".encode()
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        if needle in f.read().split(b"\0"):
          found.append(int(entry))
    except OSError:
      continue
  return found


class QuickBenchTest(absltest.TestCase):
  """One ``tfdist bench --quick`` run, read by every test."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    out = tempfile.mkdtemp(prefix="tfdist-bench-")
    cls.addClassCleanup(shutil.rmtree, out, ignore_errors=True)
    json_path = os.path.join(out, "report.json")
    cls.plot_path = os.path.join(out, "plot.png")
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfdist", "bench", "--quick", "--json",
         json_path, "--plot", cls.plot_path],
        env=cluster_utils.plotting_env({"TFDIST_BENCH_TEST_MARK": mark}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
      cls.stdout, stderr = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
      raise AssertionError("tfdist bench --quick ran past 420 s") from None
    cls.left = _marked(mark)  # Workers run in sessions of their own.
    if proc.returncode != 0:
      raise AssertionError(stderr[-3000:])
    with open(json_path) as f:
      cls.report = json.load(f)

  def test_report_is_well_formed(self):
    report = self.report
    report_lib.validate(report)
    self.assertContainsSubset(
        {f.name for f in figures.of("one_host", headline=True)}, set(report))
    self.assertEqual(set(report["scaling_efficiency"]), {"cnn", "mlp"})
    self.assertEqual({f.name for f in figures.of("one_host", targeted=True)},
                     set(report["targets"]))
    self.assertIs(report["config"]["quick"], True)
    self.assertEqual(set(report["raw"]["overhead"]),
                     {"fit", "keras_fit", "runner"})
    for name, case in report["raw"]["overhead"].items():  # Every window.
      self.assertLen(case["windows"]["ratios"], runner.QUICK.overhead_rounds)
      self.assertEqual(report["overhead_by_case"][name], case["ratio"])
    sweep = report["raw"]["allreduce"]["sweep"]
    self.assertEqual(set(sweep), set(allreduce.METHODS))
    self.assertContainsSubset({"none", "fp16", "bf16", "socket",
                               "socket_fp16", "socket_bf16"}, set(sweep))
    self.assertGreater(report["raw"]["allreduce"]["loopback_bytes_per_s"], 0)
    # The socket ring's schedules against their model, on loopback.
    schedules_report = report["raw"]["allreduce"]["schedules"]["ranks"]
    self.assertEqual(set(schedules_report), {"2", "3"})
    for n, sweep_n in schedules_report.items():
      self.assertTrue(sweep_n["same_bits"], n)
      self.assertEqual(set(sweep_n["sizes"]), {"4", "256"})
      self.assertEqual({kb: s["rule"]["pick"]
                        for kb, s in sweep_n["sizes"].items()},
                       {kb: socket_ring.choose(int(n), int(kb) << 10)
                        for kb in ("4", "256")})
    self.assertEqual(
        report["raw"]["allreduce"]["method"],
        allreduce.method_name(scaling.RECOMMENDED["transport"],
                              scaling.RECOMMENDED["compression"]))
    self.assertEqual(report["raw"]["scaling"]["worker_counts"][:2], [1, 2])
    self.assertEqual(report["config"]["recommended_options"],
                     scaling.RECOMMENDED)
    # The machine's ceilings, measured in the same run.
    for key in ("scaling_efficiency.cnn", "allreduce_fraction_of_loopback"):
      entry = report["targets"][key]
      self.assertGreater(entry["machine_ceiling"], 0, entry)
      expected = entry["value"] / entry["machine_ceiling"]
      # pytest.approx's tolerance: relative 1e-6, absolute 1e-12.
      self.assertAlmostEqual(entry["share_of_ceiling"], expected,
                             delta=max(1e-6 * abs(expected), 1e-12))
    self.assertEqual(set(report["raw"]["scaling"]["scaling_ceiling"]),
                     {"cnn", "mlp"})
    # The largest cluster's workers timed their own steps one by one: waiting
    # for the slowest lowers the ceiling, never raises it.
    scaling_raw = report["raw"]["scaling"]
    for model in ("cnn", "mlp"):
      straggler = scaling_raw["straggler"][model]
      self.assertEqual(straggler["workers"], max(scaling_raw["worker_counts"]))
      self.assertTrue(0 < straggler["sync_factor"] <= 1, straggler)
      self.assertGreater(straggler["mean_step_s"], 0)
      self.assertAlmostEqual(
          scaling_raw["scaling_sync_ceiling"][model],
          scaling_raw["scaling_ceiling"][model] * straggler["sync_factor"])
      # The gradients' all-reduce, timed alone, lowers it further.
      self.assertGreater(straggler["gradients_allreduce_s"], 0)
      self.assertLess(scaling_raw["scaling_allreduce_ceiling"][model],
                      scaling_raw["scaling_sync_ceiling"][model])
      # Overlapped, the longer of the step and the all-reduce: in between.
      self.assertBetween(scaling_raw["scaling_overlap_ceiling"][model],
                         scaling_raw["scaling_allreduce_ceiling"][model],
                         scaling_raw["scaling_sync_ceiling"][model])
      # The largest cluster recorded tfdist's steps: one bucket (fewer bytes
      # than `bucket_bytes`), every gradient's bytes, summed once ready.
      steps = scaling_raw["timeline"][model]["steps"]
      self.assertLen(steps, runner.QUICK.timeline_steps)
      gradient_bytes = 4 * models.MODELS[model].build().count_params()
      for step in steps:
        self.assertEqual([b["bytes"] for b in step["buckets"]],
                         [gradient_bytes])
        bucket = step["buckets"][0]
        self.assertTrue(0 < bucket["ready"] <= bucket["began"]
                        <= bucket["ended"], step)
      self.assertEqual(scaling_raw["timeline"][model]["summary"]["steps"],
                       len(steps))
    for entry in report["targets"].values():  # A miss says by how much, why.
      self.assertTrue(entry["met"] or (entry["short_by"] > 0 and entry["why"]),
                      entry)
    self.assertIn("| machine ceiling |", self.stdout)

  def test_memory_is_measured_on_a_model_of_many_gradients(self):
    memory = self.report["raw"]["memory"]
    self.assertEqual(memory["model"], runner.QUICK.memory_model)
    self.assertEqual(memory["steps"], runner.QUICK.memory_steps)
    gradient_bytes = 4 * models.MODELS[memory["model"]].build().count_params()
    for kind in ("raw", "tfdist"):
      runs = memory["runs_mb"][kind]
      self.assertLen(runs, runner.QUICK.startup_repeats)
      for mb in runs:  # Each worker held the weights and their gradients.
        self.assertGreater(mb * 2**20, 2 * gradient_bytes, kind)
    self.assertAlmostEqual(
        memory["memory_ratio"],
        memory["tfdist_peak_rss_mb"] / memory["raw_peak_rss_mb"])
    self.assertEqual(self.report["memory_ratio"], memory["memory_ratio"])
    startup = self.report["raw"]["startup"]  # Quick: the same runs' peaks.
    self.assertEqual((startup["model"], runner.QUICK.startup_steps),
                     (memory["model"], memory["steps"]))
    self.assertEqual(memory["runs_mb"], {
        kind: [rss / 2**20 for _, rss in runs]
        for kind, runs in startup["runs"].items()})

  def test_the_flight_recorder_is_timed_with_and_without(self):
    recorder = self.report["raw"]["options"]["flight_recorder"]
    self.assertGreater(recorder["steps_per_s"], 0)
    self.assertGreater(recorder["baseline_steps_per_s"], 0)
    self.assertAlmostEqual(
        recorder["ratio"],
        recorder["steps_per_s"] / recorder["baseline_steps_per_s"])
    self.assertEqual(self.report["flight_recorder_ratio"], recorder["ratio"])

  def test_workers_are_pinned_one_core_each(self):
    pinning = self.report["config"]["pinning"]
    self.assertIs(pinning["pinned"], True)
    cores = os.sched_getaffinity(0)
    for n, by_worker in pinning["cores_by_workers"].items():
      self.assertLen(by_worker, int(n))
      for worker, pinned in by_worker.items():
        self.assertEqual(pinned, [sorted(cores)[int(worker) % len(cores)]])

  def test_plot_is_a_png(self):
    with open(self.plot_path, "rb") as f:
      self.assertEqual(f.read()[:8], PNG_MAGIC)

  def test_table_printed(self):
    self.assertIn("| overhead_ratio |", self.stdout)
    self.assertIn("| overhead case |", self.stdout)

  def test_nothing_left_behind(self):
    self.assertEqual(self.left, [])


@pytest.mark.beside
class ReportTest(parameterized.TestCase):

  def test_missed_target_says_by_how_much_and_why(self):
    loopback = figures.get("allreduce_fraction_of_loopback")
    for ceiling, said in ((0.4, "out of reach on this machine"),
                          (0.95, "allowed 0.950"), (None, "no ceiling")):
      entry = figures.score(loopback, 0.3, allreduce={
          "ceiling_fraction_of_loopback": ceiling})
      self.assertFalse(entry["met"])
      self.assertAlmostEqual(entry["short_by"], 0.2)
      self.assertIn(said, entry["why"])
      self.assertEqual(entry.get("machine_ceiling"), ceiling)

  def test_missed_allreduce_names_the_ring_alone_and_the_busy_machine(self):
    sweep = {"socket": {"4": {"machine_busy": 0.97}, "16": {}},
             "ring": {"4": {}, "16": {}}}
    entry = figures.score(
        figures.get("allreduce_fraction_of_loopback"), 0.3,
        allreduce={"fractions": {"socket": 0.3, "ring": 0.36},
                   "method": "socket", "sweep": sweep,
                   "ceiling_fraction_of_loopback": 0.4})
    self.assertIn("out of reach", entry["why"])
    self.assertIn("without TensorFlow reached 0.360", entry["why"])
    self.assertIn("97% busy during socket", entry["why"])
    self.assertAlmostEqual(entry["share_of_ceiling"], 0.75)

  @parameterized.named_parameters(
      ("same_steps", [[1.0, 1.0], [1.0, 1.0]], 1.0),
      # Steps 1 and 2 wait for 2 s: mean 1.5 over mean slowest 2.
      ("one_slow_each_step", [[1.0, 2.0], [2.0, 1.0]], 0.75),
      # A worker twice as slow: the other's speed is lost.
      ("one_slow_worker", [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], 0.75),
      # Steps past the shortest list are not paired.
      ("uneven_lists", [[1.0, 3.0], [1.0]], 1.0),
  )
  def test_sync_factor(self, steps, factor):
    self.assertAlmostEqual(scaling.sync_factor(steps), factor)

  def test_missed_scaling_names_the_slowest_worker(self):
    scaling_raw = {"scaling_ceiling": {"cnn": 0.9},
                   "scaling_sync_ceiling": {"cnn": 0.72},
                   "scaling_allreduce_ceiling": {"cnn": 0.576},
                   "straggler": {"cnn": {
                       "workers": 2, "mean_step_s": 0.02, "sync_factor": 0.8,
                       "gradients_allreduce_s": 0.005}}}
    entry = figures.score(figures.get("scaling_efficiency.cnn"), 0.5,
                          scaling=scaling_raw)
    self.assertEqual(entry["machine_ceiling"], 0.9)
    self.assertIn("slowest of 2 workers", entry["why"])
    self.assertIn("20.0 ms on average and each step's slowest 25.0 ms "
                  "(ceiling 0.720)", entry["why"])
    self.assertIn("took 5.00 ms (ceiling 0.576); tfdist reached 0.87 of that",
                  entry["why"])

  @parameterized.named_parameters(
      # (busy, softirq, every) before and after each span.
      ("one_span", [((10, 1, 20), (40, 7, 60))], 0.75, 0.15),
      # Spans add up: 30 + 10 busy ticks of 40 + 40.
      ("two_spans", [((0, 0, 0), (30, 4, 40)), ((50, 4, 60), (60, 8, 100))],
       0.5, 0.1),
      ("no_reading", [(None, (1, 0, 2))], None, None),
      ("no_tick", [((5, 1, 9), (5, 1, 9))], None, None),
      ("no_span", [], None, None),
  )
  def test_busy_share(self, spans, busy, softirq):
    shares = allreduce.busy_share(
        [(a and allreduce.Ticks(*a), b and allreduce.Ticks(*b))
         for a, b in spans])
    if busy is None:
      self.assertEqual(shares, {})
    else:
      self.assertAlmostEqual(shares["machine_busy"], busy)
      self.assertAlmostEqual(shares["softirq_share"], softirq)

  def test_processor_ticks_count_up(self):
    before = allreduce.processor_ticks()
    sum(range(2_000_000))  # Some busy time.
    after = allreduce.processor_ticks()
    self.assertGreaterEqual(after.every, before.every)
    self.assertGreaterEqual(after.busy, before.busy)
    self.assertLessEqual(after.softirq, after.busy)

  def test_validate_names_the_bad_key(self):
    with self.assertRaisesRegex(report_lib.ReportError,
                                "overhead_ratio = None; expected a positive"):
      report_lib.validate({})

  @parameterized.named_parameters(
      ("two_cores", 2, [1, 2]),
      ("five_cores", 5, [1, 2, 4]),
      ("sixteen_cores", 16, [1, 2, 4, 8]),
  )
  def test_worker_counts_follow_cores(self, cores, counts):
    self.assertEqual(scaling.worker_counts(cores), counts)


def _case(ratio: float, variant_s: list[float], baseline_s: list[float],
          steps: int = 60) -> dict:
  return {"ratio": ratio,
          "windows": overhead.spread(variant_s, baseline_s, steps)}


def _smallest_report(cases: dict) -> dict:
  """A report `report_lib.validate` accepts, with these overhead cases."""
  one_host = figures.of("one_host")
  return {**{f.name: ({"m": 1.0} if f.kind is dict else 1.0)
             for f in one_host if f.headline},
          "targets": {f.name: {"met": True} for f in one_host if f.target},
          "raw": {**{f.section: {"x": 1} for f in one_host},
                  "overhead": cases},
          "config": {"quick": True}}


@pytest.mark.beside
class OverheadSpreadTest(parameterized.TestCase):
  """Each overhead case's windows, paired round by round, and the sign
  test that says whether tfdist and raw can be told apart."""

  @parameterized.named_parameters(
      ("all_seven_above", 7, 7, 2 / 2**7),
      ("all_seven_below", 0, 7, 2 / 2**7),
      ("six_of_seven", 6, 7, 2 * 8 / 2**7),
      ("even_split", 3, 6, 1.0),
      ("one_round", 1, 1, 1.0),
      ("no_round", 0, 0, 1.0),
  )
  def test_sign_test_p(self, above, n, p):
    self.assertAlmostEqual(overhead.sign_test_p(above, n), p)

  @parameterized.named_parameters(
      # 60 steps in 0.5 s against 0.6 s, every round: 1.2x, told apart.
      ("faster_every_round", [0.5] * 7, [0.6] * 7,
       {"min": 1.2, "median": 1.2, "max": 1.2, "above_one": 7,
        "sign_test_p": 2 / 2**7, "told_apart": True, "overlap": False}),
      # Rounds either way, and a tie that counts for neither side.
      ("either_way", [6.0, 6.0, 6.0], [4.8, 7.5, 6.0],
       {"min": 0.8, "median": 1.0, "max": 1.25, "above_one": 1,
        "sign_test_p": 1.0, "told_apart": False, "overlap": True}),
  )
  def test_spread(self, variant_s, baseline_s, expected):
    w = overhead.spread(variant_s, baseline_s, 60)
    self.assertEqual(w["variant_steps_per_s"], [60 / s for s in variant_s])
    self.assertEqual(w["baseline_steps_per_s"], [60 / s for s in baseline_s])
    for got, v, b in zip(w["ratios"], variant_s, baseline_s):
      self.assertAlmostEqual(got, b / v)  # steps/s over steps/s.
    for key, value in expected.items():
      self.assertAlmostEqual(w[key], value, msg=key)

  @parameterized.named_parameters(
      ("uneven", [1.0, 1.0], [1.0]), ("none", [], []))
  def test_windows_must_pair(self, variant_s, baseline_s):
    with self.assertRaisesRegex(ValueError, "expected as many, one or more"):
      overhead.spread(variant_s, baseline_s, 60)

  def test_why_names_each_case_and_whether_it_is_told_apart(self):
    cases = {"fit": _case(0.96, [1.0, 1.2, 1.0], [1.1, 1.0, 0.9]),
             "runner": _case(0.98, [1.0] * 3, [0.9] * 3)}
    why = figures.score(figures.get("overhead_ratio"), 0.96,
                        overhead={"cases": cases})["why"]
    self.assertIn("fit 0.960, its windows 0.833-1.100 of raw's (median "
                  "0.900, 1 of 3 above 1, sign test p 1.00)", why)
    self.assertIn("runner 0.980, its windows 0.900-0.900", why)
    self.assertTrue(why.endswith("no case told apart from raw (sign test "
                                 "p < 0.05 needed)"), why)
    cases["runner"] = _case(0.9, [1.0] * 7, [0.9] * 7)
    self.assertTrue(figures.score(
        figures.get("overhead_ratio"), 0.9, overhead={"cases": cases}
    )["why"].endswith("told apart from raw: runner"))

  def test_validate_and_table_read_the_windows(self):
    report = _smallest_report({"fit": _case(0.97, [1.0] * 2, [0.97] * 2)})
    report_lib.validate(report)
    self.assertIn("| fit | 0.970 | 0.970 / 0.970 / 0.970 | 0 of 2 | 0.50 "
                  "| no |",
                  report_lib.format_table({**report, "targets": {}}))
    del report["raw"]["overhead"]["fit"]["windows"]["told_apart"]
    with self.assertRaisesRegex(report_lib.ReportError,
                                "raw.overhead.fit.windows.told_apart"):
      report_lib.validate(report)
    report["raw"]["overhead"]["fit"]["windows"]["ratios"] = []
    with self.assertRaisesRegex(report_lib.ReportError,
                                "raw.overhead.fit.windows.ratios"):
      report_lib.validate(report)


@pytest.mark.beside
class ProcessorCostTest(parameterized.TestCase):
  """The ring's processor seconds a GB beside the TCP stream's
  (`hosts.processor_cost`), and why a miss is a miss."""

  _GB_16_MIB = 16 * 2**20 / 1e9

  @parameterized.named_parameters(
      # 2 workers send the tensor once: a GB reduced is a GB on the wire.
      ("two_workers", 2, 1.0),
      # 4 send 2 (4 - 1) / 4 of it.
      ("four_workers", 4, 1.5),
  )
  def test_per_gb_reduced_and_on_the_wire(self, workers, wire):
    # 0.6 s a GB on the wire at 16 MiB, the largest size (not "4" of the
    # names' order); 4 MiB, and exchange, cost other amounts.
    sweep = {"ring": {"4": {"cpu_seconds": 1.0},
                      "16": {"cpu_seconds": 0.6 * self._GB_16_MIB * wire}},
             "exchange": {"16": {"cpu_seconds": 0.4 * self._GB_16_MIB * wire}}}
    p = hosts.processor_cost(link={"cpu_s_per_gb": 0.5}, sweep=sweep,
                             workers=workers)
    self.assertEqual(p["size_mb"], "16")
    self.assertAlmostEqual(p["tcp_cpu_s_per_gb"], 0.5)
    self.assertAlmostEqual(p["ring_cpu_s_per_gb_wire"], 0.6)
    self.assertAlmostEqual(p["ring_cpu_s_per_gb_reduced"], 0.6 * wire)
    self.assertAlmostEqual(p["ring_cpu_vs_tcp"], 1.2)
    self.assertAlmostEqual(p["exchange_cpu_s_per_gb_wire"], 0.4)
    self.assertAlmostEqual(p["exchange_cpu_vs_tcp"], 0.8)

  @parameterized.named_parameters(
      ("arithmetic", 0.4, 0.8, ["the additions and copies cost 1.60 a GB",
                                "The ring's arithmetic is the gap"]),
      ("sockets", 1.0, 2.0, ["(exchange) 1.00 (2.00x the stream)",
                             "The ring's sockets are the gap"]),
      ("no_exchange", None, None, ["spent 2.00 processor seconds a GB sent "
                                   "(2.00 a GB reduced), the TCP stream "
                                   "0.50: 4.00x (<= 1.5 wanted)"]),
  )
  def test_a_miss_says_why(self, exchange, ceiling, said):
    gb = self._GB_16_MIB
    sweep = {"ring": {"16": {"cpu_seconds": 2.0 * gb}}}
    if exchange:
      sweep["exchange"] = {"16": {"cpu_seconds": exchange * gb}}
    processor = hosts.processor_cost(link={"cpu_s_per_gb": 0.5},
                                     sweep=sweep, workers=2)
    out = figures.score(figures.get("ring_cpu_vs_tcp"),
                        processor["ring_cpu_vs_tcp"], processor=processor)
    self.assertFalse(out["met"])
    for text in said:
      self.assertIn(text, out["why"])
    if ceiling is None:
      self.assertNotIn("machine_ceiling", out)
    else:
      self.assertAlmostEqual(out["machine_ceiling"], ceiling)


@pytest.mark.beside
class CheckOutputsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("png", {"plot_path": "p.png"}), ("pdf", {"plot_path": "p.pdf"}),
      ("svg_upper_case", {"plot_path": "p.SVG"}),
      ("json", {"json_path": "r.json", "plot_path": "p.png"}),
      ("nothing", {}))
  def test_accepted(self, paths):
    with tempfile.TemporaryDirectory() as d:
      runner.check_outputs(**{k: os.path.join(d, v)
                              for k, v in paths.items()})
      self.assertEqual(os.listdir(d), [])

  @parameterized.named_parameters(
      ("plot_text", "plot_path", "p.txt", "ending in .png, "),
      ("plot_no_extension", "plot_path", "p", "ending in .png, "),
      ("json_text", "json_path", "r.txt", "ending in .json"),
      ("json_a_directory", "json_path", "d.json", "existing directory"),
      ("plot_in_a_missing_directory", "plot_path", "no/p.png",
       "existing directory"))
  def test_refused_before_measuring(self, field, name, expected):
    with tempfile.TemporaryDirectory() as d:
      os.mkdir(os.path.join(d, "d.json"))
      with self.assertRaises(ConfigError) as e:
        runner.check_outputs(**{field: os.path.join(d, name)})
    self.assertEqual(e.exception.field, field)
    self.assertIn(expected, e.exception.expected)

  def test_across_hosts_checks_only_the_extension(self):
    runner.check_outputs(plot_path="/on/the/chief/p.png", local=False)
    with self.assertRaises(ConfigError):
      runner.check_outputs(plot_path="/on/the/chief/p.txt", local=False)


#: Ignores SIGTERM, and so does the child it starts in its process group.
_STUBBORN = [sys.executable, "-c", (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
    "time.sleep(60)\n")]
_FAILS = [sys.executable, "-c", "import sys, time; time.sleep(1); sys.exit(3)"]


@pytest.mark.timeout(60)
@pytest.mark.beside  # Sleepers that import nothing; 13 s of waiting.
class RunAllTest(parameterized.TestCase):
  """The bench's processes end with their whole group (the launcher's
  stopper): SIGTERM, then SIGKILL past the grace period."""

  @parameterized.named_parameters(
      ("past_its_time", [_STUBBORN], 2, "still running after 2 s; stopped"),
      ("a_failure_stops_the_others", [_STUBBORN, _FAILS], 30,
       "exited with 3"),
  )
  def test_nothing_is_left(self, commands, timeout_s, why):
    mark = uuid.uuid4().hex
    env = cluster_utils.base_env({"TFDIST_BENCH_TEST_MARK": mark})
    with self.assertRaisesRegex(procs.BenchProcessError, why):
      procs.run_all(commands, [env] * len(commands), timeout_s=timeout_s,
                    what="test")
    # SIGKILLed, a process leaves /proc within moments.
    gone = cluster_utils.wait_until(lambda: not _marked(mark), 10)
    self.assertTrue(gone, f"left behind: {_marked(mark)}")


@pytest.mark.beside  # One short child process a test.
class BenchCliTest(absltest.TestCase):

  def test_unknown_flag_is_one_line_exit_2(self):
    result = subprocess.run(
        [sys.executable, "-m", "tfdist", "bench", "--nope"],
        env=cluster_utils.base_env(), capture_output=True, text=True,
        timeout=60)
    self.assertEqual(result.returncode, 2)
    self.assertStartsWith(result.stderr, "tfdist: ")
    self.assertLen(result.stderr.strip().splitlines(), 1)

  def _bench(self, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tfdist", "bench", *args],
        env=cluster_utils.base_env(), cwd=cluster_utils.REPO,
        capture_output=True, text=True, timeout=60)

  def test_figures_of_a_saved_report(self):
    result = self._bench("--figures", "docs/bench_hosts_cpu.json")
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), figures.markdown(figures.load(
        [os.path.join(cluster_utils.REPO, "docs", "bench_hosts_cpu.json")])))

  def test_figures_refuses_what_it_cannot_read(self):
    for args, said in ((("--figures", "nope.json"), "--figures: received "
                        "'nope.json'; expected a bench report's JSON file"),
                       (("--figures", "x.json", "--quick"),
                        "expected --figures without --quick")):
      result = self._bench(*args)
      self.assertEqual(result.returncode, 2)
      self.assertIn(said, result.stderr)
      self.assertLen(result.stderr.strip().splitlines(), 1)


if __name__ == "__main__":
  absltest.main()
