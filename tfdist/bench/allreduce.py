"""All-reduce bandwidth against a loopback TCP stream.

`sweep` runs inside every worker of a bench cluster (`cluster_worker`): for
each tensor size it times a float32 tensor's sum over the workers, in a
`tf.function` of ``strategy.run`` as training does, by each entry of
`METHODS` (TensorFlow's collectives, tfdist's socket transport, the socket
ring called on numpy buffers, and ``exchange``: the ring's bytes with no
arithmetic, the ceiling; docs/benchmarks.md, "Method"). For a float32
tensor of S bytes reduced in t seconds over n workers, the algorithm
bandwidth is ``S / t`` and the bus bandwidth ``S / t * 2 (n - 1) / n``
(NCCL's definition). `loopback_bytes_per_s` times one plain TCP stream over
127.0.0.1: the most one connection moves on this machine.
"""

from __future__ import annotations

import functools
import socket
import statistics
import threading
import time
from typing import NamedTuple, Sequence

__all__ = ["METHODS", "method_name", "sweep", "time_shapes",
           "loopback_bytes_per_s", "summarize", "Ticks", "processor_ticks",
           "busy_share"]

_MB = 1 << 20
_LOOP_MB = 16  # Tensors below this are reduced several times per call.

#: Sweep entries: name -> (how, compression); ``how`` is a transport of
#: `tfdist.perf.TRANSPORTS` (through TensorFlow, as training calls it) or
#: ``ring`` (the socket ring called directly, outside TensorFlow).
METHODS: dict[str, tuple[str, str]] = {
    "none": ("collective", "none"),
    "fp16": ("collective", "fp16"),
    "bf16": ("collective", "bf16"),
    "socket": ("socket", "none"),
    "socket_fp16": ("socket", "fp16"),
    "socket_bf16": ("socket", "bf16"),
    "socket_unaligned": ("socket_unaligned", "none"),
    "ring": ("ring", "none"),
    "ring_bf16": ("ring", "bf16"),
    "ring_polled": ("ring_polled", "none"),
    "exchange": ("exchange", "none"),
}


def method_name(transport: str, compression: str) -> str:
  """The `METHODS` entry of a transport and compression."""
  return next(k for k, v in METHODS.items() if v == (transport, compression))


