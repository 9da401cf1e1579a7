"""The cluster of an ``srun`` step, from the variables SLURM sets for each task.

TensorFlow's own ``SlurmClusterResolver`` crashes on CPU-only jobs, sorts host
names as strings (so with ``n[9-10]`` rank 0 is given n10's address), rejects
hostlists with several bracket groups and overwrites ``CUDA_VISIBLE_DEVICES``.
`resolve_slurm` does none of that: it reads the environment, writes nothing,
and gives every ``SLURM_PROCID`` the address of the node SLURM placed it on.

What SLURM 22.05 sets (checked on a real slurmctld/slurmd):

* In every task of an ``srun`` step: ``SLURM_JOB_ID``, ``SLURM_STEP_ID`` (and
  the older ``SLURM_JOBID``, ``SLURM_STEPID``), ``SLURM_PROCID`` (global rank),
  ``SLURM_LOCALID`` (rank on the node), ``SLURMD_NODENAME``,
  ``SLURM_STEP_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE``,
  ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NUM_NODES``. srun sets
  ``SLURM_NTASKS`` and ``SLURM_TASKS_PER_NODE`` to the step's values, but
  ``SLURM_NODELIST`` stays the job's: a 2-node step of a 3-node sbatch job
  sees ``SLURM_NODELIST=n[9-11]`` and ``SLURM_STEP_NODELIST=n[9-10]``. So the
  ``SLURM_STEP_*`` variables come first and the others are only fallbacks,
  checked against each other. ``SLURM_DISTRIBUTION`` is set when the step
  runs inside an allocation (``block``, or ``cyclic`` when there are no more
  tasks than nodes) or when ``-m`` was given (``plane`` adds
  ``SLURM_DIST_PLANESIZE``); a bare ``srun`` outside any allocation leaves it
  unset, which means block.
* In the batch script of an ``sbatch`` job: ``SLURM_JOB_ID``,
  ``SLURM_PROCID=0``, ``SLURM_LOCALID=0``, ``SLURMD_NODENAME``,
  ``SLURM_NODELIST``, ``SLURM_NTASKS``, ``SLURM_TASKS_PER_NODE`` — but no
  ``SLURM_STEP_ID`` and no ``SLURM_STEP_*``. The script is one process, not
  the job's tasks, even though ``SLURM_PROCID`` is set.
* In an ``salloc`` shell (on the submitting host): ``SLURM_JOB_ID``,
  ``SLURM_NODELIST``, ``SLURM_NTASKS``, ``SLURM_TASKS_PER_NODE``; no
  ``SLURM_PROCID``, no ``SLURM_STEP_ID``, no ``SLURMD_NODENAME``.

So `is_slurm_step` asks for a job id, a step id and ``SLURM_PROCID`` together;
`in_slurm_job` asks only for a job id.

Ports: task ``r`` listens on ``base + L`` where ``L`` is its index among the
step's tasks on its node (its ``SLURM_LOCALID``) and, unless ``port_base=`` or
``TFDIST_PORT_BASE`` says otherwise,
``base = 10000 + (SLURM_JOB_ID % 1423) * 16``. Each job id owns a slot of 16
ports in 10000-32767, below Linux's ephemeral range (32768-60999), so jobs
whose ids differ modulo 1423 never collide on a shared node. A step with more
than 16 tasks on one node spills into the next job id's slot; set
``TFDIST_PORT_BASE`` for such jobs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tfdist import _net
from tfdist.cluster import names
from tfdist.cluster import requeue
from tfdist.cluster.hostlist import expand_hostlist, expand_tasks_per_node
from tfdist.cluster.info import JOB_NAMES, ClusterInfo, SlurmInfo
from tfdist.errors import ConfigError

__all__ = [
    "ROLES_VARIABLE",
    "parse_roles",
    "is_slurm_step",
    "in_slurm_job",
    "resolve_slurm",
    "default_port_base",
    "PORT_RANGE_START",
    "PORTS_PER_JOB",
    "launch_fields",
]

#: Environment variables, e.g. ``os.environ`` or a test's dict.
Environ = Mapping[str, str]
#: Job name to number of tasks, in rank order, e.g. ``{"chief": 1, ...}``.
Roles = Mapping[str, int]

#: The variable that assigns roles when ``roles=`` is not given.
ROLES_VARIABLE = "TFDIST_SLURM_ROLES"
#: First port of the derived range.
PORT_RANGE_START = 10000
#: Ports reserved for one job id on one node.
PORTS_PER_JOB = 16
#: Jobs TensorFlow allows one task of.
_AT_MOST_ONE = ("chief", "evaluator")
_PORT_SLOTS = (32768 - PORT_RANGE_START) // PORTS_PER_JOB  # 1423.

_JOB_ID_VARS = ("SLURM_JOB_ID", "SLURM_JOBID")
_STEP_ID_VARS = ("SLURM_STEP_ID", "SLURM_STEPID")
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST",
                  "SLURM_JOB_NODELIST")
_TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_NUM_TASKS_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
_NUM_NODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES")
_SRUN_HINT = (
    "Launch the training script with srun, one process per task, e.g. "
    "`srun -N 2 --ntasks-per-node=1 python train.py` (inside an sbatch script "
    "too: the batch script itself is not a step)")


def _is_decimal(text: object) -> bool:
  """ASCII digits, short enough for int() (Python limits long ones)."""
  return (isinstance(text, str) and text.isascii() and text.isdigit()
          and len(text) <= 18)


def _first(environ: Environ, names: tuple[str, ...]) -> str | None:
  """The first of ``names`` present in ``environ``."""
  return next((name for name in names if name in environ), None)


def in_slurm_job(environ: Environ | None = None) -> bool:
  """Whether this process belongs to a SLURM job (batch, salloc or step).

  Args:
    environ: the variables to inspect; ``os.environ`` by default.
  """
  return _first(os.environ if environ is None else environ,
                _JOB_ID_VARS) is not None


def is_slurm_step(environ: Environ | None = None) -> bool:
  """Whether this process is a task of an ``srun`` step.

  True when a job id (``SLURM_JOB_ID``/``SLURM_JOBID``), a step id
  (``SLURM_STEP_ID``/``SLURM_STEPID``) and ``SLURM_PROCID`` are all set. An
  sbatch batch script has no step id and an salloc shell has neither a step id
  nor ``SLURM_PROCID``, so both are False.

  Args:
    environ: the variables to inspect; ``os.environ`` by default.
  """
  env = os.environ if environ is None else environ
  return (_first(env, _JOB_ID_VARS) is not None
          and _first(env, _STEP_ID_VARS) is not None
          and "SLURM_PROCID" in env)


def parse_roles(text: str, *, field: str = "roles",
                source: str = "roles") -> dict[str, int]:
  """Parses ``"chief=1,ps=1,worker=2"`` into job sizes, in rank order.

  Raises:
    ConfigError: malformed, an unknown or repeated job name, a negative
      count, more than one chief or evaluator, or no tasks at all.
  """
  expected = (f"comma-separated JOB=COUNT with JOB among {sorted(JOB_NAMES)}, "
              "e.g. 'chief=1,ps=1,worker=2'")
  roles: dict[str, int] = {}
  for part in (text.split(",") if isinstance(text, str) else [None]):
    name, sep, count = (part or "").partition("=")
    name, count = name.strip(), count.strip()
    if (not sep or name not in JOB_NAMES or name in roles
        or not _is_decimal(count)):
      raise ConfigError(field=field, value=text, source=source,
                        expected=expected)
    roles[name] = int(count)
  for name in _AT_MOST_ONE:
    if roles.get(name, 0) > 1:
      raise ConfigError(field=field, value=text, source=source,
                        expected=f"at most one {name}")
  if not sum(roles.values()):
    raise ConfigError(field=field, value=text, source=source,
                      expected="at least one task")
  return roles


def default_port_base(job_id: int) -> int:
  """The first port of job ``job_id``'s slot: ``10000 + (id % 1423) * 16``."""
  return PORT_RANGE_START + (job_id % _PORT_SLOTS) * PORTS_PER_JOB


