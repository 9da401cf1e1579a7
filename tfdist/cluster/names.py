"""Host names of a cluster, resolved within a bound or refused by name.

A cluster whose host names do not resolve is common (SLURM node names known
only to SLURM, a TF_CONFIG written on another machine). TensorFlow would
retry such a peer until its start-up timeout and then blame the peer; here
every name is looked up once, within `tfdist._net.LOOKUP_TIMEOUT_SECONDS`,
and one that does not resolve is a `ConfigError` naming the host, the field
that named it and the lookup's own error, within seconds. Under SLURM a node
whose name does not resolve is reached at its ``NodeAddr``, as SLURM itself
does (`resolve_names`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from typing import Mapping

from tfdist import _net
from tfdist.cluster.info import ClusterInfo
from tfdist.errors import ConfigError

__all__ = ["resolve_host", "resolve_names", "SCONTROL_TIMEOUT_SECONDS"]

#: The bound on asking ``scontrol`` for a node's ``NodeAddr``.
SCONTROL_TIMEOUT_SECONDS = 10.0


def resolve_host(host: str, *, field: str, source: str,
                 timeout: float = _net.LOOKUP_TIMEOUT_SECONDS) -> list[str]:
  """The addresses ``host`` resolves to, within ``timeout`` seconds.

  Args:
    host: a name or an address (IPv6 without brackets).
    field: what named it, for the error, e.g. ``"cluster.worker[1]"``.
    source: where that came from, e.g. ``"TF_CONFIG from the environment"``.
    timeout: the bound on the lookup (a resolver that does not answer).

  Returns:
    Its addresses, sorted, at least one.

  Raises:
    ConfigError: the name does not resolve, or the lookup outlived
      ``timeout``; names the host and the lookup's own error.
  """
  addresses, problem = _net.lookup(host, timeout)
  if problem is None:
    return addresses
  raise ConfigError(
      field=field, value=host, source=source,
      expected="a host name this machine can resolve, or an IP address",
      hint=(f"Looking up {host!r} failed: {problem}. Add the name to "
            "/etc/hosts or DNS, or use the host's IP address (under SLURM "
            "the node's NodeAddr is used when its name does not resolve)"))


def resolve_names(info: ClusterInfo, *,
             environ: Mapping[str, str] | None = None) -> ClusterInfo:
  """``info`` with every host resolvable, the way SLURM reaches its nodes.

  When every host name resolves, ``info`` is kept. Under SLURM, when any
  node name does not resolve, every node is named by its ``NodeAddr`` (as
  SLURM itself reaches its nodes): from ``SLURM_NODE_ALIASES``
  (``name:addr:hostname,...``, set for cloud and dynamic nodes) when the job
  has it, else from one ``scontrol show node`` (bounded by
  `SCONTROL_TIMEOUT_SECONDS`); every node, so that tasks that resolve only
  their own node's name still write one cluster. Anything else that does not
  resolve is refused.

  Args:
    info: the cluster, as resolved from TF_CONFIG, SLURM or arguments.
    environ: the job's environment (``SLURM_NODE_ALIASES``); `os.environ`
      by default.

  Returns:
    ``info`` itself when every host resolves, else a copy whose addresses
    name the nodes' ``NodeAddr``.

  Raises:
    ConfigError: a host that does not resolve and has no ``NodeAddr``,
      naming its task, the lookup's error and where the cluster came from.
  """
  environ = os.environ if environ is None else environ
  places = {}  # host -> the first task naming it.
  for job in sorted(info.cluster):
    for index, address in enumerate(info.cluster[job]):
      places.setdefault(_net.split_address(address)[0], f"cluster.{job}[{index}]")
  unresolved = [h for h in places if _net.lookup(h)[1]]
  hosts = {h: h for h in places}
  if unresolved and info.slurm is not None:
    # Every node by its NodeAddr, so that every task (each of which may
    # resolve only its own name) writes the same cluster.
    aliases = _node_aliases(environ.get("SLURM_NODE_ALIASES", ""))
    if any(host not in aliases for host in places):
      aliases = {**_scontrol_node_addrs(environ), **aliases}
    for host in places:
      node_addr = aliases.get(host)
      if node_addr:
        resolve_host(node_addr, field=f"NodeAddr of node {host}",
                     source="SLURM (SLURM_NODE_ALIASES or scontrol)")
        hosts[host] = node_addr
    unresolved = [h for h in unresolved if hosts[h] == h]
  for host in unresolved:
    resolve_host(host, field=places[host], source=info.origin)  # Raises.
  if all(k == v for k, v in hosts.items()):
    return info

  def moved(address: str) -> str:
    host, port = _net.split_address(address)
    new = hosts.get(host, host)
    return f"[{new}]:{port}" if ":" in new else f"{new}:{port}"
  cluster = {job: tuple(moved(a) for a in addresses)
             for job, addresses in info.cluster.items()}
  return dataclasses.replace(info, cluster=cluster)


def _node_aliases(text: str) -> dict[str, str]:
  """``SLURM_NODE_ALIASES`` (``name:addr:hostname,...``; an IPv6 address in
  brackets) as name -> address."""
  aliases = {}
  for item in filter(None, text.split(",")):
    match = re.fullmatch(r"([^:]+):(\[[^\]]+\]|[^:]+):.*", item.strip())
    if match:
      aliases[match.group(1)] = match.group(2).strip("[]")
  return aliases


def _scontrol_node_addrs(environ: Mapping[str, str]) -> dict[str, str]:
  """Node name -> ``NodeAddr`` of every node, from one ``scontrol show node``
  call (bounded by `SCONTROL_TIMEOUT_SECONDS`); empty without scontrol, a
  controller or an answer in time."""
  scontrol = shutil.which("scontrol", path=environ.get("PATH", os.defpath)
                          + os.pathsep + "/usr/sbin:/usr/bin")
  if scontrol is None:
    return {}
  try:
    out = subprocess.run([scontrol, "show", "node", "-o"],
                         env=dict(environ), capture_output=True, text=True,
                         timeout=SCONTROL_TIMEOUT_SECONDS, check=False)
  except (OSError, subprocess.TimeoutExpired):
    return {}
  if out.returncode != 0:
    return {}
  nodes = {}
  for line in out.stdout.splitlines():
    name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
    addr = re.search(r"(?:^|\s)NodeAddr=(\S+)", line)
    if name and addr:
      nodes[name.group(1)] = addr.group(1)
  return nodes
