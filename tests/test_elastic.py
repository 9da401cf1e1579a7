"""Elastic launch (``tfdist launch --nnodes MIN:MAX``): rounds of membership,
restarts at a new size, and training that survives a lost node.

`RoundsTest` drives the rendezvous's decisions alone, on a clock of its own;
`LoopbackTest` runs real launchers on loopback with a program without
TensorFlow and SIGKILLs one of them; `BedTest` runs Keras ``fit`` with a
backup on three hosts of the network-namespace bed, admits a late one,
SIGKILLs its launcher, admits it back under its rank and cuts its link, and
compares the final weights with an uninterrupted run. 64 launchers:
tests/test_elastic_scale.py.
"""

import json
import os
import re
import sys
import tempfile
from typing import Callable

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist import _net
from tfdist.launch import local
from tfdist.launch import rounds as rounds_lib
from tfdist.launch import spec as spec_lib

import cluster_utils
import fault_runs
import netbed

SECRET = "elastic-test-secret"
LAUNCH = [sys.executable, "-m", "tfdist", "launch"]
TASK = os.path.join(cluster_utils.SCRIPTS, "launch_task.py")


class _Clock:

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def _join(attempt=0, workers=1):
  return {"kind": "join", "attempt": attempt, "host": "h",
          "jobs": {"worker": workers}, "evaluator": False, "ports": [1]}


def _kinds(out):
  """Rank -> the kinds of the messages it gets, in order."""
  seen = {}
  for rank, message in out:
    seen.setdefault(rank, []).append(message["kind"])
  return seen