def resolve_slurm(environ: Environ | None = None, *,
                  roles: Roles | None = None,
                  port_base: int | None = None) -> ClusterInfo:
  """Resolves the cluster of the current ``srun`` step.

  Ranks keep SLURM's order: task ``SLURM_PROCID == r`` gets the address of
  the node SLURM placed rank ``r`` on, for block and cyclic distributions.
  Nothing is written to ``os.environ``.

  Args:
    environ: the variables to read; ``os.environ`` by default.
    roles: job names and sizes assigned in rank order, e.g. ``{"chief": 1,
      "ps": 1, "worker": 2}`` makes rank 0 the chief, rank 1 the ps and
      ranks 2-3 workers 0-1. The sizes must add up to the number of tasks.
      Default: ``TFDIST_SLURM_ROLES`` (``"chief=1,ps=1,worker=2"``) if set,
      else every task is a ``worker``.
    port_base: the port of each node's first task; overrides
      ``TFDIST_PORT_BASE`` and the job-id-derived default.

  Returns:
    A `ClusterInfo` with ``source="slurm"`` and ``slurm`` filled in.
    ``accelerators`` counts the GPUs this task sees (``{}`` on CPU-only jobs).

  Raises:
    ConfigError: not inside an srun step, a SLURM variable is malformed or
      inconsistent, the distribution is neither block nor cyclic, or
      ``roles`` / ``port_base`` is invalid.

  Example:
    >>> info = resolve_slurm({
    ...     "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
    ...     "SLURM_STEP_NODELIST": "n[9-10]",
    ...     "SLURM_STEP_TASKS_PER_NODE": "1(x2)"})
    >>> info.cluster["worker"]
    ('n9:10672', 'n10:10672')
  """
  from_os = environ is None or environ is os.environ
  env: Environ = os.environ if from_os else environ
  source = ("SLURM variables from the environment" if from_os
            else "SLURM variables passed as environ")
  _check_step(env, source)

  job_var = _first(env, _JOB_ID_VARS)
  job_id = _read_int(env, job_var, source)
  step_var = _first(env, _STEP_ID_VARS)
  _read_int(env, step_var, source)
  proc_id = _read_int(env, "SLURM_PROCID", source)

  nodes_var = _required(env, _NODELIST_VARS, source)
  nodes = expand_hostlist(env[nodes_var], source=source, field=nodes_var)
  if len(set(nodes)) != len(nodes):
    raise ConfigError(field=nodes_var, value=env[nodes_var],
                      expected="each node once, as in a step's node list",
                      source=source)
  counts_var = _required(env, _TASKS_PER_NODE_VARS, source)
  counts = expand_tasks_per_node(env[counts_var], source=source,
                                 field=counts_var)
  if len(counts) != len(nodes) or min(counts) < 1:
    raise ConfigError(
        field=counts_var, value=env[counts_var], source=source,
        expected=(f"a task count of at least 1 for each of the {len(nodes)} "
                  f"nodes of {nodes_var}={env[nodes_var]!r}"))
  num_tasks = sum(counts)
  _check_total(env, _NUM_NODES_VARS, len(nodes),
               f"the number of nodes in {nodes_var}", source)
  _check_total(env, _NUM_TASKS_VARS, num_tasks,
               f"the sum of {counts_var}={env[counts_var]!r}", source)
  if proc_id >= num_tasks:
    raise ConfigError(field="SLURM_PROCID", value=env["SLURM_PROCID"],
                      expected=f"a rank below {num_tasks}, the step's tasks",
                      source=source)

  distribution = _distribution(env, source)
  placement = _place(counts, distribution)  # rank -> (node index, local id)
  node_index, local_id = placement[proc_id]
  _check_own_place(env, nodes[node_index], local_id, proc_id, distribution,
                   source)

  base, base_field = _port_base(env, port_base, job_id, source)
  if base + max(counts) - 1 > 65535:
    raise ConfigError(
        field=base_field, value=base, source=source,
        expected=f"a port base that leaves room for {max(counts)} ports per "
                 "node below 65536")
  addresses = [f"{nodes[n]}:{base + local}" for n, local in placement]
  if roles is None and env.get(ROLES_VARIABLE):
    roles = parse_roles(env[ROLES_VARIABLE], field=ROLES_VARIABLE,
                        source="the environment")
  cluster, task_type, task_id = _assign_roles(addresses, roles, proc_id,
                                              source)
  return ClusterInfo(
      source="slurm",
      cluster=cluster,
      task_type=task_type,
      task_id=task_id,
      accelerators=_accelerators(env, source),
      origin=source,
      slurm=SlurmInfo(
          job_id=env[job_var], step_id=env[step_var], node=nodes[node_index],
          local_id=local_id, proc_id=proc_id, num_tasks=num_tasks,
          nodes=tuple(nodes), tasks_per_node=tuple(counts),
          array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
          array_task_id=env.get("SLURM_ARRAY_TASK_ID")))


