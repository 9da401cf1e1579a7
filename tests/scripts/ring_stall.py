"""A task of a socket ring without TensorFlow; one task falls behind.

Usage: ring_stall.py DIR --slow RANK --at STEP [--extra RANK2]

Run under tfdist launch: the ring's hosts and this task's rank come from
TF_CONFIG, ports are published as files in DIR. Every task records its
steps in the flight recorder (`tfdist._flight`) and all-reduces a small
buffer each step; task RANK sleeps after step STEP (its `SLEEP_LINE`), so
the others wait in the next step's all-reduce until the launcher stops them.
Task RANK2 all-reduces one extra, smaller tensor after step STEP.
"""

import argparse
import json
import os
import time

import numpy as np

from tfdist import _flight
from tfdist.bench import schedules
from tfdist.ring import SocketRing

parser = argparse.ArgumentParser()
parser.add_argument("dir")
parser.add_argument("--slow", type=int, default=-1)
parser.add_argument("--at", type=int, default=5)
parser.add_argument("--extra", type=int, default=-1)
args = parser.parse_args()

config = json.loads(os.environ["TF_CONFIG"])
hosts = [a.rpartition(":")[0] for a in config["cluster"]["worker"]]
rank = config["task"]["index"]
ring = SocketRing(rank=rank, hosts=hosts,
                  rendezvous=schedules.DirectoryRendezvous(args.dir),
                  key="ring_stall", timeout_s=600, connect_timeout_s=60,
                  names=[f"worker:{i}" for i in range(len(hosts))])
_flight.watch()
print(json.dumps({"pid": os.getpid(), "rank": rank}), flush=True)
for step in range(1, 1000):
  _flight.begin_step(step)
  ring.all_reduce(np.ones(1024, np.float32), kind="gradient bucket 1/1")
  if rank == args.slow and step == args.at:
    time.sleep(600)  # SLEEP_LINE: the stall report names this line.
  if rank == args.extra and step == args.at:
    ring.all_reduce(np.ones(512, np.float32))