@pytest.mark.beside
class RoundsTest(parameterized.TestCase):

  def _rounds(self, low, high, restarts=2, last_call=5.0):
    self.clock = _Clock()
    return rounds_lib.Rounds(min_nodes=low, max_nodes=high,
                             max_restarts=restarts, timeout=60,
                             last_call=last_call, clock=self.clock)

  def _start(self, rounds, ranks):
    out = []
    for r in ranks:
      out += rounds.join(r, _join(), first=True)
    return out

  def test_max_nodes_start_at_once_with_dense_places(self):
    rounds = self._rounds(2, 3)
    out = self._start(rounds, [2, 0, 1])
    self.assertEqual(_kinds(out), {0: ["cluster"], 1: ["cluster"],
                                   2: ["cluster"]})
    places = {r: m["places"] for r, m in out}
    self.assertEqual(places, {0: [("worker", 0)], 1: [("worker", 1)],
                              2: [("worker", 2)]})

  def test_min_nodes_start_after_the_last_call(self):
    rounds = self._rounds(2, 3, last_call=5.0)
    self.assertEqual(self._start(rounds, [0, 1]), [])
    self.clock.now = 4.9
    self.assertEqual(rounds.tick(), [])
    self.clock.now = 5.0
    out = rounds.tick()
    self.assertEqual(_kinds(out), {0: ["cluster"], 1: ["cluster"]})
    self.assertEqual(out[0][1]["nodes"], [0, 1])

  def test_too_few_nodes_in_time_is_an_error_for_all(self):
    rounds = self._rounds(2, 3)
    self._start(rounds, [0])
    self.clock.now = 61
    out = rounds.tick()
    self.assertEqual(_kinds(out), {0: ["error"]})
    self.assertIn("needs 2 or more", out[0][1]["why"])
    self.assertTrue(rounds.over)

  @parameterized.named_parameters(
      # (event, --max-restarts, the next round, the nodes that join it)
      ("lost_node_restarts_the_rest_for_free", "lost", 0, 1, [0, 1]),
      ("failed_task_restarts_everyone", "failed", 2, 1, [0, 1, 2]),
      ("preempted_task_restarts_everyone", "preempted", 2, 1, [0, 1, 2]),
      ("failed_task_without_restarts_stops_for_good", "failed", 0, None, []),
  )
  def test_a_running_round_ends_in_stop(self, event, restarts, restart,
                                        survivors):
    rounds = self._rounds(2, 3, restarts=restarts)
    self._start(rounds, [0, 1, 2])
    if event == "lost":
      out = rounds.lost(2, "node 2 went away")
    else:
      out = rounds.failed(2, {"attempt": 0, "role": "worker:2",
                              "code": 42 if event == "preempted" else 3})
    self.assertEqual({m["kind"] for _, m in out}, {"stop"})
    self.assertEqual({m["restart"] for _, m in out}, {restart})
    self.assertEqual(rounds.over, restart is None)
    for r in survivors:
      out = rounds.join(r, _join(attempt=1), first=False)
    if survivors:
      cluster = dict(out)[0]
      self.assertEqual(cluster["nodes"], survivors)
      self.assertEqual(cluster["previous"], 3)
      self.assertEqual(cluster["why"], {
          "lost": "node 2 went away",
          "failed": "task worker:2 on node 2 failed",
          "preempted": "task worker:2 on node 2 was preempted"}[event])
      self.assertEqual((cluster["failure"], cluster["failures"]),
                       (event != "lost", int(event != "lost")))

  def test_members_change_for_free_and_failures_spend_restarts(self):
    """torchrun's rule: losses and joins restart without spending any of
    ``max_restarts``; with none, the first failed task ends the job."""
    rounds = self._rounds(2, 3, restarts=0)
    self._start(rounds, [0, 1, 2])
    for attempt, event in enumerate(("lost", "joined", "lost", "joined"), 1):
      if event == "lost":
        out = rounds.lost(2, "gone")
      else:
        out = rounds.join(2, _join(), first=True)
      self.assertEqual({m["restart"] for _, m in out}, {attempt})
      self.assertEqual({m["failure"] for _, m in out}, {False})
      out = []
      for r in (0, 1):  # The newcomer is in: it joined.
        out += rounds.join(r, _join(attempt=attempt), first=False)
      self.assertEqual(sorted(_kinds(out)),
                       [0, 1] if event == "lost" else [0, 1, 2])
      self.assertEqual(dict(out)[0]["failures"], 0)
    out = rounds.failed(1, {"attempt": 4, "role": "worker:1", "code": 3})
    self.assertEqual([(m["restart"], m["code"]) for _, m in out],
                     [(None, 3)] * 3)
    self.assertTrue(rounds.over)

  @parameterized.named_parameters(
      # (its node lost within the grace, the failure's restart is free)
      ("the_node_is_lost_meanwhile", 9.0, True),
      ("no_node_is_lost", None, False),
  )
  def test_a_failure_on_a_lost_peer_waits_for_the_loss(self, lost_at, free):
    """A cut link: node 0's task fails on its lost peer before node 2's
    silence is noticed. The failure waits; the loss makes it free."""
    clock = _Clock()
    rounds = rounds_lib.Rounds(min_nodes=2, max_nodes=3, max_restarts=0,
                               timeout=60, last_call=5.0, peer_grace=12.0,
                               clock=clock)
    self._start(rounds, [0, 1, 2])
    out = rounds.failed(0, {"attempt": 0, "role": "worker:0", "code": 1,
                            "peer_lost": True})
    self.assertEqual(out, [])  # Held, the round goes on.
    clock.now = 11.9
    self.assertEqual(rounds.tick(), [])
    if lost_at is not None:
      clock.now = lost_at
      out = rounds.lost(2, "node 2 sent nothing for 10 s")
      clock.now = 30  # The grace is over: nothing is counted twice.
      out += rounds.tick()
    else:
      clock.now = 12.0
      out = rounds.tick()
    self.assertEqual({m["kind"] for _, m in out}, {"stop"})
    if free:
      self.assertEqual({(m["restart"], m["failure"]) for _, m in out},
                       {(1, False)})
      self.assertEqual(rounds.failures, 0)
    else:  # No restart to spend: the job ends with the task's code.
      self.assertEqual({(m["restart"], m["code"]) for _, m in out},
                       {(None, 1)})
      self.assertTrue(rounds.over)

  def _settling(self):
    clock = _Clock()
    rounds = rounds_lib.Rounds(min_nodes=2, max_nodes=16, max_restarts=0,
                               timeout=60, last_call=5.0, peer_grace=12.0,
                               settle=2.0, clock=clock)
    self._start(rounds, range(16))
    return rounds, clock

  @parameterized.named_parameters(
      # (events: (seconds, "lost" or "joined", rank), the one stop's time,
      # its why)
      ("losses_at_once", [(0, "lost", 5), (0, "lost", 6), (0, "lost", 7)], 2,
       "node 5 went away; 2 more within 2 s of each other (nodes 6, 7)"),
      ("losses_found_by_silence", [(0, "lost", 5), (0.9, "lost", 6),
                                   (1.8, "lost", 7)], 3.8,
       "node 5 went away; 2 more within 2 s of each other (nodes 6, 7)"),
      ("a_loss_and_a_return", [(0, "lost", 7), (1, "joined", 7)], 3,
       "node 7 went away; 1 more within 2 s of each other (nodes 7)"),
      ("endless_changes_stop_at_the_peer_grace",
       [(i * 1.5, "lost", 15 - i) for i in range(8)], 12,
       "node 15 went away; 7 more within 2 s of each other (nodes 14, 13, "
       "12, 11, 10, 9, 8)"),
  )
  def test_a_burst_of_changes_is_one_restart(self, events, stops_at, why):
    rounds, clock = self._settling()
    out = []
    for now in sorted({t for t, _, _ in events} | {stops_at - 0.1}):
      clock.now = now
      for _, what, rank in (e for e in events if e[0] == now):
        out += (rounds.lost(rank, f"node {rank} went away") if what == "lost"
                else rounds.join(rank, _join(), first=True))
      out += rounds.tick()
    self.assertEqual(out, [])  # Nothing stops before the change settled.
    clock.now = stops_at
    out = rounds.tick()
    self.assertEqual({(m["kind"], m["restart"], m["failure"]) for _, m in out},
                     {("stop", 1, False)})
    self.assertEqual(out[0][1]["why"], why)
    clock.now += 20  # Within the next round's timeout.
    self.assertEqual(rounds.tick(), [])  # One stop, never two.

  def test_a_burst_of_returns_joins_one_round(self):
    rounds, clock = self._settling()
    left = [r for r in range(16) if r not in (5, 6, 7)]
    for rank in (5, 6, 7):
      rounds.lost(rank, "gone")
    clock.now = 2
    self.assertEqual({m["restart"] for _, m in rounds.tick()}, {1})
    for rank in left:
      out = rounds.join(rank, _join(attempt=1), first=False)
    self.assertEqual(sorted(_kinds(out)), left)
    clock.now = 10
    for rank in (5, 6, 7):  # Launchers started together, joining apart.
      clock.now += 0.5
      self.assertEqual(rounds.join(rank, _join(), first=True), [])
    clock.now += 2
    out = rounds.tick()
    self.assertEqual({(m["restart"], m["why"]) for _, m in out}, {(
        2, "node 5 joined; 2 more within 2 s of each other (nodes 6, 7)")})
    for rank in left:
      out = rounds.join(rank, _join(attempt=2), first=False)
    self.assertEqual((out[0][1]["nodes"], out[0][1]["previous"]),
                     (list(range(16)), 13))

  def test_a_failure_while_members_change_is_their_consequence(self):
    rounds, clock = self._settling()
    rounds.lost(7, "node 7 went away")
    clock.now = 1
    self.assertEqual(rounds.failed(0, {"attempt": 0, "role": "worker:0",
                                       "code": 1}), [])
    clock.now = 2
    out = rounds.tick()
    self.assertEqual({(m["restart"], m["failure"], m["failures"])
                      for _, m in out}, {(1, False, 0)})

  def test_without_elasticity_a_lost_peer_fails_at_once(self):
    rounds = rounds_lib.Rounds(min_nodes=3, max_nodes=3, max_restarts=1,
                               timeout=60, peer_grace=12.0, clock=_Clock())
    self._start(rounds, [0, 1, 2])
    out = rounds.failed(0, {"attempt": 0, "role": "worker:0", "code": 1,
                            "peer_lost": True})
    self.assertEqual({(m["restart"], m["failure"]) for _, m in out},
                     {(1, True)})

  def test_below_min_the_job_stops(self):
    rounds = self._rounds(2, 3)
    self._start(rounds, [0, 1])
    self.clock.now = 5
    rounds.tick()
    out = rounds.lost(1, "node 1 went away")
    self.assertEqual([m["restart"] for _, m in out], [None])
    self.assertIn("the job needs 2", out[0][1]["why"])

  def test_the_next_round_starts_once_every_member_joined_again(self):
    rounds = self._rounds(2, 3)
    self._start(rounds, [0, 1, 2])
    rounds.lost(2, "gone")
    self.assertEqual(rounds.join(0, _join(attempt=1), first=False), [])
    out = rounds.join(1, _join(attempt=1), first=False)
    self.assertEqual(_kinds(out), {0: ["cluster"], 1: ["cluster"]})
    self.assertEqual(out[0][1]["attempt"], 1)

  def test_a_member_not_back_by_the_last_call_is_left_out(self):
    """Every round has a last call: a member whose heartbeat goes on but
    which does not join again waits for the next restart, and its late
    join is one."""
    rounds = self._rounds(2, 3, last_call=5.0)
    self._start(rounds, [0, 1, 2])
    rounds.failed(0, {"attempt": 0, "role": "worker:0", "code": 3})
    self.clock.now = 10
    self.assertEqual(rounds.join(0, _join(attempt=1), first=False), [])
    self.assertEqual(rounds.join(1, _join(attempt=1), first=False), [])
    self.clock.now = 14.9
    self.assertEqual(rounds.tick(), [])
    self.clock.now = 15
    out = rounds.tick()
    self.assertEqual(_kinds(out), {0: ["cluster"], 1: ["cluster"],
                                   2: ["wait"]})
    self.assertEqual(dict(out)[0]["late"], [2])
    self.assertIn("node 2 did not join again by the last call (5 s)",
                  dict(out)[2]["why"])
    out = rounds.join(2, _join(attempt=1), first=False)
    self.assertEqual([(m["kind"], m["restart"], m["why"]) for _, m in out],
                     [("stop", 2, "node 2 joined")] * 3)
    self.assertEqual(rounds.failures, 1)  # The failure alone.

  def test_the_last_call_ends_by_the_rounds_deadline(self):
    """MIN joined and the timeout passed before the last call: the round
    starts, never the error that too few joined."""
    self.clock = _Clock()
    rounds = rounds_lib.Rounds(min_nodes=2, max_nodes=3, max_restarts=0,
                               timeout=60, last_call=100,
                               clock=self.clock)
    self.clock.now = 59
    self._start(rounds, [0, 1])
    self.clock.now = 60.5
    self.assertEqual(_kinds(rounds.tick()), {0: ["cluster"], 1: ["cluster"]})

  def test_a_newcomer_while_running_restarts_for_free(self):
    rounds = self._rounds(2, 3, restarts=0)
    self._start(rounds, [0, 1])
    self.clock.now = 5
    rounds.tick()
    out = rounds.join(2, _join(), first=True)
    self.assertEqual([(m["kind"], m["restart"], m["why"]) for _, m in out],
                     [("stop", 1, "node 2 joined")] * 3)
    rounds.join(0, _join(attempt=1), first=False)
    out = rounds.join(1, _join(attempt=1), first=False)
    self.assertEqual(sorted(_kinds(out)), [0, 1, 2])

  def test_what_the_tasks_see_of_each_round(self):
    rounds = self._rounds(2, 3, restarts=2)
    seen = [local.job_variables(rounds_lib.typed(dict(self._start(rounds, [0, 1, 2]))[0]),
                                "run-7")]
    rounds.failed(1, {"attempt": 0, "role": "worker:1", "code": 3})
    rounds.lost(2, "gone")
    rounds.join(0, _join(attempt=1), first=False)
    seen.append(local.job_variables(rounds_lib.typed(
        dict(rounds.join(1, _join(attempt=1), first=False))[0]), "run-7"))
    self.assertEqual(seen, [
        {"TFDIST_RESTART": "0", "TFDIST_RESTART_COUNT": "0",
         "TFDIST_MAX_RESTARTS": "2", "TFDIST_RUN_ID": "run-7",
         "TFDIST_NNODES": "3"},
        {"TFDIST_RESTART": "1", "TFDIST_RESTART_COUNT": "1",
         "TFDIST_MAX_RESTARTS": "2", "TFDIST_RUN_ID": "run-7",
         "TFDIST_NNODES": "2"}])

  def test_finish_once_every_trainer_is_done(self):
    rounds = self._rounds(2, 2)
    self._start(rounds, [0, 1])
    self.assertEqual(rounds.done(0), [])
    self.assertEqual(_kinds(rounds.done(1)), {0: ["finish"], 1: ["finish"]})

  def test_a_node_late_for_all_of_it_learns_how_the_job_ended(self):
    rounds = self._rounds(1, 3)
    self._start(rounds, [0])
    self.clock.now = 5
    rounds.tick()
    self.assertEqual(_kinds(rounds.done(0)), {0: ["finish"]})
    self.assertEqual(rounds.join(2, _join(), first=True),
                     [(2, {"kind": "finish"})])

  def test_a_layout_that_cannot_work_is_an_error_with_2(self):
    rounds = self._rounds(2, 2)
    rounds.join(0, _join(workers=0), first=True)
    out = rounds.join(1, _join(workers=0), first=True)
    self.assertEqual({m["code"] for _, m in out}, {2})