def launch_fields(environ: Environ | None = None, *, tasks: int,
                  min_nodes: int | None = None) -> tuple[dict, str, str]:
  """What ``tfdist launch`` takes from its ``srun`` step, one launcher a
  node: `LaunchSpec` fields (node 0 the step's first node, at its
  ``NodeAddr`` when its name does not resolve, on the first port of the
  job's slot; ``min_nodes`` at most the step's size; with
  ``TFDIST_SLURM_ROLES``, this node's ``tasks`` of them in rank order), one
  line saying where each came from, and the job id.

  Raises:
    ConfigError: not a step of one task per node (``--ntasks-per-node``),
      or what `resolve_slurm` refuses.
  """
  env = os.environ if environ is None else environ
  info = resolve_slurm({k: v for k, v in env.items() if k != ROLES_VARIABLE})
  step = info.slurm
  if max(step.tasks_per_node) > 1:
    raise ConfigError(
        field="--ntasks-per-node", value=max(step.tasks_per_node),
        source="the SLURM step of tfdist launch",
        expected="1: one tfdist launch per node, which starts the node's "
                 "tasks itself",
        hint="Run `srun --ntasks-per-node=1 tfdist launch --workers K ...`")
  first = info.cluster["worker"][0]
  master, port = _net.split_address(
      names.resolve_names(info, environ=env).cluster["worker"][0])
  job = requeue.job_to_requeue(env)  # The array element's id, else the job's.
  nodes = len(step.nodes)
  where = "" if first.startswith(f"{master}:") else ", its NodeAddr"
  line = (f"from SLURM job {job}: --nnodes {nodes} (the step's nodes), "
          f"--node-rank {step.proc_id} ({step.node}'s place among them), "
          f"--master-addr {master} (the first, {step.nodes[0]}{where}), "
          f"--master-port {port} (the job's port slot)")
  fields = {"nnodes": nodes, "min_nodes": min(min_nodes or nodes, nodes),
            "node_rank": step.proc_id, "master_addr": master,
            "master_port": port}
  if env.get(ROLES_VARIABLE):
    roles = parse_roles(env[ROLES_VARIABLE], field=ROLES_VARIABLE,
                        source="the environment")
    ranks = [job for job, n in roles.items() for _ in range(n)]
    mine = ranks[step.proc_id * tasks:(step.proc_id + 1) * tasks]
    fields.update(chief="chief" in mine, num_ps=mine.count("ps"),
                  num_workers=mine.count("worker"),
                  evaluator="evaluator" in mine)
    line += f", its tasks {','.join(mine)} ({ROLES_VARIABLE})"
  return fields, line, job


