"""Where a launcher gets its members: the first row of `SOURCES` that serves.

Every source has one protocol (`rounds.Solo`, `rendezvous.Member`): ``join``
(this node's tasks -> the round's `rounds.Cluster`), ``send``
(`rounds.Failed`, `rounds.Done`, a stall report), ``poll`` (`rounds.Stop`,
`rounds.Finish` or ``None``) and ``close``. Rows: SLURM's step (its nodes,
`tfdist.cluster.slurm.launch_fields`; a node of another job is refused),
one node, a TCP rendezvous. A new source, such as a Kubernetes indexed job,
is one function and a row (docs/multi_node.md).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import sys
import threading
import types
from typing import Any, Callable, Mapping

from tfdist import _net
from tfdist.cluster import slurm
from tfdist.errors import ConfigError
from tfdist.launch import rendezvous
from tfdist.launch import rounds
from tfdist.launch.spec import LaunchSpec
from tfdist.launch.spec import Prepared
from tfdist.launch.spec import preflight

__all__ = ["Opened", "SOURCES", "open_members"]

#: Node 0 could not listen for the rendezvous -> the field to blame (else
#: master_addr: not an address of node 0).
_LISTEN_ERRORS = {errno.EADDRINUSE: "master_port", errno.EACCES: "master_port"}


@dataclasses.dataclass(frozen=True)
class Opened:
  """A source opened: the spec it completed, what `preflight` found, the
  members, the address of this node's tasks, and what to close."""
  spec: LaunchSpec
  prepared: Prepared
  members: Any
  host: str
  master: rendezvous.Master | None = None

  def close(self) -> None:
    self.members.close()
    if self.master is not None:
      self.master.close()


def _solo(spec: LaunchSpec, launcher, agree: Mapping[str, str]) -> Opened:
  prepared = preflight(spec)
  if not _net.is_loopback(spec.address):
    print(f"tfdist: warning: TensorFlow's gRPC servers listen on every "
          f"interface (0.0.0.0), not only on {spec.address}: host only sets "
          "the addresses in TF_CONFIG", file=sys.stderr, flush=True)
  return Opened(spec, prepared, rounds.Solo(max_restarts=spec.max_restarts),
                spec.address)


def _tcp(spec: LaunchSpec, launcher, agree: Mapping[str, str]) -> Opened:
  prepared, master = preflight(spec), None
  nodes = (str(spec.nnodes) if spec.min_nodes == spec.nnodes
           else f"{spec.min_nodes}:{spec.nnodes}")
  agree = {"--nnodes": nodes, "--run-id": prepared.run_id, **agree}
  secret, address = prepared.secret.encode(), (spec.master_addr,
                                               spec.master_port)
  if spec.node_rank == 0:
    try:
      master = rendezvous.Master(
          address=address, nnodes=spec.nnodes, min_nodes=spec.min_nodes,
          last_call=spec.last_call_seconds, secret=secret, agree=agree,
          node=prepared.node, timeout=spec.rendezvous_timeout_seconds,
          max_restarts=spec.max_restarts, say=launcher.console.say,
          on_report=launcher.merge_report)
    except OSError as e:
      field = _LISTEN_ERRORS.get(e.errno, "master_addr")
      raise ConfigError(
          field=field, value=getattr(spec, field), source="LaunchSpec",
          expected=f"an address of node 0 and a free port (node 0 cannot "
                   f"listen on {spec.master_addr} port {spec.master_port})",
          hint=f"{e.strerror or e}; --master-addr must be an address of "
               "node 0 and the port free") from None
  try:
    member = rendezvous.Member(
        master=address, rank=spec.node_rank, secret=secret, agree=agree,
        node=prepared.node, timeout=spec.rendezvous_timeout_seconds,
        stop=launcher.stopping, say=launcher.console.say)
  except BaseException:
    if master is not None:
      master.close()
    raise
  return Opened(spec, prepared, member, spec.host or member.local_address,
                master)


def _slurm(spec: LaunchSpec, launcher, agree: Mapping[str, str]) -> Opened:
  fields, line, job = slurm.launch_fields(
      tasks=spec.num_tasks, min_nodes=spec.min_nodes if spec.elastic else None)
  launcher.console.say(line)
  spec = dataclasses.replace(spec, run_id=spec.run_id or f"slurm-{job}",
                             **fields)
  return (_solo if spec.nnodes == 1 else _tcp)(
      spec, launcher, {**agree, "SLURM_JOB_ID": job})


#: (name, whether it serves ``spec`` in ``environ``, how to open it).
SOURCES = (
    ("SLURM", lambda spec, environ: slurm.is_slurm_step(environ)
     and spec.master_addr is None, _slurm),
    ("one node", lambda spec, environ: spec.nnodes == 1, _solo),
    ("TCP rendezvous", lambda spec, environ: True, _tcp),
)


def open_members(spec: LaunchSpec, *, console, stopping: threading.Event,
                 merge_report: Callable[[int, dict], None]) -> Opened:
  """The members of the first row of `SOURCES` that serves ``spec``: lines
  to ``console``, waits ended by ``stopping``, stall reports of other nodes
  to ``merge_report``.

  Raises:
    ConfigError: `preflight` failed, node 0 cannot listen for the
      rendezvous, or a SLURM step is not one task per node.
    RendezvousError: node 0 cannot be reached.
  """
  opener = next(o for _, serves, o in SOURCES if serves(spec, os.environ))
  return opener(spec, types.SimpleNamespace(
      console=console, stopping=stopping, merge_report=merge_report), {})
