"""Test-session set-up: split the CPU into 2 logical devices.

Single-process strategies (Mirrored, CentralStorage) get 2 replicas this way.
Multi-worker and parameter-server tests run in their own processes, started,
watched and ended by the one live-cluster harness, tests/cluster_utils.py
(`cluster_utils.Tasks`), because collective ops must be configured before
TensorFlow starts and a process can join only one cluster.

The session's end lists any time the machine stood still (tests/stalls.py),
with the test it fell in, and, where `root_skips.VARIABLE` is set and the
run is root's, fails the run on each skip of a test that needs root (the
network bed, SLURM, a full disk: tests/root_skips.py), naming it.

Child processes start with tests/base_install first on PYTHONPATH: they
import Keras without matplotlib, as a base install does (0.7 s less in each
of some 600 worker starts); the tests that draw plots use
`cluster_utils.plotting_env`. The harness's ``python SCRIPT.py`` children
start forked from a zygote that imported TensorFlow, Keras and tfdist
(tests/warm.py; ``TFDIST_TESTS_COLD=1`` starts them cold): 41:08 -> 34:23
for the whole run on this machine. A launcher's tasks start as a user's do.

The suite runs in two streams (pytest-xdist, ``-n 2 --dist loadgroup`` in
setup.cfg): every test starts in the ``clusters`` stream, where clusters,
servers, SLURM and the network bed run one at a time, as they always did;
classes and modules marked ``pytest.mark.beside`` start no cluster, server or
launcher (at most short processes that join none) and run in the ``beside``
stream, on the other core. The clusters stream alone left half the machine
idle (waits on peers, bounds and single processes): 1631 of 3962
core-seconds in one measured run.

Each module's garbage is collected when the module ends. Left to pile up
over several modules of in-process TensorFlow tests, one generation-2
collection took 34 s (160 s in a longer run) inside an unrelated test
(test_layout), where collecting at every module boundary takes 0.2-0.3 s.
"""

import gc
import os
import sys

# An xdist worker starts with the PYTHONPATH set below for test children
# (tests/base_install); the pytest processes themselves keep matplotlib.
if "matplotlib" in sys.modules and sys.modules["matplotlib"] is None:
  del sys.modules["matplotlib"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import cluster_utils  # pylint: disable=g-import-not-at-top,wrong-import-position

os.environ["PYTHONPATH"] = os.pathsep.join(
    [cluster_utils.BASE_INSTALL]
    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

import tensorflow as tf  # pylint: disable=g-import-not-at-top

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position
import root_skips  # pylint: disable=g-import-not-at-top,wrong-import-position
import stalls  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(autouse=True, scope="module")
def _collect_each_modules_garbage():
  yield
  gc.collect()


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "beside: starts no cluster, server or launcher; runs beside "
      "the clusters stream (tests/conftest.py)")


#: The clusters stream starts with the modules that mostly wait (on bounds,
#: SLURM, lost peers: a core idle half their time), while the beside stream
#: runs, and ends with the bench, which wants both cores (run beside the
#: beside stream, it took 60-100 s longer).
_WAIT_FIRST = ("test_slurm_templates.py", "test_multinode_launch.py",
               "test_slurm_preemption.py", "test_launch.py",
               "test_clean_exit.py", "test_signals.py", "test_faults.py")
_BENCH_LAST = ("test_bench.py", "test_bench_hosts.py",
               "test_bench_schedules.py")


#: What xdist's loadgroup adds to each node id: its stream.
_STREAM_SUFFIXES = ("@beside", "@clusters")


def _clusters_order(item) -> int:
  name = item.path.name
  if name in _WAIT_FIRST:  # The idlest first.
    return _WAIT_FIRST.index(name)
  return len(_WAIT_FIRST) + (name in _BENCH_LAST)


@pytest.hookimpl(tryfirst=True)  # Before xdist reads the groups.
def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    stream = "beside" if item.get_closest_marker("beside") else "clusters"
    item.add_marker(pytest.mark.xdist_group(stream))
  items.sort(key=_clusters_order)  # Stable: each module keeps its order.


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
  """Refuses to run clusters side by side: every id must carry its stream."""
  lost = [i for i in ids if not i.endswith(_STREAM_SUFFIXES)]
  if lost:
    raise pytest.UsageError(
        f"{node.gateway.id}: {len(lost)} tests came without their stream "
        f"group (e.g. {lost[0]}); xdist's --dist loadgroup does not work "
        "with this pytest (pytest-dev/pytest-xdist#1386): install "
        "'pytest<9.2' as setup.cfg's test extra does, or run with -n 0")


def pytest_runtest_logstart(nodeid, location):
  del location
  stalls.note_test(nodeid)


_worker_stalls: list[tuple[float, str]] = []
#: (node id, reason) of each skipped test; on xdist's controller, every
#: stream's.
_skips: list[tuple[str, str]] = []
#: `root_skips.hidden`'s lines, where they fail the run.
_root_skips: list[str] = []


def pytest_runtest_logreport(report):
  if report.skipped and not hasattr(report, "wasxfail"):
    reason = (report.longrepr[2] if isinstance(report.longrepr, tuple)
              else report.longrepr)
    nodeid = report.nodeid
    if nodeid.endswith(_STREAM_SUFFIXES):
      nodeid = nodeid.rpartition("@")[0]
    _skips.append((nodeid, str(reason).removeprefix("Skipped: ")))


def pytest_sessionfinish(session):
  """A stream's stalls go back to the controller, which reports them; the
  controller (or the one process) fails a root run on `root_skips`."""
  out = getattr(session.config, "workeroutput", None)
  if out is not None:
    out["stalls"] = [(s.seconds, s.test) for s in stalls.stalls()]
    return
  if root_skips.enforced(os.environ, os.geteuid()):
    _root_skips.extend(root_skips.hidden(_skips, str(session.config.rootpath)))
    if _root_skips and session.exitstatus == pytest.ExitCode.OK:
      session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  del error
  _worker_stalls.extend(getattr(node, "workeroutput", {}).get("stalls", ()))


def pytest_terminal_summary(terminalreporter):
  """Says when the machine stood still (`stalls`), and in which test; names
  the skips that failed a root run (`root_skips`)."""
  if _root_skips:
    terminalreporter.section(
        f"skipped as root: these fail the run ({root_skips.VARIABLE})",
        red=True)
    for line in _root_skips:
      terminalreporter.write_line(line)
  found = [(s.seconds, s.test) for s in stalls.stalls()] + _worker_stalls
  if found:
    terminalreporter.section("machine stalls (not counted by test bounds)")
    for seconds, test in found:
      terminalreporter.write_line(
          f"{seconds:6.1f} s without running, during {test}")