def _check_step(env: Environ, source: str) -> None:
  """Raises a ConfigError naming the first missing step variable."""
  if _first(env, _JOB_ID_VARS) is None:
    raise ConfigError(
        field="SLURM_JOB_ID", source=source,
        expected="the variables srun sets for each task (SLURM_JOB_ID, "
                 "SLURM_STEP_ID, SLURM_PROCID, SLURM_STEP_NODELIST, ...)",
        hint=f"This process is not part of a SLURM job. {_SRUN_HINT}")
  if _first(env, _STEP_ID_VARS) is None:
    raise ConfigError(
        field="SLURM_STEP_ID", source=source,
        expected="the step id srun sets for each task",
        hint=("SLURM_JOB_ID is set but SLURM_STEP_ID is not: this is an "
              "sbatch batch script or an salloc shell, one process rather "
              f"than the job's tasks. {_SRUN_HINT}"))
  if "SLURM_PROCID" not in env:
    raise ConfigError(field="SLURM_PROCID", source=source,
                      expected="the task's rank, which srun sets",
                      hint=_SRUN_HINT)


def _required(env: Environ, names: tuple[str, ...], source: str) -> str:
  name = _first(env, names)
  if name is None:
    raise ConfigError(field=names[0], source=source,
                      expected=f"one of {', '.join(names)}, which srun sets",
                      hint=_SRUN_HINT)
  return name