def _launchers(count, *, nnodes, extra=(), program=(), port=None):
  port = port or _net.free_ports(1)[0]
  env = cluster_utils.base_env({_net.JOB_SECRET_VARIABLE: SECRET})
  commands = [LAUNCH + ["--nnodes", nnodes, "--node-rank", str(r),
                        "--master-addr", "127.0.0.1", "--master-port",
                        str(port), *extra, "--", *program]
              for r in range(count)]
  return commands, env


@pytest.mark.timeout(180)
class LoopbackTest(parameterized.TestCase):

  def test_a_lost_node_restarts_the_rest_for_free_at_the_new_size(self):
    """No --max-restarts: a lost node spends no restart, and at once (no
    backoff); the tasks see the round, its size and the job."""
    commands, env = _launchers(
        3, nnodes="2:3", program=[sys.executable, TASK, "envwait", "4"])
    with cluster_utils.Tasks(commands=commands, envs=[env] * 3,
                             cwd=cluster_utils.REPO,
                             merge_stderr=True) as tasks:
      for i in range(3):
        tasks.wait_for(i, lambda l: "env=" in l, 60)
      tasks.kill(2)
      codes = [tasks.wait(i, 60) for i in (0, 1)]
      outs = [tasks.stdout(i) for i in (0, 1)]
    self.assertEqual(codes, [0, 0], outs)
    for out in outs:
      self.assertRegex(out, r"tfdist: members changed \(round 1, no restart "
                            r"spent\): node 2's launcher went away .*; 3 "
                            r"nodes, now 2")
      envs = [json.loads(l.split("env=", 1)[1]) for l in out.splitlines()
              if "env=" in l]
      self.assertEqual([len(e["cluster"]["worker"]) for e in envs], [3, 2])
      self.assertEqual([e["job"] for e in envs], [
          {"TFDIST_RESTART": str(n), "TFDIST_RESTART_COUNT": "0",
           "TFDIST_MAX_RESTARTS": "0",
           "TFDIST_RUN_ID": spec_lib.run_id_of(SECRET),
           "TFDIST_NNODES": str(nodes)} for n, nodes in ((0, 3), (1, 2))])
    self.assertIn("[worker:0] env=", outs[0].split("members changed")[1],
                  "the chief stays on node 0")


