"""sbatch scripts for tfdist training, from a frozen `SbatchSpec`.

`render` turns a spec into a commented bash script; ``tfdist slurm`` is its
command line, and the four files in ``cluster_configs/`` are exactly what
`render` gives for the four `PRESETS` (a test keeps them in sync).

Every script:

* runs one ``tfdist launch`` per node (``srun --ntasks-per-node=1``): its
  members are the step's nodes (`tfdist.launch.members`), it starts the
  node's ``tasks_per_node`` tasks, each with its TF_CONFIG, and gives the
  job what a ``tfdist launch`` job has: nodes that must match, the stall
  report, ``TFDIST_*`` run facts, every node stopped when a task fails;
  with ``--nodes MIN-MAX`` (and ``--no-kill``) a lost node's peers go on at
  the smaller size;
* asks SLURM for ``--signal=B:USR1@N``: USR1 goes to the batch shell N
  seconds before the time limit, and its trap forwards it to ``srun``, which
  forwards it to every launcher and so every task, so the tasks can
  checkpoint and exit with
  `tfdist.errors.PREEMPTED_EXIT_CODE` (42); when ``srun`` exits with that
  code the shell requeues the job once (``--requeue``; an array element by
  ``ARRAYID_TASKID``, since one element's ``SLURM_JOB_ID`` is the array's id,
  which names every element) and it resumes from the checkpoint. Tasks that
  finished or failed are not run again. Without ``B:`` SLURM would signal the
  tasks itself, but nothing would requeue;
* or, with ``requeue_from="task"`` (``tfdist slurm --requeue-from task``),
  asks for ``--signal=USR1@N``: SLURM sends USR1 to every task itself, and
  after the tasks saved the chief task requeues the job
  (`tfdist.cluster.requeue`, turned on by the ``TFDIST_SLURM_REQUEUE=1`` the
  script exports); the shell only waits for srun and exits with its code;
* runs ``srun --kill-on-bad-exit=0``: a node that saved exits 42, a bad
  exit to SLURM, and with ``=1`` srun would kill the nodes still saving;
* appends to one output file per job (``--open-mode=append``, ``%x-%j.out``),
  so the runs of a requeued job follow each other;
* reads ``TFDIST_COMMAND``, when set, instead of the rendered command, split
  on whitespace: tests and quick experiments run another program without
  editing the file;
* exports a fresh random ``TFDIST_JOB_SECRET`` (from ``/dev/urandom``, never
  on a command line) once per run of the job, unless the submitting
  environment sets one: ``srun`` passes it to every task, and the socket
  all-reduce ring admits only tasks that know it.

Parameter-server roles are exported as ``TFDIST_SLURM_ROLES``: each node's
launcher starts its tasks' share of them in rank order
(`tfdist.cluster.slurm.launch_fields`).

Example:
  >>> spec = SbatchSpec(job_name="mwms", nodes=2, gpus_per_node=4,
  ...                   command=("python", "train.py"))
  >>> print(render(spec))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
from typing import Mapping

from tfdist import _net
from tfdist.cluster import requeue as requeue_lib
from tfdist.cluster.slurm import parse_roles
from tfdist.errors import ConfigError
from tfdist.errors import PREEMPTED_EXIT_CODE

__all__ = [
    "SbatchSpec",
    "PRESETS",
    "render",
    "parse_time",
    "template_name",
    "srun_problem",
    "fits_problem",
    "REQUEUE_FROM",
]

_SOURCE = "SbatchSpec"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_TIME = re.compile(
    r"^(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
    r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$")
_MAX_SIGNAL_SECONDS = 65535  # SLURM keeps the signal time in 16 bits.
# SLURM keeps node and task counts in 32 bits and per-node or per-task counts
# in 16, the top values meaning "not set" or "unlimited".
_MAX_COUNT = 2**32 - 3
_MAX_PER_NODE = 2**16 - 3
_MAX_MINUTES = 2**32 - 3  # The time limit, in minutes.
#: What the script says when srun exits 42 and the job is not requeued.
_PREEMPTED = ("the tasks were preempted and saved; submit the same script "
              "again to resume")
#: Who runs ``scontrol requeue`` after the tasks saved (``requeue_from``).
REQUEUE_FROM = ("script", "task")


def parse_time(text: str, *, field: str = "time",
               source: str = _SOURCE) -> int:
  """Seconds in a SLURM time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``...).

  Raises:
    ConfigError: not one of SLURM's time formats, or zero.
  """
  match = _TIME.match(text) if isinstance(text, str) else None
  if match is None:
    raise ConfigError(
        field=field, value=text, source=source,
        expected="a SLURM time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                 "D-HH:MM:SS, e.g. '04:00:00'")
  g = {k: int(v) if v else 0 for k, v in match.groupdict().items()}
  if match.group("days") is not None:
    seconds = ((g["days"] * 24 + g["dh"]) * 60 + g["dm"]) * 60 + g["ds"]
  elif match.group("c") is not None:  # HH:MM:SS.
    seconds = (g["a"] * 60 + g["b"]) * 60 + g["c"]
  else:  # MM or MM:SS.
    seconds = g["a"] * 60 + g["b"]
  if not 0 < seconds <= _MAX_MINUTES * 60:
    raise ConfigError(field=field, value=text, source=source,
                      expected=f"a time limit above zero and at most "
                               f"{_MAX_MINUTES} minutes")
  return seconds


@dataclasses.dataclass(frozen=True, kw_only=True)
class SbatchSpec:
  """What one sbatch script asks SLURM for and runs.

  Attributes:
    job_name: ``--job-name``; also names the output file ``NAME-JOBID.out``.
    nodes: ``--nodes``: a count, or ``"MIN-MAX"`` (SLURM's spelling) for
      whatever SLURM grants in that range, first and after each requeue, and
      ``--no-kill``: a lost node's peers go on at the smaller size, and a
      requeued job resumes from its backup at the size granted.
    tasks_per_node: ``--ntasks-per-node``: one per node for
      MultiWorkerMirrored (each task uses all of its node's GPUs).
    gpus_per_node: ``--gpus-per-node``; 0 asks for no GPUs (no line).
    cpus_per_task: ``--cpus-per-task``.
    time: ``--time``, in a SLURM format such as ``"04:00:00"``.
    partition: ``--partition``; the cluster's default when ``None``.
    roles: parameter-server roles in rank order, e.g.
      ``"chief=1,ps=1,worker=2"``, adding up to ``nodes * tasks_per_node``;
      exported as ``TFDIST_SLURM_ROLES``. ``None``: every task is a worker.
    signal_seconds: USR1 reaches the tasks this many seconds before the time
      limit, so they can checkpoint.
    requeue: requeue the job after the tasks handled USR1 (``--requeue``);
      ``False`` writes ``--no-requeue`` and only forwards the signal.
    command: the program each task runs, e.g. ``("python", "train.py")``.
    description: comment lines at the top of the script.
    sbatch_options: more ``#SBATCH`` lines, each one option such as
      ``"--account=abc"``, written after tfdist's own (so they win).
    setup: shell lines run before ``srun``, in order, e.g.
      ``("module load cuda", "source ~/venv/bin/activate")``.
    max_requeues: requeue at most this many times (``SLURM_RESTART_COUNT``
      counts them); then a preempted run ends with exit code 42 instead.
      ``None``: no cap.
    requeue_from: who requeues after the tasks saved and exited 42:
      ``"script"``, the batch shell (``--signal=B:USR1@N``, forwarded to the
      tasks), or ``"task"``, the chief task itself (``--signal=USR1@N`` to
      the tasks; the script exports ``TFDIST_SLURM_REQUEUE=1`` and the cap
      as ``TFDIST_SLURM_MAX_REQUEUES``). ``"task"`` needs ``requeue``.
  """
  job_name: str = "tfdist"
  nodes: int | str = 1
  tasks_per_node: int = 1
  gpus_per_node: int = 0
  cpus_per_task: int = 1
  time: str = "01:00:00"
  partition: str | None = None
  roles: str | None = None
  signal_seconds: int = 300
  requeue: bool = True
  command: tuple[str, ...] = ("python", "train.py")
  description: str = ""
  sbatch_options: tuple[str, ...] = ()
  setup: tuple[str, ...] = ()
  max_requeues: int | None = None
  requeue_from: str = "script"

  def __post_init__(self):
    for field in ("job_name", "partition"):
      value = getattr(self, field)
      if value is not None and not (isinstance(value, str)
                                    and _NAME.fullmatch(value)):
        raise ConfigError(
            field=field, value=value, source=_SOURCE,
            expected="a name of letters, digits and _.+- (no spaces)")
    object.__setattr__(self, "nodes", _nodes(self.nodes))
    _count("tasks_per_node", self.tasks_per_node, 1, _MAX_PER_NODE)
    _count("gpus_per_node", self.gpus_per_node, 0, _MAX_PER_NODE)
    _count("cpus_per_task", self.cpus_per_task, 1, _MAX_PER_NODE)
    if self.num_tasks > _MAX_COUNT:
      raise ConfigError(
          field="tasks_per_node", value=self.tasks_per_node, source=_SOURCE,
          expected=(f"nodes * tasks_per_node at most {_MAX_COUNT}, not "
                    f"{self.max_nodes} * {self.tasks_per_node}"))
    limit = parse_time(self.time)
    _count("signal_seconds", self.signal_seconds, 1, _MAX_SIGNAL_SECONDS)
    if self.signal_seconds >= min(limit, _MAX_SIGNAL_SECONDS + 1):
      raise ConfigError(
          field="signal_seconds", value=self.signal_seconds, source=_SOURCE,
          expected=(f"fewer seconds than the time limit {self.time!r} "
                    f"({limit} s) and at most {_MAX_SIGNAL_SECONDS}"))
    if not isinstance(self.requeue, bool):
      raise ConfigError(field="requeue", value=self.requeue, source=_SOURCE,
                        expected="True or False")
    command = self.command
    if isinstance(command, str) or not command or not all(
        isinstance(word, str) and word and "\0" not in word
        for word in command):
      raise ConfigError(field="command", value=command, source=_SOURCE,
                        expected="a non-empty list of words without NUL "
                                 "bytes, e.g. ['python', 'train.py']")
    object.__setattr__(self, "command", tuple(command))
    object.__setattr__(self, "sbatch_options", _lines(
        "sbatch_options", self.sbatch_options,
        "sbatch options such as '--account=abc', one per line", dash=True))
    object.__setattr__(self, "setup", _lines(
        "setup", self.setup, "shell lines such as 'module load cuda'"))
    if self.max_requeues is not None:
      _count("max_requeues", self.max_requeues, 0, _MAX_PER_NODE)
    if self.requeue_from not in REQUEUE_FROM:
      raise ConfigError(
          field="requeue_from", value=self.requeue_from, source=_SOURCE,
          expected="'script' (the batch shell requeues) or 'task' (the chief "
                   "task requeues)")
    if self.requeue_from == "task" and not self.requeue:
      raise ConfigError(
          field="requeue_from", value=self.requeue_from, source=_SOURCE,
          expected="'script' with requeue=False (--no-requeue): there is "
                   "nothing for the task to requeue")
    if not isinstance(self.description, str) or "\0" in self.description:
      raise ConfigError(field="description", value=self.description,
                        source=_SOURCE, expected="a string")
    if self.roles is not None:
      if isinstance(self.nodes, str):
        raise ConfigError(
            field="nodes", value=self.nodes, source=_SOURCE,
            expected="one node count with roles, which name every task",
            hint="Give --nodes N, or leave out --roles (every task a worker)")
      tasks = self.nodes * self.tasks_per_node
      roles = parse_roles(self.roles)
      if sum(roles.values()) != tasks:
        raise ConfigError(
            field="roles", value=self.roles, source=_SOURCE,
            expected=(f"task counts adding up to {tasks}, nodes * "
                      f"tasks_per_node = {self.nodes} * {self.tasks_per_node}"))
      object.__setattr__(self, "roles",
                         ",".join(f"{k}={v}" for k, v in roles.items()))

  @property
  def max_nodes(self) -> int:
    """The most nodes SLURM may grant."""
    return int(str(self.nodes).rpartition("-")[2])

  @property
  def num_tasks(self) -> int:
    """The most tasks in the srun step: ``max_nodes * tasks_per_node``."""
    return self.max_nodes * self.tasks_per_node


def _nodes(value: object) -> int | str:
  """``value`` as SLURM writes it: a count, or ``"MIN-MAX"`` when MIN < MAX."""
  match = (re.fullmatch(r"(\d+)(?:-(\d+))?", value)
           if isinstance(value, str) else None)
  if match:
    low, high = int(match[1]), int(match[2] or match[1])
  elif isinstance(value, int) and not isinstance(value, bool):
    low = high = value
  else:
    low = high = 0
  if not 1 <= low <= high <= _MAX_COUNT:
    raise ConfigError(
        field="nodes", value=value, source=_SOURCE,
        expected=f"a node count from 1 to {_MAX_COUNT}, or a range MIN-MAX "
                 "with 1 <= MIN <= MAX, e.g. 2 or 1-4")
  return low if low == high else f"{low}-{high}"


def _lines(field: str, value: object, expected: str, *,
           dash: bool = False) -> tuple[str, ...]:
  """``value`` as a tuple of single lines, or a ConfigError naming ``field``."""
  if isinstance(value, str) or not isinstance(value, (tuple, list)):
    raise ConfigError(field=field, value=value, source=_SOURCE,
                      expected=f"a list of {expected}")
  for line in value:
    if (not isinstance(line, str) or not line.strip()
        or any(c in line for c in "\n\r\0")
        or (dash and not line.startswith("-"))):
      raise ConfigError(
          field=field, value=line, source=_SOURCE,
          expected=f"{expected}: one non-empty line"
                   + (" starting with '-'" if dash else ""))
  return tuple(value)


def _count(field: str, value: object, minimum: int, maximum: int) -> None:
  if (isinstance(value, bool) or not isinstance(value, int)
      or not minimum <= value <= maximum):
    raise ConfigError(field=field, value=value, source=_SOURCE,
                      expected=f"an integer from {minimum} to {maximum}")


#: The specs behind ``cluster_configs/<name>.sbatch``.
PRESETS: Mapping[str, SbatchSpec] = {
    "single_node_gpus": SbatchSpec(
        job_name="tfdist-single-node",
        nodes=1, tasks_per_node=1, gpus_per_node=4, cpus_per_task=16,
        time="04:00:00",
        command=("python", "train.py", "--strategy=mirrored"),
        description=(
            "One node, several GPUs: one task runs MirroredStrategy over all "
            "of the node's GPUs.\nChange --gpus-per-node to your node's GPU "
            "count; tfdist needs nothing else.")),
    "multi_worker_mirrored": SbatchSpec(
        job_name="tfdist-mwms",
        nodes=2, tasks_per_node=1, gpus_per_node=4, cpus_per_task=16,
        time="04:00:00",
        command=("python", "train.py", "--strategy=auto"),
        description=(
            "Several nodes, MultiWorkerMirroredStrategy: one task per node, "
            "each using all of its\nnode's GPUs. Each node's tfdist launch "
            "gives its task a TF_CONFIG, node r's task\nbeing worker r. Scale "
            "with --nodes.")),
    "parameter_server": SbatchSpec(
        job_name="tfdist-ps",
        nodes=2, tasks_per_node=2, gpus_per_node=0, cpus_per_task=8,
        time="04:00:00", roles="chief=1,ps=1,worker=2",
        command=("python", "train.py", "--strategy=auto"),
        description=(
            "Several nodes, ParameterServerStrategy. Ranks get roles in rank "
            "order from\nTFDIST_SLURM_ROLES (here rank 0 chief, rank 1 ps, "
            "ranks 2-3 workers 0-1): each node's\ntfdist launch starts its "
            "share. The "
            "chief trains; in ps and worker tasks\ntfdist.make_strategy serves "
            "the chief and ends the task when the chief is done.\nThe roles "
            "must add up to nodes * ntasks-per-node.")),
    "cpu_only": SbatchSpec(
        job_name="tfdist-cpu",
        nodes=2, tasks_per_node=1, gpus_per_node=0, cpus_per_task=4,
        time="02:00:00",
        command=("python", "train.py", "--strategy=multi_worker_mirrored"),
        description=(
            "CPU only: MultiWorkerMirroredStrategy over several nodes' CPUs, "
            "one task per node\nusing --cpus-per-task cores (raise it to "
            "your nodes' core count). Asks for no GPUs.")),
}


def template_name(preset: str) -> str:
  """The file in ``cluster_configs/`` that holds ``render(PRESETS[preset])``."""
  return f"{preset}.sbatch"


def render(spec: SbatchSpec) -> str:
  """The sbatch script for ``spec``, commented, ending with a newline.

  Args:
    spec: what to ask SLURM for and run.

  Returns:
    The script text; write it to a file and ``sbatch`` it.
  """
  # With a node range, --ntasks-per-node on sbatch would fix the tasks at
  # MIN nodes' worth and so grant MIN nodes (SLURM 22.05): srun gets it, and
  # sbatch asks for the CPUs of a node's tasks.
  if isinstance(spec.nodes, int):
    per_node = [f"--ntasks-per-node={spec.tasks_per_node}"]
  elif spec.tasks_per_node > 1:
    per_node = [f"--mincpus={spec.cpus_per_task * spec.tasks_per_node}"]
  else:
    per_node = []
  sbatch = [
      f"--job-name={spec.job_name}",
      f"--nodes={spec.nodes}",
      *per_node,
      *([f"--gpus-per-node={spec.gpus_per_node}"] if spec.gpus_per_node
        else []),
      f"--cpus-per-task={spec.cpus_per_task}",
      f"--time={spec.time}",
      *(["--no-kill"] if isinstance(spec.nodes, str) else []),
      *([f"--partition={spec.partition}"] if spec.partition else []),
      "--output=%x-%j.out",
      "--open-mode=append",
      "--requeue" if spec.requeue else "--no-requeue",
      f"--signal={'' if spec.requeue_from == 'task' else 'B:'}USR1@"
      f"{spec.signal_seconds}",
  ]
  lines = ["#!/bin/bash"]
  lines += [f"# {line}".rstrip() for line in spec.description.splitlines()]
  if spec.description:
    lines.append("#")
  lines += [
      "# Submit with `sbatch FILE`; sbatch options on the command line win "
      "over the",
      "# #SBATCH lines, e.g. `sbatch --nodes=4 --time=12:00:00 FILE`.",
      "# Written by `tfdist slurm` (tfdist.launch.sbatch.render); edit freely.",
  ]
  lines += [f"#SBATCH {option}" for option in (*sbatch, *spec.sbatch_options)]
  lines += ["", "set -uo pipefail", ""]
  if spec.setup:
    lines += ["# Set-up, before the tasks start.", *spec.setup, ""]
  lines += _command_lines(spec)
  lines += [""]
  lines += _secret_lines()
  lines += [""]
  lines += _signal_lines(spec)
  lines += [""]
  lines += _run_lines(spec)
  return "\n".join(lines) + "\n"


def _command_lines(spec: SbatchSpec) -> list[str]:
  lines = [
      "# The program every task runs. TFDIST_COMMAND replaces it without "
      "editing this file",
      "# (split on whitespace; put anything fancier in a script), e.g.",
      "#   TFDIST_COMMAND=\"python my_train.py --epochs=3\" sbatch FILE",
      'if [[ -n "${TFDIST_COMMAND:-}" ]]; then',
      '  read -r -a command <<< "${TFDIST_COMMAND}"',
      "else",
      f"  command=({shlex.join(spec.command)})",
      "fi",
  ]
  if spec.roles:
    lines += [
        "# Roles in rank order; each node's launcher starts its share.",
        f"export TFDIST_SLURM_ROLES={spec.roles}",
    ]
  return lines


def _secret_lines() -> list[str]:
  name = _net.JOB_SECRET_VARIABLE
  return [
      "# A fresh random secret for this run, shared by its tasks through srun: "
      "the socket",
      "# all-reduce ring admits only tasks that know it. Exported, never on a "
      "command line;",
      "# one set when submitting is kept.",
      f'export {name}="${{{name}:-$(od -An -N32 -tx1 /dev/urandom '
      "| tr -d ' \\n')}\"",
  ]


def _signal_lines(spec: SbatchSpec) -> list[str]:
  code = PREEMPTED_EXIT_CODE
  by_task = spec.requeue_from == "task"
  if by_task:
    lines = _task_requeue_lines(spec)
  else:
    after = ([f"# The script waits for srun and, if it exited {code}, requeues "
              "the job, which resumes",
              "# from the checkpoint when it starts again; tasks that finished "
              "(0) or failed are not",
              "# run again."]
             if spec.requeue else
             ["# The script waits for srun; the job is not requeued "
              "(--no-requeue)."])
    lines = [
        f"# {spec.signal_seconds} s before the time limit SLURM sends USR1 "
        "to this shell (the B: in",
        "# --signal). The trap forwards it to srun, and on to every node's "
        "launcher and task:",
        "# the tasks' cue to save a checkpoint and exit with code "
        f"{code} (tfdist.PREEMPTED_EXIT_CODE).",
        *after,
        "# The tasks never requeue the job themselves "
        "(tfdist.cluster.requeue), whatever the",
        "# submitting environment says.",
        f"export {requeue_lib.REQUEUE_VARIABLE}=0",
    ]
  lines += [
      "srun_pid=",
      *([] if by_task else ["requeue=0"]),
      "on_usr1() {",
      '  echo "tfdist: USR1 at $(date +%T): forwarding it to the tasks" >&2',
      *([] if by_task else [f"  requeue={int(spec.requeue)}"]),
      '  if [[ -n "${srun_pid}" ]]; then kill -USR1 "${srun_pid}"; fi',
      "}",
      "trap on_usr1 USR1",
  ]
  return lines


def _task_requeue_lines(spec: SbatchSpec) -> list[str]:
  """The exports that make the chief task requeue, with their comment."""
  cap = spec.max_requeues
  return [
      f"# {spec.signal_seconds} s before the time limit SLURM sends USR1 to "
      "every task (no B: in --signal):",
      "# the tasks' cue to save a checkpoint and exit with code "
      f"{PREEMPTED_EXIT_CODE} (tfdist.PREEMPTED_EXIT_CODE).",
      "# Once they saved, the chief task requeues the job itself (`scontrol "
      "requeue`) and says",
      "# so in one `tfdist: ` line; the job resumes from the checkpoint when "
      "it starts again.",
      "# Tasks that finished (0) or failed are not run again. tfdist reads "
      "these variables in",
      "# every task (tfdist.cluster.requeue).",
      *([] if cap is None else [f"# At most {cap} requeue(s): "
                                "SLURM_RESTART_COUNT counts them."]),
      f"export {requeue_lib.REQUEUE_VARIABLE}=1",
      *([] if cap is None
        else [f"export {requeue_lib.MAX_REQUEUES_VARIABLE}={cap}"]),
      "# USR1 sent to this shell as well (scancel --batch or --full) is "
      "forwarded to srun.",
  ]


def _cap_lines(spec: SbatchSpec) -> list[str]:
  if (spec.max_requeues is None or not spec.requeue
      or spec.requeue_from == "task"):
    return []
  return [
      f"# At most {spec.max_requeues} requeue(s): SLURM_RESTART_COUNT counts "
      "them.",
      f'if (( requeue && ${{SLURM_RESTART_COUNT:-0}} >= {spec.max_requeues} '
      ")); then",
      f'  echo "tfdist: not requeueing: {spec.max_requeues} requeue(s) done '
      '(the cap)" >&2',
      "  requeue=0",
      "fi",
  ]


def srun_problem(spec: SbatchSpec) -> str | None:
  """A warning when the command calls ``srun`` itself: the script already
  runs it under ``srun``, and srun inside srun starts a step per task."""
  words = [w.rsplit("/", 1)[-1] for w in spec.command]
  if "srun" in words:
    return ("the command runs srun, but the script already starts it with "
            "srun: each task would start a step of its own. Give the "
            "program itself, e.g. `-- python train.py`")
  return None


def fits_problem(spec: SbatchSpec, *, timeout: float = 10.0,
                 environ: Mapping[str, str] | None = None
                 ) -> tuple[str, str] | None:
  """Why ``spec`` cannot fit a node of its partition, from ``sinfo``.

  Asks ``sinfo -h -p PARTITION -o "%c %G"`` (CPUs and generic resources per
  node; bounded by ``timeout``) and compares ``cpus_per_task *
  tasks_per_node`` and ``gpus_per_node`` with the largest node's.

  Returns:
    ``(field, sentence)``, or ``None`` when it fits or cannot be checked (no
    partition, no sinfo, no answer).
  """
  if spec.partition is None or shutil.which("sinfo") is None:
    return None
  try:
    out = subprocess.run(
        ["sinfo", "-h", "-p", spec.partition, "-o", "%c %G"],
        capture_output=True, text=True, timeout=timeout, check=False,
        env=None if environ is None else dict(environ))
  except (OSError, subprocess.TimeoutExpired):
    return None
  rows = [line.split(None, 1) for line in out.stdout.splitlines()
          if line.strip()]
  if out.returncode != 0 or not rows:
    return None
  cpus = max(int(re.sub(r"\D", "", r[0]) or 0) for r in rows)
  gpus = max(sum(int(n) for n in re.findall(r"gpu(?::[^:(,]+)?:(\d+)",
                                            r[1] if len(r) > 1 else ""))
             for r in rows)
  want = spec.cpus_per_task * spec.tasks_per_node
  if want > cpus:
    return ("cpus_per_task",
            f"cpus_per_task * tasks_per_node = {want}, but the nodes of "
            f"partition {spec.partition} have at most {cpus} CPUs")
  if spec.gpus_per_node > gpus:
    return ("gpus_per_node",
            f"gpus_per_node = {spec.gpus_per_node}, but the nodes of "
            f"partition {spec.partition} have at most {gpus} GPUs")
  return None


def _run_lines(spec: SbatchSpec) -> list[str]:
  code = PREEMPTED_EXIT_CODE
  k = spec.tasks_per_node
  nodes = (["--nnodes", str(spec.nodes).replace("-", ":")]
           if isinstance(spec.nodes, str) else [])
  lines = [
      "# One `tfdist launch` per node, the job's nodes its members (from "
      "SLURM: no addresses",
      f"# to give). Each starts its node's {k} task(s) (roles in rank order, "
      "the node's GPUs split",
      "# over them) and ends every node's tasks when one fails; a stalled job "
      "prints its stall",
      "# report here. --kill-on-bad-exit=0: a node that saved exits "
      f"{code}, and srun would kill the",
      "# nodes still saving.",
      "# (--ntasks-per-node and --cpus-per-task given to sbatch win.)",
      f"tasks=${{SLURM_NTASKS_PER_NODE:-{k}}}",
      'srun --ntasks="${SLURM_JOB_NUM_NODES}" --ntasks-per-node=1 '
      "--cpus-per-task=$(( "
      f"${{SLURM_CPUS_PER_TASK:-{spec.cpus_per_task}}} * tasks )) "
      '--kill-on-bad-exit=0 tfdist launch --workers "${tasks}" '
      f"{' '.join(nodes)}{' ' if nodes else ''}-- \"${{command[@]}}\" &",
      "srun_pid=$!",
      "# wait returns early (128+10) when the trap runs: wait until srun has "
      "exited, then",
      "# once more for its exit status.",
      'while kill -0 "${srun_pid}" 2>/dev/null; do wait "${srun_pid}"; done',
      'wait "${srun_pid}"; status=$?',
  ]
  resume = [f"  echo \"tfdist: {_PREEMPTED}\" >&2"]
  if spec.requeue_from == "task":
    return lines + [
        "# Nothing to requeue here: the chief task did, or said why not (SLURM "
        "ends a requeued",
        "# job's shell before this line).",
        f"if (( status == {code} )); then", *resume, "fi",
        'exit "${status}"',
    ]
  lines += [
      *_cap_lines(spec),
      f"if (( requeue && status == {code} )); then",
      "  # In an array, SLURM_JOB_ID of one element is the array's id, which "
      "names every",
      "  # element: ARRAYID_TASKID names this element only.",
      '  job="${SLURM_JOB_ID}"',
      '  if [[ -n "${SLURM_ARRAY_TASK_ID:-}" ]]; then',
      '    job="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
      "  fi",
      '  echo "tfdist: requeueing job ${job}" >&2',
      '  scontrol requeue "${job}"',
      f"elif (( status == {code} )); then",
      *resume,
      "elif (( requeue )); then",
      '  echo "tfdist: not requeueing: srun exited ${status}, not '
      f'{code} (preempted)" >&2',
      "fi",
      'exit "${status}"',
  ]
  return lines
