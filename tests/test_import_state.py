"""Importing tfdist changes nothing process-wide; a strategy's exit hook is
armed when it is made and gone when it is closed (tfdist.strategy.clean_exit).

Each import runs in a fresh interpreter: what it depends on (TensorFlow,
Keras, absl) is imported first, then every process-wide hook is read before
and after importing the tfdist module.
"""

import json
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import tfdist
from tfdist.strategy import clean_exit

import cluster_utils

# Prints what a process holds process-wide, before and after importing MODULE.
_SNAPSHOT = """
import atexit, builtins, json, os, signal, sys, threading, warnings
for dep in DEPS:
  __import__(dep)

def snapshot():
  handlers = {s.name: repr(signal.getsignal(s)) for s in signal.Signals
              if s not in (signal.SIGKILL, signal.SIGSTOP)}
  return {"sys.exit": repr(sys.exit), "excepthook": repr(sys.excepthook),
          "threading.excepthook": repr(threading.excepthook),
          "displayhook": repr(sys.displayhook),
          "unraisablehook": repr(sys.unraisablehook),
          "breakpointhook": repr(sys.breakpointhook),
          "trace": repr(sys.gettrace()), "profile": repr(sys.getprofile()),
          "atexit": atexit._ncallbacks(), "signals": handlers,
          "builtins.exit": repr(builtins.exit),
          "environ": dict(os.environ), "cwd": os.getcwd(),
          "recursionlimit": sys.getrecursionlimit(),
          "switchinterval": sys.getswitchinterval(),
          "warnings": [repr(f) for f in warnings.filters]}

before = snapshot()
__import__(MODULE)
print(json.dumps({"before": before, "after": snapshot()}))
"""

_KERAS = ("absl.logging", "tensorflow", "keras")


pytestmark = pytest.mark.beside  # tests/conftest.py: one short process a test.


class ImportChangesNothingTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("package", "tfdist", ()),
      ("clean_exit", "tfdist.strategy.clean_exit", ()),
      ("factory", "tfdist.strategy.factory", _KERAS),
      ("training", "tfdist.training.fit", _KERAS),
      ("keras_compat", "tfdist._compat.keras", _KERAS),
  )
  def test_import_leaves_the_process_as_it_was(self, module, deps):
    code = (f"DEPS = {deps!r}\nMODULE = {module!r}\n" + _SNAPSHOT)
    r = subprocess.run([sys.executable, "-c", code],
                       env=cluster_utils.base_env(), capture_output=True,
                       text=True, timeout=180, cwd=cluster_utils.REPO)
    self.assertEqual(r.returncode, 0, r.stderr[-2000:])
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    self.assertEqual(seen["after"], seen["before"])


def _two_workers():
  return tfdist.ClusterInfo(cluster={"worker": ["a:1", "b:1"]},
                            task_type="worker", task_id=0, source="explicit")


# Arms the exit wait of a 2-worker task with no cluster behind it, as
# make_strategy does, then runs STEPS: a wait left armed at exit fails to
# reach the coordination service and says so on stderr.
_ARMED = """
import sys
import tensorflow  # Loaded before the exit, as under a strategy.
import tfdist
from tfdist.strategy import clean_exit
info = tfdist.ClusterInfo(cluster={"worker": ["a:1", "b:1"]},
                          task_type="worker", task_id=0, source="explicit")
armed = [clean_exit.arm(info, 1)]
%s
"""


class ArmTest(parameterized.TestCase):
  """`arm` (make_strategy) installs the exit hooks; `close` removes them."""

  def setUp(self):
    super().setUp()
    self.exit = sys.exit
    self.addCleanup(setattr, sys, "exit", self.exit)

  def test_arm_wraps_sys_exit_and_close_puts_it_back(self):
    armed = clean_exit.arm(_two_workers(), 5)
    self.addCleanup(armed.close)
    self.assertIsNot(sys.exit, self.exit)
    self.assertIs(sys.exit.__wrapped__, self.exit)
    armed.close()
    self.assertIs(sys.exit, self.exit)

  def test_a_later_strategy_replaces_the_earlier_hook(self):
    first = clean_exit.arm(_two_workers(), 5)
    self.addCleanup(first.close)
    second = clean_exit.arm(_two_workers(), 5)
    self.addCleanup(second.close)
    self.assertIs(sys.exit.__wrapped__, self.exit)
    second.close()
    self.assertIs(sys.exit, self.exit)

  @parameterized.named_parameters(
      ("no_bound", 2, None),
      ("one_task", 1, 5),
  )
  def test_nothing_to_wait_for_arms_nothing(self, workers, timeout_s):
    info = tfdist.ClusterInfo(cluster={"worker": ["a:1", "b:1"][:workers]},
                              task_type="worker", task_id=0, source="explicit")
    self.assertIsNone(clean_exit.arm(info, timeout_s))
    self.assertIs(sys.exit, self.exit)

  @parameterized.named_parameters(
      ("armed", "pass", 1),
      ("closed", "armed[0].close()", 0),
      ("armed_again", "armed.append(clean_exit.arm(info, 1))", 1),
      ("armed_again_then_closed",
       "armed.append(clean_exit.arm(info, 1)); armed[1].close()", 0),
      ("closed_then_sys_exit_0", "armed[0].close(); sys.exit(0)", 0),
  )
  def test_the_wait_at_exit_runs_only_while_armed(self, steps, waits):
    r = subprocess.run([sys.executable, "-c", _ARMED % steps],
                       env=cluster_utils.base_env(), capture_output=True,
                       text=True, timeout=120, cwd=cluster_utils.REPO)
    self.assertEqual(r.returncode, 0, r.stderr[-2000:])
    self.assertEqual(
        r.stderr.count("tfdist: worker:0 waited"), waits, r.stderr[-2000:])


if __name__ == "__main__":
  absltest.main()
