"""``tfdist launch``: every task of a cluster as a local process.

Arguments only: they become a `tfdist.launch.LaunchSpec`, and
`tfdist.launch.launch` runs it.
"""

from __future__ import annotations

import argparse
import dataclasses

from tfdist import launch as launch_lib
from tfdist.cli import _args

__all__ = ["add_arguments", "build_spec", "run"]

_SOURCE = "tfdist launch arguments"
_EXAMPLE = "tfdist launch --workers 2 -- python train.py"

_FLAGS: _args.FlagTable = {
    "num_workers": ("--workers", dict(type=int, metavar="N",
                                      help="worker tasks")),
    "num_ps": ("--ps", dict(type=int, metavar="N",
                            help="parameter-server tasks; adds a chief")),
    "chief": ("--chief", dict(action="store_true", help="add a chief task")),
    "evaluator": ("--evaluator", dict(action="store_true",
                                      help="add an evaluator task")),
    "host": ("--host", dict(
        help="the address of this node that the other tasks dial, written in "
             "every task's TF_CONFIG (default 127.0.0.1 on one node; on "
             "several, the address this node reaches --master-addr from). "
             "TensorFlow's gRPC server listens on every interface (0.0.0.0) "
             "whatever it says; only the rendezvous listens on "
             "--master-addr alone")),
    "port_base": ("--port-base", dict(
        type=int, metavar="PORT",
        help="first of consecutive ports (default: free ports)")),
    "log_dir": ("--log-dir", dict(
        metavar="DIR",
        help="also write each task's output to DIR/TYPE-INDEX.log")),
    "max_restarts": ("--max-restarts", dict(
        type=int, metavar="K",
        help="relaunch the cluster up to K times after a task failed (node "
             "0's K counts); a node lost or joining spends none")),
    "restart_delay_seconds": ("--restart-delay-seconds", dict(
        type=float, metavar="S",
        help="wait before the first restart after a failure; it doubles "
             "before each further one, up to "
             f"{launch_lib.MAX_RESTART_DELAY_SECONDS:g} s. A change of "
             "members restarts at once")),
    "grace_seconds": ("--grace-seconds", dict(
        type=float, metavar="S",
        help="time a task gets to exit after SIGTERM")),
    "nnodes": ("--nnodes", dict(
        type=_args.matching(r"\d+(:\d+)?", "N or MIN:MAX"),
        metavar="N|MIN:MAX",
        help="nodes of the job: run tfdist launch on each, with the same "
             "--nnodes, --master-addr and --master-port; --workers, --ps, "
             "--chief and --evaluator then count this node's tasks. MIN:MAX "
             "is an elastic job: it starts with MAX nodes, or MIN or more "
             "at the last call, and restarts at the new size when a node "
             "is lost or joins, spending no restart")),
    "last_call_seconds": ("--last-call-seconds", dict(
        type=float, metavar="S",
        help="how long each round of an elastic job waits for more nodes "
             "once MIN joined; a node not (back) by then joins at the next "
             "restart")),
    "run_id": ("--run-id", dict(
        metavar="ID",
        help="the job's name, the same on every node, in TFDIST_RUN_ID: "
             "letters, digits, -, _ and . (default: 12 hex digits of a "
             "hash of the job secret)")),
    "node_rank": ("--node-rank", dict(
        type=int, metavar="R", help="this node's rank, 0 to MAX-1; node 0 runs "
                                    "the rendezvous and holds the chief")),
    "master_addr": ("--master-addr", dict(
        metavar="HOST", help="node 0's address, as every node reaches it; "
        "in an srun step (one task a node) SLURM gives it, --nnodes and "
        "--node-rank")),
    "master_port": ("--master-port", dict(
        type=int, metavar="PORT", help="the rendezvous port on node 0")),
    "rendezvous_timeout_seconds": ("--rendezvous-timeout-seconds", dict(
        type=float, metavar="S",
        help="time each round may wait for enough nodes to join (all, or "
             "MIN)")),
    "secret_file": ("--secret-file", dict(
        metavar="FILE",
        help="a file (mode 600) holding the job's shared secret, when "
             "TFDIST_JOB_SECRET is not set; a multi-node launch needs one, "
             "the same on every node")),
    "stall_seconds": ("--stall-seconds", dict(
        type=float, metavar="S",
        help="print the stall report (each task's step, its last collective, "
             "who is behind, the line each one is on) when a task saw no "
             "step for S seconds; it is printed anyway on a collective's "
             "timeout, a lost peer, or SIGUSR2 (kill -USR2 LAUNCHER_PID); "
             "0: no stall watch")),
    "gpus_per_task": ("--gpus-per-task", dict(
        type=int, metavar="K",
        help="GPUs for each chief, worker and evaluator task of this node "
             "(CUDA_VISIBLE_DEVICES); default: an even share; ps tasks get "
             "none")),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the flags of ``tfdist launch`` to ``parser``."""
  defaults = {f.name: f.default for f in dataclasses.fields(
      launch_lib.LaunchSpec)}
  _args.add_flags(parser, _FLAGS, defaults=defaults)
  _args.add_command(parser, help_text="the program to run in every task")


def build_spec(args: argparse.Namespace) -> launch_lib.LaunchSpec:
  """The spec the arguments ask for; touches nothing (`tfdist.launch.launch`
  checks it against this machine first, `tfdist.launch.preflight`).

  Raises:
    ConfigError: the arguments make an invalid spec.
  """
  with _errors():
    return launch_lib.LaunchSpec(
        command=_args.command(args, source=_SOURCE, example=_EXAMPLE),
        **_args.given(args, _FLAGS))


def run(args: argparse.Namespace) -> int:
  """Launches the cluster; returns the launcher's exit code.

  Raises:
    ConfigError: the arguments make an invalid spec, or this machine cannot
      run it; no task is left running.
  """
  spec = build_spec(args)
  with _errors():
    return launch_lib.launch(spec)


def _errors():
  return _args.config_errors(source=_SOURCE, renamed=_args.spellings(_FLAGS))
