"""`tfdist bench --quick` runs and writes a well-formed report and plot.

Benchmarks are not timed tests: nothing here asserts a speed.
"""

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from tests import cluster_utils
from tfdist.bench import allreduce
from tfdist.bench import report as report_lib
from tfdist.bench import scaling

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


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  json_path, plot_path = out / "report.json", out / "plot.png"
  mark = uuid.uuid4().hex
  proc = subprocess.Popen(
      [sys.executable, "-m", "tfdist", "bench", "--quick", "--json",
       str(json_path), "--plot", str(plot_path)],
      env=cluster_utils.base_env({"TFDIST_BENCH_TEST_MARK": mark}),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      start_new_session=True)
  try:
    stdout, stderr = proc.communicate(timeout=420)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    raise AssertionError("tfdist bench --quick ran past 420 s") from None
  left = _marked(mark)  # Workers run in sessions of their own.
  assert proc.returncode == 0, stderr[-3000:]
  return {"report": json.loads(json_path.read_text()), "plot": plot_path,
          "stdout": stdout, "left": left}


def test_report_is_well_formed(quick_report):
  report = quick_report["report"]
  report_lib.validate(report)
  assert set(report_lib.HEADLINE_KEYS) <= set(report)
  assert set(report["scaling_efficiency"]) == {"cnn", "mlp"}
  assert {t.key for t in report_lib.TARGETS} == set(report["targets"])
  assert report["config"]["quick"] is True
  assert set(report["raw"]["overhead"]) == {"fit", "keras_fit", "runner"}
  sweep = report["raw"]["allreduce"]["sweep"]
  assert set(sweep) == set(allreduce.METHODS)
  assert {"none", "fp16", "bf16", "socket", "socket_fp16",
          "socket_bf16"} <= set(sweep)
  assert report["raw"]["allreduce"]["loopback_bytes_per_s"] > 0
  assert report["raw"]["allreduce"]["method"] == allreduce.method_name(
      scaling.RECOMMENDED["transport"], scaling.RECOMMENDED["compression"])
  assert report["raw"]["scaling"]["worker_counts"][:2] == [1, 2]
  assert report["config"]["recommended_options"] == scaling.RECOMMENDED
  # The machine's ceilings, measured in the same run.
  for key in ("scaling_efficiency.cnn", "allreduce_fraction_of_loopback"):
    entry = report["targets"][key]
    assert entry["machine_ceiling"] > 0, entry
    assert entry["share_of_ceiling"] == pytest.approx(
        entry["value"] / entry["machine_ceiling"])
  assert set(report["raw"]["scaling"]["scaling_ceiling"]) == {"cnn", "mlp"}
  for entry in report["targets"].values():  # A miss says by how much, and why.
    assert entry["met"] or (entry["short_by"] > 0 and entry["why"]), entry
  assert "| machine ceiling |" in quick_report["stdout"]


def test_workers_are_pinned_one_core_each(quick_report):
  pinning = quick_report["report"]["config"]["pinning"]
  assert pinning["pinned"] is True
  cores = os.sched_getaffinity(0)
  for n, by_worker in pinning["cores_by_workers"].items():
    assert len(by_worker) == int(n)
    for worker, pinned in by_worker.items():
      assert pinned == [sorted(cores)[int(worker) % len(cores)]]


def test_plot_is_a_png(quick_report):
  assert quick_report["plot"].read_bytes()[:8] == PNG_MAGIC


def test_table_printed(quick_report):
  assert "| overhead_ratio |" in quick_report["stdout"]


def test_nothing_left_behind(quick_report):
  assert quick_report["left"] == []


def test_missed_target_says_by_how_much_and_why():
  target = report_lib.Target(key="x", bound=0.9)
  assert "out of reach on this machine" in report_lib._why(target, 0.6, 0.75)
  assert "allowed 0.950" in report_lib._why(target, 0.6, 0.95)
  assert "no ceiling" in report_lib._why(target, 0.6, None)


def test_validate_names_the_bad_key():
  with pytest.raises(report_lib.ReportError, match="overhead_ratio: missing"):
    report_lib.validate({})


def test_worker_counts_follow_cores():
  assert scaling.worker_counts(2) == [1, 2]
  assert scaling.worker_counts(5) == [1, 2, 4]
  assert scaling.worker_counts(16) == [1, 2, 4, 8]


def test_unknown_flag_is_one_line_exit_2():
  result = subprocess.run([sys.executable, "-m", "tfdist", "bench", "--nope"],
                          env=cluster_utils.base_env(), capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 2
  assert result.stderr.startswith("tfdist: ")
  assert len(result.stderr.strip().splitlines()) == 1