def _read_int(env: Environ, name: str, source: str) -> int:
  raw = env[name]
  if not _is_decimal(raw):
    raise ConfigError(field=name, value=raw, source=source,
                      expected="a non-negative integer")
  return int(raw)


def _check_total(env: Environ, names: tuple[str, ...], want: int,
                 what: str, source: str) -> None:
  """Checks the first present of ``names`` equals ``want``."""
  name = _first(env, names)
  if name is not None and _read_int(env, name, source) != want:
    raise ConfigError(field=name, value=env[name], source=source,
                      expected=f"{want}, {what}")


def _distribution(env: Environ, source: str) -> str:
  """The node-level distribution: ``block`` or ``cyclic``.

  ``SLURM_DISTRIBUTION`` is ``NODE[:SOCKET[:CORE]][,Pack|NoPack]``; only the
  node level decides which node a rank lands on.
  """
  raw = env.get("SLURM_DISTRIBUTION")
  if raw is None:
    return "block"  # SLURM's default; srun leaves it unset outside sbatch.
  level = raw.split(",")[0].split(":")[0].strip().lower()
  if level in ("block", "*", ""):
    return "block"
  if level == "cyclic":
    return "cyclic"
  raise ConfigError(
      field="SLURM_DISTRIBUTION", value=raw, source=source,
      expected="block or cyclic at the node level (e.g. 'block', "
               "'cyclic:block', 'block,pack')",
      hint=("plane and arbitrary distributions do not say from the "
            "environment which node each rank runs on; use srun -m block "
            "or -m cyclic"))


def _place(counts: list[int], distribution: str) -> list[tuple[int, int]]:
  """(node index, local id) for every rank, as SLURM lays tasks out.

  Block gives each node a run of consecutive ranks. Cyclic deals ranks out
  one per node per round, skipping nodes whose tasks are all placed; given
  the final per-node counts this reproduces SLURM's ``_task_layout_cyclic``.
  """
  if distribution == "block":
    return [(n, local) for n, count in enumerate(counts)
            for local in range(count)]
  return [(n, local) for local in range(max(counts))
          for n, count in enumerate(counts) if local < count]


def _check_own_place(env: Environ, node: str, local_id: int, proc_id: int,
                     distribution: str, source: str) -> None:
  """Cross-checks the computed place with SLURMD_NODENAME and SLURM_LOCALID."""
  where = f"where {distribution} distribution puts SLURM_PROCID={proc_id}"
  if "SLURMD_NODENAME" in env and env["SLURMD_NODENAME"] != node:
    raise ConfigError(field="SLURMD_NODENAME", value=env["SLURMD_NODENAME"],
                      expected=f"{node!r}, {where}", source=source)
  if ("SLURM_LOCALID" in env
      and _read_int(env, "SLURM_LOCALID", source) != local_id):
    raise ConfigError(field="SLURM_LOCALID", value=env["SLURM_LOCALID"],
                      expected=f"{local_id}, the local rank {where}",
                      source=source)


