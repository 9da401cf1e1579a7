"""The rendezvous of `tfdist launch --nnodes` against strangers and signals.

Strangers without the job's secret, many or slow, neither hold a connection
nor stop node 0's master: a real node joins under a flood of slow
connections (at this process's descriptor limit, and under ``ulimit -n
1024``), a slowloris is dropped at the hello's one deadline, and an
``accept()`` that fails for want of descriptors is retried. A launcher
waiting in the rendezvous ends at once on SIGTERM or SIGINT with 128+N, and
an unresolvable ``--master-addr`` is one ``tfdist:`` line and exit 2 on
every node. Launchers run ``python -c`` tasks: no TensorFlow.
"""

import errno
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist import _net
from tfdist import _secret
from tfdist.launch import rendezvous
from tfdist.launch import rounds

import cluster_utils
import stalls

LAUNCH = [sys.executable, "-m", "tfdist", "launch"]
SECRET = "5e2b7f-rendezvous-test-secret"
OK = "print('ok')"
#: Sets the open-file limit of the launcher it runs (argv[2:]) to argv[1].
LIMITED = ("import os, resource, sys; n = int(sys.argv[1]); "
           "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
           "os.execv(sys.argv[2], sys.argv[2:])")


def _launcher(port, rank, *, nnodes=2, files=None):
  """The command of node ``rank``'s launcher, with at most ``files`` open
  files when given."""
  command = LAUNCH + ["--nnodes", str(nnodes), "--node-rank", str(rank),
                      "--master-addr", "127.0.0.1", "--master-port",
                      str(port), "--workers", "1", "--", sys.executable,
                      "-c", OK]
  if files is None:
    return command
  return [sys.executable, "-c", LIMITED, str(files), *command]


def _nodes(commands):
  env = cluster_utils.base_env({_net.JOB_SECRET_VARIABLE: SECRET})
  return cluster_utils.Tasks(commands=commands, envs=[env] * len(commands),
                             cwd=cluster_utils.REPO, merge_stderr=True,
                             start=False)


def _catches(pid, signum):
  """Whether process ``pid`` has a handler for ``signum`` (the launcher's
  are installed just before it joins the rendezvous)."""
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("SigCgt:"):
        return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
  return False


def _files(pid):
  """How many files process ``pid`` has open (0 once it ended)."""
  try:
    return len(os.listdir(f"/proc/{pid}/fd"))
  except OSError:
    return 0


def _dialed(pid, port):
  """Whether process ``pid`` holds an established TCP connection to
  ``port`` on 127.0.0.1."""
  sockets = set()
  for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
      sockets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    except OSError:
      continue  # Closed meanwhile.
  with open("/proc/net/tcp") as f:
    for line in f.readlines()[1:]:
      fields = line.split()
      if (fields[3] == "01" and int(fields[2].split(":")[1], 16) == port
          and f"socket:[{fields[9]}]" in sockets):
        return True
  return False


class _Flood:
  """Strangers: ``count`` connections from this process to ``port`` on
  loopback, each sending one byte of a hello every ``period`` s; one the
  master drops is opened again at once. Runs until `close` (at most
  ``limit_s``), which closes every one of them."""

  def __init__(self, port, count, *, period=3.0, limit_s=240.0):
    self.opened = 0  # Connections opened in all.
    self.connected = 0  # Of those, how many the master's kernel took.
    self.trickles = 0  # Rounds of one byte on each connection.
    self._port, self._count, self._period = port, count, period
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, args=(limit_s,),
                                    daemon=True)
    self._thread.start()

  def _run(self, limit_s):
    # Writable: connected (or failed); then readable: the master dropped it.
    held = selectors.DefaultSelector()
    end = time.monotonic() + limit_s
    trickle = time.monotonic() + self._period
    try:
      while not self._stop.is_set() and time.monotonic() < end:
        while len(held.get_map()) < self._count:
          s = socket.socket()
          s.setblocking(False)
          s.connect_ex(("127.0.0.1", self._port))
          held.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
          self.opened += 1
        for key, events in held.select(0.1):
          s = key.fileobj
          if events == selectors.EVENT_WRITE and not s.getsockopt(
              socket.SOL_SOCKET, socket.SO_ERROR):
            held.modify(s, selectors.EVENT_READ)
            self.connected += 1
          else:
            held.unregister(s)
            s.close()
        if time.monotonic() >= trickle:
          trickle += self._period
          self.trickles += 1
          for key in list(held.get_map().values()):
            try:
              key.fileobj.send(b"T")
            except OSError:
              pass  # Still connecting, or dropped: select says which.
    finally:
      for key in list(held.get_map().values()):
        key.fileobj.close()
      held.close()

  def close(self):
    self._stop.set()
    self._thread.join(30)


