"""Which transport carries a strategy's gradients, and why: `choose`,
`agree` and `record` at `tfdist.make_strategy`, `announce` at the first
step. The rule and the measurements behind it: `tfdist.strategy.transport`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Mapping, Sequence

import tensorflow as tf

from tfdist import _flight
from tfdist import _net
from tfdist import ring as ring_lib
from tfdist.errors import ConfigError
from tfdist.errors import StartupTimeoutError
from tfdist.ring import connection
from tfdist.strategy import introspect
from tfdist.strategy import rings
from tfdist.strategy.gradient_options import TRANSPORT_VARIABLE
from tfdist.strategy.gradient_options import TRANSPORTS

__all__ = ["Choice", "auto_rule", "choose", "plan", "environment_problems",
           "agree", "record", "gradient_transport", "announce"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice:
  """The transport a strategy's gradients take, and why.

  Attributes:
    transport: ``collective`` or ``socket``.
    reason: why, in words (said by the chief at the first step, `announce`).
    connect_timeout_s: the ring's bound on connecting (``socket``).
    timeout_s: a ring peer silent this long is lost (``socket``).
  """
  transport: str
  reason: str
  connect_timeout_s: float = 300.0
  timeout_s: float = 300.0


def auto_rule(*, workers: int, local_devices: Sequence[str],
              secret: bool) -> tuple[str, str]:
  """``auto``'s transport, and why, for a MultiWorkerMirroredStrategy.

  Args:
    workers: the processes of the cluster (chief and workers).
    local_devices: this worker's replica devices.
    secret: whether the job has a secret (``TFDIST_JOB_SECRET``).

  Returns:
    ``(transport, reason)``.
  """
  if workers < 2:
    return "collective", "one worker: nothing crosses between processes"
  if len(local_devices) != 1:
    return "collective", (f"{len(local_devices)} replicas on each worker; "
                          "the ring carries one per process")
  if any(":GPU:" in d.upper() or ":TPU:" in d.upper() for d in local_devices):
    return "collective", ("replicas on accelerators: TensorFlow's "
                          "collectives keep the gradients on the device")
  if not secret:
    return "collective", (
        f"no job secret ({_net.JOB_SECRET_VARIABLE}): the ring would let any "
        "process that reaches its port join it; tfdist launch and tfdist "
        "slurm set one")
  return "socket", (f"{workers} CPU workers with a job secret: the ring "
                    "moves gradients faster than TensorFlow's collectives "
                    "(docs/benchmarks.md)")


def choose(strategy, requested: str = "auto", *,
           connect_timeout_s: float = 300.0, timeout_s: float = 300.0,
           environ: Mapping[str, str] | None = None) -> Choice:
  """The transport of a MultiWorkerMirroredStrategy's gradients.

  Args:
    strategy: the strategy.
    requested: one of `TRANSPORTS`; ``auto`` reads `TRANSPORT_VARIABLE`
      first, then applies `auto_rule`.
    connect_timeout_s: the ring's bound on connecting.
    timeout_s: a ring peer silent this long is lost.
    environ: the environment (``os.environ`` when omitted).

  Raises:
    ConfigError: an unknown `TRANSPORT_VARIABLE` value, or ``socket`` for a
      strategy the ring cannot serve.
  """
  environ = os.environ if environ is None else environ
  requested, source = _requested(requested, environ)
  timeouts = {"connect_timeout_s": float(connect_timeout_s),
              "timeout_s": float(timeout_s)}
  if requested == "collective":
    return Choice(transport="collective", reason=f"asked for by {source}")
  if requested == "socket":
    if not rings.check_strategy(strategy, source):
      return Choice(transport="collective",
                    reason="one replica: nothing to reduce")
    return Choice(transport="socket", reason=f"asked for by {source}",
                  **timeouts)
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return Choice(transport="collective", reason=(
        f"auto: {type(strategy).__name__} reduces within one process"))
  _, _, spec = introspect.task_of(strategy)
  transport, reason = plan(
      workers=len(rings.tasks(spec)),
      local_devices=list(strategy.extended.worker_devices), environ=environ)
  return Choice(transport=transport, reason=reason, **timeouts)


def plan(*, workers: int, local_devices: Sequence[str],
         environ: Mapping[str, str] | None = None) -> tuple[str, str]:
  """What ``auto`` will choose for a MultiWorkerMirrored cluster, and why.

  From the cluster's shape, before TensorFlow starts (``tfdist info``):
  `TRANSPORT_VARIABLE` when it is set, else `auto_rule`.

  Raises:
    ConfigError: an unknown `TRANSPORT_VARIABLE` value.
  """
  environ = os.environ if environ is None else environ
  requested, source = _requested("auto", environ)
  if requested != "auto":
    return requested, f"asked for by {source}"
  transport, reason = auto_rule(workers=workers, local_devices=local_devices,
                                secret=_net.job_secret(environ) is not None)
  return transport, f"auto: {reason}"


def _requested(requested: str, environ: Mapping[str, str]) -> tuple[str, str]:
  """``requested``, or `TRANSPORT_VARIABLE` for ``auto``; where it came from."""
  value = environ.get(TRANSPORT_VARIABLE)
  if requested != "auto" or not value:
    return requested, "make_strategy option transport"
  source = f"the {TRANSPORT_VARIABLE} environment variable"
  if value not in TRANSPORTS:
    raise ConfigError(field=TRANSPORT_VARIABLE, value=value, source=source,
                      expected=f"one of {list(TRANSPORTS)}")
  return value, source


def environment_problems(environ: Mapping[str, str] | None = None
                         ) -> dict[str, ConfigError]:
  """`TRANSPORT_VARIABLE` and `connection.RING_PORTS_VARIABLE`, where set to a
  value tfdist cannot use, to the `ConfigError` reading it raises."""
  environ = os.environ if environ is None else environ
  problems = {}
  for name, read in (
      (TRANSPORT_VARIABLE, lambda: _requested("auto", environ)),
      (connection.RING_PORTS_VARIABLE,
       lambda: connection.ring_ports(None, source="", environ=environ))):
    try:
      read()
    except ConfigError as e:
      problems[name] = e
  return problems


def agree(strategy, choice: Choice, *, timeout_s: float,
          rendezvous: ring_lib.Rendezvous | None = None) -> None:
  """Checks that every worker of ``strategy`` made the same ``choice``.

  Each task publishes its transport in the coordination service and reads
  every other task's, within ``timeout_s`` in all: workers that differ (a
  job secret or ``TFDIST_TRANSPORT`` set on some only) would otherwise wait
  on each other at the first step, one in the ring and one in a collective.

  Raises:
    ConfigError: a task chose another transport; names it and why.
    StartupTimeoutError: a task did not publish its choice in time.
  """
  rendezvous = rendezvous or rings.CoordinationRendezvous()
  task_type, task_id, spec = introspect.task_of(strategy)
  me = f"{task_type}:{task_id}"
  rendezvous.publish(f"{rings.KEY_PREFIX}/choice/{me}",
                     f"{choice.transport}|{choice.reason}")
  deadline = time.monotonic() + timeout_s
  for task in rings.tasks(spec):
    if task == me:
      continue
    try:
      with _flight.recorded("barrier: transport agreement", peers=task,
                            transport="tensorflow coordination service"):
        value = rendezvous.lookup(f"{rings.KEY_PREFIX}/choice/{task}",
                                  max(0.001, deadline - time.monotonic()))
    except TimeoutError:
      raise StartupTimeoutError(
          f"transport: {me} waited {timeout_s:.0f} s for {task} to say "
          "which transport carries its gradients; is it running "
          "tfdist.make_strategy too?") from None
    transport, _, reason = value.partition("|")
    if transport != choice.transport:
      raise ConfigError(
          field="transport", value=f"{choice.transport} on {me}",
          source=f"make_strategy ({choice.reason})",
          expected=f"the same on every worker; {task} chose {transport} "
                   f"({reason})",
          hint=f"Set {_net.JOB_SECRET_VARIABLE} and {TRANSPORT_VARIABLE} "
               "alike on every worker (tfdist launch and tfdist slurm do)")


def record(strategy, choice: Choice) -> None:
  """Makes ``choice`` the transport of ``strategy``'s Keras optimizers."""
  introspect.record_of(strategy).transport = choice