_BED = netbed.netbed_unavailable_reason()


# The line of the round after each event of node 2's. A cut link is seen by
# the rendezvous (10 s of silence) or first by TensorFlow's own heartbeat
# (10 s) in a survivor's task, whose failure spends a restart.
_FREE = r"members changed \(round {n}, no restart spent\): "
_LINES = {
    "join": _FREE + r"node 2 joined; 2 nodes, now 3",
    "kill": _FREE + r"node 2's launcher went away \(.*\); 3 nodes, now 2",
    # A survivor's task may notice the cut first (TensorFlow's heartbeat):
    # its failure waits for the loss, which makes the restart free.
    "cut": _FREE + r"node 2 sent nothing for 10 s; 3 nodes, now 2",
}


def _after(pattern: str,
           then: Callable[[str], object]) -> Callable[[str], bool]:
  """A line test for `cluster_utils.Tasks.wait_for`: ``then`` holds for a
  line after the first line that ``pattern`` finds."""
  passed = False

  def test(line: str) -> bool:
    nonlocal passed
    if passed and then(line):
      return True
    passed = passed or re.search(pattern, line) is not None
    return False
  return test


def _step(line: str, worker: int = 0) -> int | None:
  match = re.match(rf"\[worker:{worker}\] step (\d+)$", line)
  return int(match.group(1)) if match else None


