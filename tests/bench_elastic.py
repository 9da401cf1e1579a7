"""How long an elastic job takes to train again after it loses a node.

Three hosts of a `netbed.NetBed` each run ``tfdist launch --nnodes 2:3``
of ``tests/scripts/fault_job.py`` (Keras ``fit`` under
MultiWorkerMirroredStrategy, a backup every 2 steps, one worker per host).
Once the three train, one host is lost: its launcher SIGKILLed (``kill``), or
its link cut (``cut``); or two train and the third starts late (``join``),
which restarts them all to admit it. The figure is the time from the loss
(or the late launcher's start) to the first training step at the new size on
node 0, TensorFlow's start-up and the restore from the backup included (the
time a line reaches this process).
Needs root, as the bed does; about a minute a run::

  sudo .venv/bin/python tests/bench_elastic.py --runs 2 --json /tmp/e.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from tfdist import _net

import cluster_utils
import fault_runs
import netbed

SECRET = "bench-elastic-secret"


def recovery(how: str, *, workdir: str) -> dict:
  """One run: seconds from losing node 2 (or its late start) to node 0's
  first step after the restart."""
  env = cluster_utils.base_env({_net.JOB_SECRET_VARIABLE: SECRET})
  backup = os.path.join(workdir, f"backup-{how}-{time.monotonic_ns()}")
  with netbed.NetBed(hosts=("h0", "h1", "h2")) as bed:
    commands = [bed.command(f"h{r}", [
        sys.executable, "-m", "tfdist", "launch", "--nnodes", "2:3",
        "--node-rank", str(r), "--master-addr", bed.address("h0"),
        "--master-port", "29500", "--last-call-seconds", "3",
        "--grace-seconds", "5", "--",
        sys.executable, os.path.join(cluster_utils.SCRIPTS, fault_runs.JOB),
        "multi_worker_mirrored", "fit", backup, "--sleep", "0.5",
        "--batch", "12"])
        for r in range(3)]
    with cluster_utils.Tasks(commands=commands, envs=[env] * 3,
                             cwd=cluster_utils.REPO,
                             merge_stderr=True, start=False) as tasks:
      tasks.start(*([0, 1] if how == "join" else [0, 1, 2]))
      tasks.wait_for(0, lambda l: l.startswith("[worker:0] step 4"), 240)
      lost = time.monotonic()
      if how == "join":
        tasks.start(2)
      elif how == "kill":
        tasks.kill(2)
      else:
        bed.cut("h2")
      tasks.wait_for(0, lambda l: "members changed (round 1," in l, 120)
      restarted = time.monotonic()
      seen = []  # wait_for reads from the first line: skip to the restart.
      tasks.wait_for(0, lambda l: seen.append("(round 1," in l) or (
          any(seen) and l.startswith("[worker:0] step ")), 240)
      stepped = time.monotonic()
      codes = [tasks.wait(i, 240) for i in ((0, 1, 2) if how == "join"
                                           else (0, 1))]
  return {"how": how, "loss_to_restart_s": restarted - lost,
          "loss_to_first_step_s": stepped - lost, "exit_codes": codes,
          "load": os.getloadavg()}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--runs", type=int, default=1)
  parser.add_argument("--how", nargs="+", default=["kill", "cut", "join"])
  parser.add_argument("--json", required=True)
  args = parser.parse_args()
  reason = netbed.netbed_unavailable_reason()
  if reason:
    print(f"bench_elastic: {reason}", file=sys.stderr)
    return 2
  runs = []
  with tempfile.TemporaryDirectory() as workdir:
    for _ in range(args.runs):
      for how in args.how:
        runs.append(recovery(how, workdir=workdir))
        print(json.dumps(runs[-1]), flush=True)
  with open(args.json, "w") as f:
    json.dump({"runs": runs}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
