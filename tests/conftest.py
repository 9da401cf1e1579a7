"""Test-session set-up: split the CPU into 2 logical devices.

Single-process strategies (Mirrored, CentralStorage) get 2 replicas this way.
Multi-worker and parameter-server tests run in their own processes, started,
watched and ended by the one live-cluster harness, tests/cluster_utils.py
(`cluster_utils.Tasks`), because collective ops must be configured before
TensorFlow starts and a process can join only one cluster.

The session's end lists any time the machine stood still (tests/stalls.py),
with the test it fell in.

Child processes start with tests/base_install first on PYTHONPATH: they
import Keras without matplotlib, as a base install does (0.7 s less in each
of some 600 worker starts); the tests that draw plots use
`cluster_utils.plotting_env`.

Each module's garbage is collected when the module ends. Left to pile up
over several modules of in-process TensorFlow tests, one generation-2
collection took 34 s (160 s in a longer run) inside an unrelated test
(test_layout), where collecting at every module boundary takes 0.2-0.3 s.
"""

import gc
import os
import sys

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
import stalls  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(autouse=True, scope="module")
def _collect_each_modules_garbage():
  yield
  gc.collect()


def pytest_runtest_logstart(nodeid, location):
  del location
  stalls.note_test(nodeid)


def pytest_terminal_summary(terminalreporter):
  """Says when the machine stood still (`stalls`), and in which test."""
  found = stalls.stalls()
  if found:
    terminalreporter.section("machine stalls (not counted by test bounds)")
    for stall in found:
      terminalreporter.write_line(
          f"{stall.seconds:6.1f} s without running, during {stall.test}")