def _port_base(env: Environ, port_base: int | None, job_id: int,
               source: str) -> tuple[int, str]:
  """The port base and the name of what set it."""
  expected = "an integer port between 1 and 65535"
  if port_base is not None:
    if isinstance(port_base, bool) or not isinstance(port_base, int) or not (
        1 <= port_base <= 65535):
      raise ConfigError(field="port_base", value=port_base,
                        expected=expected, source="the port_base argument")
    return port_base, "port_base"
  raw = env.get("TFDIST_PORT_BASE")
  if raw is None:
    return default_port_base(job_id), "SLURM_JOB_ID"
  if not (_is_decimal(raw) and 1 <= int(raw) <= 65535):
    raise ConfigError(field="TFDIST_PORT_BASE", value=raw, expected=expected,
                      source=source)
  return int(raw), "TFDIST_PORT_BASE"


def _assign_roles(addresses: list[str], roles: Roles | None, proc_id: int,
                  source: str):
  """Splits addresses into jobs in rank order; returns (cluster, type, id)."""
  if roles is None:
    roles = {"worker": len(addresses)}
  where = "the roles argument"
  if not isinstance(roles, Mapping):
    raise ConfigError(field="roles", value=roles, source=where,
                      expected="a mapping of job name to task count")
  for name, count in roles.items():
    if name not in JOB_NAMES:
      raise ConfigError(field="roles", value=dict(roles), source=where,
                        expected=f"job names among {sorted(JOB_NAMES)}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
      raise ConfigError(field=f"roles[{name!r}]", value=count, source=where,
                        expected="a non-negative integer task count")
  for name in _AT_MOST_ONE:
    if roles.get(name, 0) > 1:
      raise ConfigError(field=f"roles[{name!r}]", value=roles[name],
                        source=where, expected=f"at most 1 {name}")
  if sum(roles.values()) != len(addresses):
    raise ConfigError(
        field="roles", value=dict(roles), source=f"{where} and {source}",
        expected=f"task counts adding up to {len(addresses)}, the number of "
                 "tasks in the step")
  cluster, start = {}, 0
  task_type = task_id = None
  for name, count in roles.items():
    if count == 0:
      continue
    cluster[name] = tuple(addresses[start:start + count])
    if start <= proc_id < start + count:
      task_type, task_id = name, proc_id - start
    start += count
  return cluster, task_type, task_id


def _accelerators(env: Environ, source: str) -> dict[str, int]:
  """GPUs this task sees; never modifies CUDA_VISIBLE_DEVICES.

  ``CUDA_VISIBLE_DEVICES`` decides when set (CUDA stops at the first invalid
  entry, so ``-1`` or ``NoDevFiles`` mean none). Otherwise SLURM's GPU
  variables: ``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS`` (index lists), then
  ``SLURM_GPUS_ON_NODE`` (a count).
  """
  visible = env.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    count = 0
    for entry in visible.split(","):
      entry = entry.strip()
      if not (entry.isascii() and entry.isdigit()
              or entry.startswith(("GPU-", "MIG-"))):
        break
      count += 1
    return {"GPU": count} if count else {}
  for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
    if name in env:
      entries = [e for e in env[name].split(",") if e.strip()]
      if not all(e.strip().isascii() and e.strip().isdigit()
                 for e in entries):
        raise ConfigError(field=name, value=env[name], source=source,
                          expected="a comma list of GPU indices, e.g. '0,1'")
      return {"GPU": len(entries)} if entries else {}
  if "SLURM_GPUS_ON_NODE" in env:
    count = _read_int(env, "SLURM_GPUS_ON_NODE", source)
    return {"GPU": count} if count else {}
  return {}