def _reduce_fn(strategy, method: str, sources, repeats: int):
  """A function summing ``sources`` over the workers ``repeats`` times.

  ``sources`` are the halves of the tensor, reduced in one call as an
  optimizer reduces a model's gradients (TensorFlow packs them into one
  collective, the socket transport into one buffer); ``socket_unaligned``
  moves the cut 3 values on. Through TensorFlow the
  repeats are a ``tf.range`` loop in one ``tf.function`` call, as a training
  loop of several steps runs, so the call's fixed cost is shared.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist import perf  # pylint: disable=g-import-not-at-top
  from tfdist.strategy import transport  # pylint: disable=g-import-not-at-top
  kind, compression = METHODS[method]
  codec = perf.get_compression(compression)
  options = perf.GradientOptions()
  if kind in ("ring", "ring_polled", "exchange"):
    ring = transport.ring_for(
        strategy, connect_timeout_s=options.socket_connect_timeout_seconds,
        timeout_s=options.socket_timeout_seconds,
        threaded_bytes=1 << 62 if kind == "ring_polled" else None)
    with tf.init_scope():
      buffer = tf.concat([tf.identity(s) for s in sources], 0).numpy()
    if kind == "exchange":
      n = strategy.num_replicas_in_sync
      buffer = np.resize(buffer, buffer.size * 2 * (n - 1) // n)
    out = np.empty_like(buffer)
    once = (functools.partial(ring.send_receive, buffer, out)
            if kind == "exchange" else functools.partial(
                ring.all_reduce, buffer, wire=codec.ring_wire, out=out))

    def run_ring():
      for _ in range(repeats):
        once()
    return run_ring
  if kind in ("socket", "socket_unaligned"):
    if kind == "socket_unaligned":
      with tf.init_scope():
        whole = tf.concat([tf.identity(s) for s in sources], 0)
        cut = int(sources[0].shape[0]) + 3
        sources = [tf.Variable(whole[:cut], trainable=False),
                   tf.Variable(whole[cut:], trainable=False)]

    def reduce_once():
      summed = transport.socket_all_reduce(
          [tf.identity(s) for s in sources], compression=compression,
          connect_timeout_s=options.socket_connect_timeout_seconds,
          timeout_s=options.socket_timeout_seconds, fallback=None)
      return tf.reduce_sum(summed[0][:1])
  else:

    def reduce_once():
      ctx = tf.distribute.get_replica_context()
      wire = [codec.encode(tf.identity(s)) for s in sources]
      summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, wire)
      return tf.reduce_sum(codec.decode(summed[0], tf.float32)[:1])

  @tf.function
  def loop():
    total = tf.constant(0.0)
    for _ in tf.range(repeats):
      total += strategy.experimental_local_results(
          strategy.run(reduce_once))[0]
    return total

  return loop


def sweep(strategy, *, sizes_mb: Sequence[float], methods: Sequence[str],
          iterations: int) -> dict:
  """Times all-reduces of each size and method; medians of iterations.

  Args:
    strategy: a MultiWorkerMirroredStrategy with more than one worker.
    sizes_mb: float32 tensor sizes in MiB.
    methods: `METHODS` names.
    iterations: timed calls per (size, method), after one warm-up; a call
      reduces a tensor of S MiB round(16 / S) times (at least once).

  Returns:
    ``{method: {size_mb: {"seconds": ..., "algbw": ..., "busbw": ...,
    "cpu_per_wall": ..., "cpu_seconds": ...}}}`` with bandwidths in bytes
    per second; ``cpu_seconds`` is this process's CPU seconds (all its
    threads) per all-reduce, ``cpu_per_wall`` per second of the calls.
    ``machine_busy`` (where the system has ``/proc/stat``) is the share of
    this machine's processors busy over the timed calls, the kernel's
    network work included; ``softirq_share`` the share in packet work.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  n = strategy.num_replicas_in_sync
  out: dict[str, dict] = {m: {} for m in methods}
  for size in sizes_mb:
    elements = int(size * _MB) // 4
    repeats = max(1, round(_LOOP_MB / size))
    with tf.init_scope():
      sources = [tf.Variable(tf.ones([k], tf.float32), trainable=False)
                 for k in (elements // 2, elements - elements // 2)]
    for name in methods:
      figures = _timed(_reduce_fn(strategy, name, sources, repeats),
                       iterations=iterations, repeats=repeats)
      algbw = elements * 4 / figures["seconds"]
      out[name][str(size)] = {**figures, "algbw": algbw,
                              "busbw": algbw * 2 * (n - 1) / n}
    del sources
  return out


def _timed(fn, *, iterations: int, repeats: int) -> dict:
  """Times ``fn`` (``repeats`` all-reduces a call) after one warm-up call.

  Returns:
    ``seconds`` (the median call over ``repeats``), ``cpu_per_wall`` (its
    median), ``cpu_seconds`` (the median call's over ``repeats``) and,
    where ``/proc/stat`` is read, ``machine_busy`` (over all the timed
    calls): see `sweep`.
  """
  fn()  # Warm-up: traces and sets up the collective.
  times, cpu, cpu_s = [], [], []
  ticks_before = processor_ticks()
  for _ in range(iterations):
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    wall = time.perf_counter() - start
    spent = time.process_time() - start_cpu
    times.append(wall / repeats)
    cpu.append(spent / wall)
    cpu_s.append(spent / repeats)
  return {"seconds": statistics.median(times),
          "cpu_per_wall": statistics.median(cpu),
          "cpu_seconds": statistics.median(cpu_s),
          **busy_share([(ticks_before, processor_ticks())])}


def time_shapes(strategy, shapes: Sequence[Sequence[int]], *, method: str,
                iterations: int, repeats: int = 10) -> float:
  """Seconds one all-reduce of float32 tensors of ``shapes`` takes by
  ``method`` (a model's gradients: its variables' shapes); the median of
  ``iterations`` calls of ``repeats`` all-reduces, after one warm-up."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.init_scope():
    sources = [tf.Variable(tf.ones(shape, tf.float32), trainable=False)
               for shape in shapes]
  return _timed(_reduce_fn(strategy, method, sources, repeats),
                iterations=iterations, repeats=repeats)["seconds"]


class Ticks(NamedTuple):
  """Clock ticks of every processor since boot (`processor_ticks`)."""
  busy: int
  softirq: int
  every: int


def processor_ticks() -> Ticks | None:
  """Every processor's ticks since boot; ``None`` off Linux.

  From the first line of ``/proc/stat`` (proc(5)): user, nice, system,
  idle, iowait, irq, softirq, steal (guest time is already in user); busy
  is all but idle and iowait (steal counts as busy: the processor was not
  this machine's to use). softirq is mostly the kernel's packet work, which
  no process is charged for.
  """
  try:
    with open("/proc/stat") as f:
      fields = [int(v) for v in f.readline().split()[1:9]]
  except (OSError, ValueError):
    return None
  every = sum(fields)
  return Ticks(busy=every - fields[3] - fields[4], softirq=fields[6],
               every=every)


def busy_share(spans: Sequence[tuple[Ticks | None, Ticks | None]]) -> dict:
  """``{"machine_busy", "softirq_share"}`` over ``spans`` of (before, after)
  readings: the shares of every processor's time busy, and in softirq;
  ``{}`` where a reading is missing or no tick passed."""
  if not spans or any(a is None or b is None for a, b in spans):
    return {}
  spent = [sum(after[i] - before[i] for before, after in spans)
           for i in range(3)]
  if spent[2] <= 0:
    return {}
  return {"machine_busy": spent[0] / spent[2],
          "softirq_share": spent[1] / spent[2]}


def loopback_bytes_per_s(total_mb: int = 256, chunk_mb: int = 4,
                         repeats: int = 3, timeout_s: float = 60.0) -> float:
  """One TCP stream over 127.0.0.1: the median of ``repeats`` transfers.

  Args:
    total_mb: MiB sent per transfer.
    chunk_mb: MiB per ``sendall``.
    repeats: transfers timed.
    timeout_s: bound on each socket operation.

  Returns:
    Bytes per second received.
  """
  rates = []
  payload = b"\0" * (chunk_mb * _MB)
  for _ in range(repeats):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(timeout_s)
    port = server.getsockname()[1]
    received = [0]

    def drain():
      conn, _ = server.accept()
      conn.settimeout(timeout_s)
      buf = bytearray(chunk_mb * _MB)
      view = memoryview(buf)
      with conn:
        while True:
          k = conn.recv_into(view)
          if not k:
            break
          received[0] += k

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as c:
      start = time.perf_counter()
      for _ in range(total_mb // chunk_mb):
        c.sendall(payload)
      c.shutdown(socket.SHUT_WR)
      reader.join(timeout_s)
      elapsed = time.perf_counter() - start
    server.close()
    rates.append(received[0] / elapsed)
  return statistics.median(rates)


def summarize(sweep_result: dict, loopback: float, *, method: str) -> dict:
  """The headline: ``method``'s median algbw over sizes / loopback.

  Also every method's fraction (``fractions``), ``raw_fraction_of_loopback``
  for TensorFlow's collectives sending float32 (``none``), and the ceiling:
  ``exchange``'s fraction (``ceiling_fraction_of_loopback``) and ``method``'s
  share of it (``fraction_of_ceiling``), when the sweep timed it.
  """
  fractions = {
      name: statistics.median(v["algbw"] for v in per_size.values()) / loopback
      for name, per_size in sweep_result.items()}
  transport, compression = METHODS[method]
  ceiling = fractions.get("exchange")
  return {"allreduce_fraction_of_loopback": fractions[method],
          "ceiling_fraction_of_loopback": ceiling,
          "fraction_of_ceiling": (fractions[method] / ceiling
                                  if ceiling else None),
          "raw_fraction_of_loopback": fractions["none"],
          "fractions": fractions, "method": method, "transport": transport,
          "compression": compression}