@pytest.mark.timeout(480)
@absltest.skipIf(_BED is not None, _BED)
class BedTest(absltest.TestCase):
  """Three hosts train ``fault_job.py`` (Keras fit, a backup every 2 steps,
  one worker each) under ``--nnodes 2:3``; node 2 changes the members four
  times mid-epoch, and the nodes there at the end finish with the weights
  of an uninterrupted run of the same global batch."""

  def _command(self, bed, rank, backup):
    return bed.command(f"h{rank}", LAUNCH + [
        "--nnodes", "2:3", "--node-rank", str(rank), "--master-addr",
        bed.address("h0"), "--master-port", "29500", "--last-call-seconds",
        "3", "--grace-seconds", "5", "--",
        sys.executable, os.path.join(cluster_utils.SCRIPTS, fault_runs.JOB),
        "multi_worker_mirrored", "fit", backup, "--sleep", "0.5", "--batch",
        "12"])

  def test_late_node_admitted_killed_back_under_its_rank_then_its_link_cut(
      self):
    """Each event restarts the round, for free (`_LINES`): after a loss (launcher
    SIGKILLed, link cut) the rest go on at 2 nodes, after a join (late, or
    a new launcher with node 2's --node-rank on its host) at 3; every round
    resumes from the backup and trains before the next event. One run of
    the four events (0.5 s a step: a join's 3 s last call trains some 2-4
    of the 18 steps) instead of two runs of two: 93 s against 109 s in
    one full run."""
    events = ("join", "kill", "join", "cut")  # Node 2's; 0 and 1 stay.
    env = cluster_utils.base_env({_net.JOB_SECRET_VARIABLE: SECRET})
    lines = [_LINES[event].format(n=n) for n, event in enumerate(events, 1)]
    with tempfile.TemporaryDirectory() as d:
      reference = fault_runs.reference("fit", "--batch", "12")
      backup = os.path.join(d, "backup")
      with netbed.NetBed(hosts=("h0", "h1", "h2")) as bed, cluster_utils.Tasks(
          commands=[self._command(bed, r, backup) for r in range(3)],
          envs=[env] * 3, cwd=cluster_utils.REPO, merge_stderr=True,
          start=False) as tasks:
        tasks.start(0, 1)
        tasks.wait_for(0, lambda l: _step(l) == 3, 180)  # Mid-epoch.
        for event, line in zip(events, lines):
          if event == "join":
            tasks.start(2)  # Late, or back: admitted by a restart.
          elif event == "kill":
            tasks.kill(2)  # Its tasks die with it (parent-death signal).
          else:
            bed.cut("h2")
          tasks.wait_for(0, _after(line, _step), 180)  # Trains again.
          if event == "join":
            tasks.wait_for(2, lambda l: _step(l, 2) is not None, 180)
        codes = [tasks.wait(i, 300) for i in (0, 1)]
        outs = [tasks.stdout(i) for i in (0, 1)]
    self.assertEqual(codes, [0, 0], outs)
    for out in outs:  # Nodes 0 and 1 saw every round, and ended alike.
      for line in lines:
        self.assertRegex(out, line)
      result = json.loads(next(l for l in reversed(out.splitlines())
                               if re.match(r"\[worker:\d\] \{", l))
                          .split(" ", 1)[1])
      fault_runs.assert_like(self, result, reference)
    # Each round after an event resumed from a backup (one every 2 steps,
    # the first before the first event), never from the first step.
    rounds = re.split("|".join(lines), outs[0])
    resumed = [next(s for l in r.splitlines() if (s := _step(l)) is not None)
               for r in rounds[1:]]
    self.assertTrue(all(s > 2 for s in resumed), resumed)


if __name__ == "__main__":
  absltest.main()