@pytest.mark.timeout(300)
class FloodTest(parameterized.TestCase):
  """A real node joins node 0 while strangers flood its rendezvous."""

  @parameterized.named_parameters(
      ("10000_at_the_default_limit", 10_000, None),
      ("1100_under_ulimit_1024", 1_100, 1024),
  )
  def test_a_real_node_joins_under_a_flood(self, count, files):
    # As many files as this process may open (its launchers inherit it).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
      resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
      self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE,
                      (soft, hard))
    except (ValueError, OSError):  # A hard limit past the kernel's nr_open.
      pass
    own = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if own != resource.RLIM_INFINITY and own < count + 512:
      self.skipTest(f"this process may open {own} files (its hard limit "
                    f"{hard}), too few to flood with {count} connections")
    port = _net.free_ports(1)[0]
    peak = [0]  # Node 0's open files, at most.

    def sampled(condition):
      peak[0] = max(peak[0], _files(nodes.pid(0)))
      return condition()

    with _nodes([_launcher(port, 0, files=files),
                 _launcher(port, 1)]) as nodes:
      nodes.start(0)
      self.assertTrue(cluster_utils.wait_until(
          lambda: _dialed(nodes.pid(0), port), 30), nodes.stdout(0))
      flood = _Flood(port, count)
      try:
        # Node 1 dials once the flood is in place: every connection made,
        # and each sending its second byte. Generous: after a long suite on
        # 2 busy cores, 10,000 connections from one Python thread are slow.
        self.assertTrue(cluster_utils.wait_until(lambda: sampled(
            lambda: flood.connected >= count and flood.trickles >= 2), 120,
            interval=0.1), f"the flood: {flood.opened} opened, "
            f"{flood.connected} connected, {flood.trickles} trickles; load "
            f"{os.getloadavg()}; node 0: {nodes.stdout(0)[-2000:]}")
        nodes.start(1)
        cluster_utils.wait_until(lambda: sampled(
            lambda: not nodes.running(1)), 60, interval=0.1)
        codes = nodes.wait_all(10)
      finally:
        flood.close()
      out = [nodes.stdout(0), nodes.stdout(1)]
    self.assertEqual(codes, [0, 0], out)
    self.assertIn("[worker:0] ok", out[0])
    self.assertIn("[worker:1] ok", out[1])
    # Its connections without proof stay under a quarter of its limit; 64
    # more cover the launcher's own (the tfdist launch spare).
    self.assertLessEqual(
        peak[0], min(_secret.MAX_UNPROVEN, (files or own) // 4) + 64)
    self.assertIn("turned away a connection from 127.0.0.1", out[0])


@pytest.mark.timeout(60)
class StrangerTest(absltest.TestCase):
  """Slow or failed connections at node 0's master."""

  def _master(self, nnodes=2):
    port = _net.free_ports(1)[0]
    master = rendezvous.Master(address=("127.0.0.1", port), nnodes=nnodes,
                               secret=b"right", timeout=30,
                               say=lambda text: None)
    self.addCleanup(master.close)
    return port

  @pytest.mark.beside  # A master in this process; 10 s of waiting.
  def test_a_slowloris_is_dropped_at_the_hello_deadline(self):
    port = self._master()
    start = time.monotonic()
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
      s.settimeout(0.2)
      closed = False
      while not closed and not stalls.expired(start, 30):
        if sent < 1 + (time.monotonic() - start) // 4:  # A byte every 4 s.
          try:
            s.sendall(b"TFDR"[sent % 4:sent % 4 + 1])
            sent += 1
          except OSError:
            closed = True
        try:
          closed = closed or s.recv(64) == b""
        except TimeoutError:
          pass
        except OSError:
          closed = True
      held = stalls.running_since(start)
    self.assertTrue(closed, "the master still holds the slow connection")
    self.assertGreaterEqual(sent, 2)  # Each byte came well within 5 s.
    self.assertLess(held, _secret.HELLO_SECONDS + 3)

  def test_the_master_accepts_again_after_running_out_of_descriptors(self):
    # A master whose process has no descriptor left fails accept() with
    # EMFILE; once descriptors are free again, a member joins.
    port = _net.free_ports(1)[0]
    script = textwrap.dedent(f"""
        import os, resource, sys
        from tfdist.launch import rendezvous
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        master = rendezvous.Master(address=("127.0.0.1", {port}), nnodes=1,
                                   secret=b"right", timeout=30,
                                   say=lambda text: print("tfdist: " + text))
        hogs = []
        try:
          while True:
            hogs.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
          pass
        print("full", flush=True)
        sys.stdin.readline()
        for fd in hogs:
          os.close(fd)
        print("free", flush=True)
        sys.stdin.readline()
        master.close()
        """)
    proc = subprocess.Popen([sys.executable, "-c", script], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            cwd=cluster_utils.REPO,
                            env=cluster_utils.base_env())
    self.addCleanup(proc.wait, 30)
    self.addCleanup(proc.kill)
    self.assertEqual(proc.stdout.readline(), "full\n")
    joined = []
    dialer = threading.Thread(target=lambda: joined.append(rendezvous.Member(
        master=("127.0.0.1", port), rank=0, secret=b"right", timeout=20)))
    dialer.start()
    time.sleep(1.0)  # Its connection waits; accept() fails meanwhile.
    proc.stdin.write("go\n")
    proc.stdin.flush()
    lines = [proc.stdout.readline(), proc.stdout.readline()]
    dialer.join(30)
    self.assertLen(joined, 1, lines)
    member = joined[0]
    self.addCleanup(member.close)
    placed = member.join(attempt=0, host="127.0.0.1", jobs={"worker": 1},
                         evaluator=False, ports=[1000])
    self.assertEqual(placed.cluster, {"worker": ["127.0.0.1:1000"]})
    self.assertIn(f"accept() failed ([Errno {errno.EMFILE}]", lines[0])
    self.assertEqual(lines[1], "free\n")
    proc.stdin.write("end\n")
    proc.stdin.flush()


@pytest.mark.timeout(60)
class WaitingTest(parameterized.TestCase):
  """A launcher waiting in the rendezvous ends at once on a signal."""

  @parameterized.named_parameters(
      (f"{signum.name}_{waiting}", signum, waiting)
      for signum in (signal.SIGTERM, signal.SIGINT)
      for waiting in ("node_0_for_node_1", "node_1_for_no_master",
                      "node_1_for_the_cluster"))
  def test_a_signal_ends_a_waiting_launcher_with_128_plus_n(self, signum,
                                                            waiting):
    port = _net.free_ports(1)[0]
    nnodes = 3 if waiting == "node_1_for_the_cluster" else 2
    ranks = {"node_0_for_node_1": [0], "node_1_for_no_master": [1],
             "node_1_for_the_cluster": [0, 1]}[waiting]
    with _nodes([_launcher(port, r, nnodes=nnodes) for r in ranks]) as nodes:
      nodes.start()
      waiter = len(ranks) - 1  # The launcher signalled: the last one.
      pid = nodes.pid(waiter)
      self.assertTrue(cluster_utils.wait_until(
          lambda: _catches(pid, signal.SIGTERM)
          and (waiting == "node_1_for_no_master" or _dialed(pid, port)),
          30), nodes.stdout(waiter))
      start = time.monotonic()
      nodes.signal(waiter, signum)
      code = nodes.wait(waiter, 30)
      took = stalls.running_since(start)
      out = nodes.stdout(waiter)
    self.assertEqual(code, 128 + signum, out)
    self.assertLess(took, 3, out)
    self.assertIn("stopped while waiting in the rendezvous", out)


@pytest.mark.timeout(60)
class UnresolvableMasterTest(parameterized.TestCase):
  """An address that does not resolve stops every node before it starts."""

  @parameterized.named_parameters(("node_0", 0), ("node_1", 1))
  def test_one_line_naming_the_value_and_exit_2(self, rank):
    value = "no.such.host.invalid"  # RFC 2606: .invalid never resolves.
    start = time.monotonic()
    result = subprocess.run(
        LAUNCH + ["--nnodes", "2", "--node-rank", str(rank), "--master-addr",
                  value, "--master-port", "29400", "--", sys.executable,
                  "-c", OK],
        capture_output=True, text=True, timeout=30, cwd=cluster_utils.REPO,
        env=cluster_utils.base_env({_net.JOB_SECRET_VARIABLE: SECRET}))
    took = stalls.running_since(start)
    self.assertEqual(result.returncode, 2, result.stderr)
    self.assertEqual(result.stdout, "")
    lines = result.stderr.splitlines()
    self.assertLen(lines, 1, result.stderr)
    self.assertTrue(lines[0].startswith("tfdist: --master-addr: "), lines)
    self.assertIn(f"'{value}'", lines[0])
    self.assertNotIn("--master-port", lines[0])
    self.assertLess(took, 15)


@pytest.mark.beside
class DisagreementTest(parameterized.TestCase):
  """The settings every node must share with node 0, compared."""

  @parameterized.named_parameters(
      ("same", {"--nnodes": "2:3", "--run-id": "r"}, None),
      ("other_nnodes", {"--nnodes": "2", "--run-id": "r"},
       "--nnodes 2 on node 4, 2:3 on node 0 (every node needs the same "
       "--nnodes and --run-id)"),
      ("both", {"--nnodes": "3", "--run-id": "s"},
       "--nnodes 3 on node 4, 2:3 on node 0; --run-id s on node 4, r on "
       "node 0 (every node needs the same --nnodes and --run-id)"),
      ("an_older_tfdist_says_nothing", None,
       "--nnodes unset on node 4, 2:3 on node 0; --run-id unset on node 4, "
       "r on node 0 (every node needs the same --nnodes and --run-id)"),
  )
  def test_both_values_named(self, theirs, why):
    self.assertEqual(rounds.disagreement(
        {"--nnodes": "2:3", "--run-id": "r"}, theirs, rank=4), why)


class ValuesKeptTest(parameterized.TestCase):
  """Error text names the user's values as given: a field's name inside a
  value (a host name, a path), or a value spelt like a field, stays."""

  def test_a_path_with_field_names_in_it_stays(self):
    top = tempfile.TemporaryDirectory()
    self.addCleanup(top.cleanup)
    folder = os.path.join(top.name, "host")
    os.mkdir(folder)
    path = os.path.join(folder, "no.such.host.secret_file")
    with open(path, "w") as f:
      f.write("secret")
    os.chmod(path, 0o644)
    env = cluster_utils.base_env()
    env.pop(_net.JOB_SECRET_VARIABLE, None)
    result = subprocess.run(
        LAUNCH + ["--nnodes", "2", "--master-addr", "127.0.0.1",
                  "--master-port", "29400", "--secret-file", path, "--",
                  sys.executable, "-c", OK],
        capture_output=True, text=True, timeout=30, cwd=cluster_utils.REPO,
        env=env)
    self.assertEqual(result.returncode, 2, result.stderr)
    lines = result.stderr.splitlines()
    self.assertLen(lines, 1, result.stderr)
    self.assertTrue(lines[0].startswith("tfdist: --secret-file: "), lines)
    self.assertIn(f"chmod 600 {path}", lines[0])


if __name__ == "__main__":
  absltest.main()
