"""The test harness's own promises: stalls do not count, hangs say where,
and only a fault in TensorFlow's own threads counts as TensorFlow's.

`stalls` keeps a stop of the machine out of the tests' bounds; here a child
process that imports it is stopped (SIGSTOP) for a few seconds, as a paused
virtual machine stops every process. `cluster_utils.Tasks` aborts a task that
overruns a wait and puts its Python stacks in the failure message.
"""

import signal
import sys
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

import cluster_utils

pytestmark = pytest.mark.beside  # tests/conftest.py: starts no cluster.

STOPPED_S = 3.0

# Prints "ready", then, on its own clock, how long 6 s took to run.
_STALLED_CHILD = f"""
import sys, time, json
sys.path.insert(0, {cluster_utils.REPO + '/tests'!r})
import stalls
print("ready", flush=True)
start = time.monotonic()
time.sleep(6)
print(json.dumps({{"elapsed": time.monotonic() - start,
                  "running": stalls.running_since(start),
                  "stalls": [s.seconds for s in stalls.stalls()]}}))
"""

_HUNG_CHILD = """
import time
def waiting_for_a_peer_that_never_comes():
  print("ready", flush=True)
  time.sleep(600)
waiting_for_a_peer_that_never_comes()
"""


def _tasks(code):
  return cluster_utils.Tasks(commands=[[sys.executable, "-c", code]],
                             envs=[cluster_utils.base_env()])


@pytest.mark.timeout(120)
class StallsTest(absltest.TestCase):

  def test_a_stopped_process_does_not_count_the_stop(self):
    with _tasks(_STALLED_CHILD) as tasks:
      tasks.wait_for(0, "ready", 60)
      time.sleep(1)
      tasks.signal(0, signal.SIGSTOP)
      time.sleep(STOPPED_S)
      tasks.signal(0, signal.SIGCONT)
      self.assertEqual(tasks.wait(0, 60), 0, tasks.stderr(0))
      out = tasks.json(0)
    self.assertLen(out["stalls"], 1, out)
    self.assertGreater(out["stalls"][0], STOPPED_S - 0.5)
    # The stop fell inside the 6 s: they ran about 6 - STOPPED_S.
    self.assertLess(out["running"], out["elapsed"] - STOPPED_S + 0.5)


@pytest.mark.timeout(120)
class HungTaskTest(absltest.TestCase):

  def test_an_overrun_wait_shows_where_the_task_waits(self):
    with _tasks(_HUNG_CHILD) as tasks:
      tasks.wait_for(0, "ready", 60)
      with self.assertRaises(AssertionError) as caught:
        tasks.wait(0, 1)
      code = tasks.wait(0, 30)
    message = str(caught.exception)
    self.assertIn("still running after 1 s", message)
    self.assertIn("its threads when it was aborted", message)
    self.assertIn("in waiting_for_a_peer_that_never_comes", message)
    self.assertEqual(code, -signal.SIGABRT)

  def test_a_line_never_printed_shows_where_the_task_waits(self):
    with _tasks(_HUNG_CHILD) as tasks:
      with self.assertRaises(AssertionError) as caught:
        tasks.wait_for(0, "a line it never prints", 3)
    self.assertIn("never printed 'a line it never prints'",
                  str(caught.exception))
    self.assertIn("in waiting_for_a_peer_that_never_comes",
                  str(caught.exception))


_FAULT = ("[worker:0] Fatal Python error: Segmentation fault\n\n"
          "Thread 0x00007f1faebff6c0 (most recent call first):\n"
          "  File \"tfdist/_flight.py\", line 259 in _watch\n")


class NativeCrashTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("in_a_thread_without_python", _FAULT, True),
      ("aborted_there", _FAULT.replace("Segmentation fault", "Aborted"), True),
      ("in_python_code", _FAULT.replace("Thread 0x", "Current thread 0x"),
       False),
      ("said_mid_line", "x " + _FAULT, False),
      ("no_fault", "tfdist: task worker:0 exited 1", False))
  def test_only_a_fault_outside_python_is_native(self, output, native):
    self.assertIs(cluster_utils.native_crash(output), native)


if __name__ == "__main__":
  absltest.main()