def gradient_transport(strategy: tf.distribute.Strategy) -> Choice:
  """What carries ``strategy``'s gradients, and why.

  The transport `tfdist.make_strategy` chose for the strategy, which every
  Keras optimizer under it uses; one given `tfdist.perf.with_gradient_options`
  may ask for another.

  Args:
    strategy: a strategy, usually from `tfdist.make_strategy`.

  Returns:
    Its `Choice`: ``transport`` is ``socket`` (tfdist's ring) or
    ``collective`` (TensorFlow's, also for a strategy tfdist did not build),
    ``reason`` says why.

  Example:
    >>> tfdist.gradient_transport(strategy).transport
    'socket'
  """
  choice = introspect.record_of(strategy).transport
  if choice is not None:
    return choice
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return Choice(transport="collective",
                  reason="a strategy tfdist.make_strategy did not build")
  return Choice(transport="collective", reason=(
      f"{type(strategy).__name__.lstrip('_')}: the ring serves "
      "MultiWorkerMirrored only"))


def announce(strategy, choice: Choice) -> None:
  """Says on stderr, from ``strategy``'s chief, which transport carries its
  gradients: as the first step is built, and again for an optimizer that
  asks for the other one."""
  record = introspect.record_of(strategy)
  with record.lock:
    said = record.announced
    if choice.transport in said or strategy.num_replicas_in_sync < 2:
      return
    said.add(choice.transport)
  if not introspect.is_chief(strategy):
    return
  if choice.transport == "socket":
    line = (f"gradients cross by the socket ring ({choice.reason}); "
            f"{TRANSPORT_VARIABLE}=collective for TensorFlow's")
  else:
    line = f"gradients cross by TensorFlow's collectives ({choice.reason})"
  print(f"tfdist: {line}", file=sys.stderr, flush=True)
