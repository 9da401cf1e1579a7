"""`tfdist launch` on several nodes: a rendezvous, one cluster, failures that
stop every node, strangers kept out, GPUs placed per task.

Two launchers on loopback stand for two nodes (cheap, no TensorFlow where it
adds nothing); one test runs them in two hosts of the network-namespace test
bed, with real addresses and a real all-reduce between them.
"""

import importlib.metadata
import json
import os
import socket
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist import _net
from tfdist.errors import ConfigError
from tfdist.launch import fingerprint
from tfdist.launch import spec as spec_lib
from tfdist.launch import rendezvous
from tfdist.launch import rounds

import cluster_utils
import netbed
import stalls

TASK = os.path.join(cluster_utils.SCRIPTS, "launch_task.py")
ALLREDUCE = os.path.join(cluster_utils.SCRIPTS, "allreduce.py")
LAUNCH = [sys.executable, "-m", "tfdist", "launch"]
SECRET = "4c1d0e6a9b-test-secret"
#: Failure anywhere -> every node exited: the rendezvous notices at once
#: (closed connection) or within SILENCE_SECONDS, then grace_seconds.
BOUND_S = rendezvous.SILENCE_SECONDS + 10 + 10


def _nodes(layouts, *, mode=("ok",), secret=SECRET, extra=(), env=None,
           program=TASK, nnodes=None, launched=None, envs=None):
  """One launcher per layout (its flags), node ranks in order, on loopback.

  ``launched`` and ``envs`` give, by node rank, another launched command
  (what follows ``--``) and more environment.
  """
  port = _net.free_ports(1)[0]
  base = cluster_utils.base_env({**(env or {})})
  if secret is not None:
    base[_net.JOB_SECRET_VARIABLE] = secret
  commands = [LAUNCH + ["--nnodes", str(nnodes or len(layouts)),
                        "--node-rank", str(r), "--master-addr", "127.0.0.1",
                        "--master-port", str(port), *extra, *flags, "--",
                        *(launched or {}).get(r, [sys.executable, program,
                                                  *mode])]
              for r, flags in enumerate(layouts)]
  return cluster_utils.Tasks(
      commands=commands, envs=[{**base, **(envs or {}).get(r, {})}
                               for r in range(len(layouts))],
      cwd=cluster_utils.REPO, merge_stderr=True), port


def _envs(output: str) -> dict[str, dict]:
  """Role -> what the task printed in ``env`` mode."""
  seen = {}
  for line in output.splitlines():
    if "] env=" in line:
      role = line[1:line.index("]")]
      seen[role] = json.loads(line.split("env=", 1)[1])
  return seen


@pytest.mark.timeout(180)
class TwoNodesTest(parameterized.TestCase):

  def test_one_cluster_over_both_nodes(self):
    tasks, _ = _nodes([["--workers", "1"], ["--workers", "2"]], mode=["env"])
    with tasks:
      codes = tasks.wait_all(60)
      out = tasks.stdout(0) + tasks.stdout(1)
    self.assertEqual(codes, [0, 0], out)
    envs = _envs(out)
    self.assertEqual(sorted(envs), ["worker:0", "worker:1", "worker:2"])
    clusters = {json.dumps(e["cluster"], sort_keys=True) for e in envs.values()}
    self.assertLen(clusters, 1)
    self.assertLen(envs["worker:0"]["cluster"]["worker"], 3)
    self.assertEqual({e["log_level"] for e in envs.values()}, {"2"})

  def test_parameter_server_roles_on_chosen_nodes(self):
    tasks, _ = _nodes([["--chief", "--ps", "1", "--workers", "0"],
                       ["--workers", "2"]], mode=["serve"])
    with tasks:
      codes = tasks.wait_all(60)
      out = tasks.stdout(0) + tasks.stdout(1)
    self.assertEqual(codes, [0, 0], out)
    self.assertIn("[chief:0] role=chief:0", tasks.stdout(0))
    self.assertIn("[ps:0] role=ps:0", tasks.stdout(0))
    self.assertIn("[worker:1] role=worker:1", tasks.stdout(1))

  @parameterized.named_parameters(
      ("two_chiefs", [["--chief"], ["--chief"]], "2 chief tasks"),
      ("ps_without_chief", [["--ps", "1"], ["--workers", "1"]], "no chief"),
      ("no_worker", [["--chief", "--workers", "0"], ["--workers", "0",
                                                      "--evaluator"]],
       "no node runs a worker"),
  )
  def test_a_layout_that_cannot_work_stops_every_node_with_2(self, layouts,
                                                             why):
    tasks, _ = _nodes(layouts)
    with tasks:
      codes = tasks.wait_all(60)
      outs = [tasks.stdout(0), tasks.stdout(1)]
    self.assertEqual(codes, [2, 2], outs)
    for out in outs:
      self.assertIn(why, out)
      self.assertNotIn("role=", out)  # Nothing started.

  def test_a_failed_task_stops_every_node_with_its_code(self):
    tasks, _ = _nodes([[], []], mode=["fail1"])
    with tasks:
      start = time.monotonic()
      codes = tasks.wait_all(BOUND_S + 30)
      took = stalls.running_since(start)
      outs = [tasks.stdout(0), tasks.stdout(1)]
    self.assertEqual(codes, [3, 3], outs)
    self.assertIn("task worker:1 on node 1 failed", outs[0])
    self.assertIn("something broke", outs[1])
    self.assertLess(took, BOUND_S + 30)  # The wait's bound, not a speed.

  def test_a_killed_master_node_stops_the_other_leaving_nothing(self):
    # Node 1 stops its task (which ignores SIGTERM) with SIGKILL after 1 s.
    tasks, _ = _nodes([[], []], mode=["stubborn"],
                      extra=["--grace-seconds", "1"])
    with tasks:
      for i in (0, 1):
        tasks.wait_for(i, lambda line: "ready" in line, 60)
      pids = {int(p) for out in (tasks.stdout(0), tasks.stdout(1))
              for p in re.findall(r"pid=(\d+)", out)}
      tasks.kill(0)
      code = tasks.wait(1, BOUND_S + 30)
      out = tasks.stdout(1)
    self.assertEqual(code, 1, out)
    self.assertIn("lost the rendezvous on node 0", out)
    alive = [p for p in pids if cluster_utils.alive(p)]
    self.assertEqual(alive, [])

  def test_restarts_together(self):
    tasks, _ = _nodes([[], []], mode=["flaky", "1"],
                      extra=["--max-restarts", "1",
                             "--restart-delay-seconds", "0"])
    with tasks:
      codes = tasks.wait_all(90)
      outs = [tasks.stdout(0), tasks.stdout(1)]
    self.assertEqual(codes, [0, 0], outs)
    for out in outs:
      self.assertIn("restart=1", out)
      self.assertIn("restart 1 of 1", out)

  def test_each_signalled_node_says_where_its_own_tasks_saved(self):
    tasks, _ = _nodes([[], []], mode=["saves", "worker:1"],
                      extra=["--grace-seconds", "2"])
    with tasks:
      for i in (0, 1):
        tasks.wait_for(i, lambda line: line.endswith("] ready"), 60)
      # As SLURM signals every node's launcher; node 1 first, so that it
      # has its signal before node 0, which holds the rendezvous, leaves.
      tasks.signal(1, signal.SIGTERM)
      tasks.signal(0, signal.SIGTERM)
      codes = tasks.wait_all(BOUND_S)
      outs = [tasks.stdout(0), tasks.stdout(1)]
    self.assertEqual(codes, [128 + signal.SIGTERM] * 2, outs)
    said = [[l for l in out.splitlines() if l.startswith("tfdist: ")]
            for out in outs]
    self.assertEqual(said, [
        ["tfdist: preempted (SIGTERM): worker:0 saved at step 7; run the "
         "same command to resume"],
        ["tfdist: preempted (SIGTERM): worker:1 did not save (killed by "
         "signal 9)"]], outs)

  def test_gpus_placed_per_task_and_none_for_ps(self):
    tasks, _ = _nodes([["--chief", "--ps", "1", "--workers", "1"],
                       ["--workers", "2"]], mode=["env"],
                      env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    with tasks:
      codes = tasks.wait_all(60)
      out = tasks.stdout(0) + tasks.stdout(1)
    self.assertEqual(codes, [0, 0], out)
    gpus = {role: e["gpus"] for role, e in _envs(out).items()}
    self.assertEqual(gpus, {"chief:0": "4,5", "worker:0": "6,7", "ps:0": "",
                            "worker:1": "4,5", "worker:2": "6,7"})


class StrangerTest(parameterized.TestCase):
  """Connections without the job's secret join nothing and stop nothing."""

  def _master(self):
    port = _net.free_ports(1)[0]
    master = rendezvous.Master(address=("127.0.0.1", port), nnodes=2,
                               secret=b"right", timeout=30,
                               say=lambda text: None)
    self.addCleanup(master.close)
    return master, port

  @parameterized.named_parameters(
      ("wrong_secret", b"wrong"),
      ("empty_secret", b""),
  )
  def test_a_member_without_the_secret_cannot_join(self, secret):
    _, port = self._master()
    with self.assertRaisesRegex(rendezvous.RendezvousError, "secret"):
      rendezvous.Member(master=("127.0.0.1", port), rank=1, secret=secret,
                        timeout=5)

  @parameterized.named_parameters(
      ("garbage", b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64),
      ("oversized_hello", b"TFDR" + b"\0" * 16 + b"\xff" * 100000),
      ("replayed_proof", None),
  )
  def test_strangers_are_dropped_and_the_job_goes_on(self, payload):
    _, port = self._master()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
      if payload is None:  # A proof made for other nonces.
        s.sendall(b"TFDR" + b"\1" * 16)
        s.recv(48)
        s.sendall(b"\2" * 32)
      else:
        s.sendall(payload)
      s.settimeout(10)
      ended = False
      try:
        while s.recv(1 << 16):
          pass
        ended = True  # The master closed it.
      except ConnectionResetError:
        ended = True
      self.assertTrue(ended)
    members = [rendezvous.Member(master=("127.0.0.1", port), rank=r,
                                 secret=b"right", timeout=10) for r in (0, 1)]
    for m in members:
      self.addCleanup(m.close)
    placed = [None, None]
    threads = [threading.Thread(target=lambda i=i: placed.__setitem__(
        i, members[i].join(attempt=0, host="127.0.0.1",
                           jobs={"worker": 1}, evaluator=False,
                           ports=[1000 + i]))) for i in (0, 1)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(30)
    self.assertEqual(placed[0].cluster,
                     {"worker": ["127.0.0.1:1000", "127.0.0.1:1001"]})

  def test_a_forged_message_ends_only_the_forger(self):
    master, port = self._master()
    member = rendezvous.Member(master=("127.0.0.1", port), rank=1,
                               secret=b"right", timeout=5)
    self.addCleanup(member.close)
    # Inject a message on the member's connection without its key: the
    # master drops that connection instead of acting on it.
    body = json.dumps({"kind": "failed", "role": "worker:0", "code": 9,
                       "attempt": 0}).encode()
    member._channel.sock.sendall(len(body).to_bytes(4, "big") + body
                                 + b"\0" * 32)
    lost = None
    start = time.monotonic()
    while lost is None and not stalls.expired(start, 15):
      lost = member.poll(timeout=0.5)
    self.assertIsNotNone(lost)
    self.assertIsInstance(lost, rounds.Stop)


#: Another Keras 3 release than the one installed, for a node that runs it.
OTHER_KERAS = "3.14.0"


_RUNS = (" (every node must run the same tfdist, TensorFlow, Keras, Python "
         "and script)")
_SETTINGS = " (every node needs the same --nnodes and --run-id)"


@pytest.mark.timeout(240)
class NodeMatchTest(parameterized.TestCase):
  """Node 0 compares what every node runs, and its --nnodes and --run-id:
  another release, script or setting is refused on both sides in one line
  naming both values and the refused node exits 2, while the job goes on
  (``--nnodes 1:2``); other arguments alone are warned about."""

  def _folder(self):
    folder = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, folder)
    return folder

  def _other_keras(self):
    """Node 1's environment: a folder holding another Keras release first
    on its PYTHONPATH (``pip install --no-deps --target``)."""
    folder = self._folder()
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--target", folder, f"keras=={OTHER_KERAS}"],
        capture_output=True, text=True, timeout=180)
    if r.returncode:
      self.skipTest(f"pip could not install keras=={OTHER_KERAS} (no package "
                    f"index reachable?): {r.stderr.strip()[-300:]}")
    path = cluster_utils.base_env()["PYTHONPATH"]
    return {"PYTHONPATH": folder + os.pathsep + path}

  def _edited_script(self):
    """Node 1's command: a copy of the task's script with one line more."""
    path = os.path.join(self._folder(), "launch_task.py")
    shutil.copy(TASK, path)
    with open(path, "a") as f:
      f.write("# Edited on node 1 only.\n")
    return [sys.executable, path, "envwait", "5"]

  def test_each_differing_node_is_refused_on_both_sides_and_the_job_goes_on(
      self):
    """Nodes 1-4 each differ from node 0 in one thing: the Keras release,
    the script, --nnodes, --run-id; one job (``--nnodes 1:5``)."""
    keras_ours = importlib.metadata.version("keras")
    edited = self._edited_script()
    script_ours, script_theirs = (
        fingerprint.take([sys.executable, p])["script"]["sha256"][:12]
        for p in (TASK, edited[1]))
    whys = {
        1: f"Keras {OTHER_KERAS} on node 1, {keras_ours} on node 0" + _RUNS,
        2: f"script launch_task.py (sha256 {script_theirs}) on node 2, "
           f"launch_task.py (sha256 {script_ours}) on node 0" + _RUNS,
        3: "--nnodes 1:4 on node 3, 1:5 on node 0" + _SETTINGS,
        4: f"--run-id other on node 4, {spec_lib.run_id_of(SECRET)} on node 0"
           + _SETTINGS}
    layouts = [[], [], [], ["--nnodes", "1:4"], ["--run-id", "other"]]
    # Node 0 runs 10 s or more: every node is in well before it ends.
    tasks, _ = _nodes(layouts, nnodes="1:5", mode=["envwait", "5"],
                      extra=["--last-call-seconds", "5"],
                      envs={1: self._other_keras()}, launched={2: edited})
    with tasks:
      codes = tasks.wait_all(90)
      outs = [tasks.stdout(r) for r in range(5)]
    self.assertEqual(codes, [0, 2, 2, 2, 2], outs)
    said = [[l for l in out.splitlines() if l.startswith("tfdist: ")]
            for out in outs]
    self.assertCountEqual(
        said[0], [f"tfdist: rendezvous: refused node {r}: {why}"
                  for r, why in whys.items()], outs[0])
    for r, why in whys.items():
      self.assertEqual(said[r], [f"tfdist: node {r}: node 0 refused this "
                                 f"node: {why}"], outs[r])
      self.assertNotIn("role=", outs[r])  # Nothing started there.
    self.assertIn("[worker:0] env=", outs[0])  # The job went on.

  def test_other_arguments_alone_are_one_warning(self):
    tasks, _ = _nodes([[], []], launched={
        1: [sys.executable, TASK, "ok", "/data/on/node1"]})
    with tasks:
      codes = tasks.wait_all(60)
      outs = [tasks.stdout(0), tasks.stdout(1)]
    self.assertEqual(codes, [0, 0], outs)
    said = [[l for l in out.splitlines() if l.startswith("tfdist: ")]
            for out in outs]
    self.assertEqual(said, [[
        "tfdist: rendezvous: warning: node 1 runs the same script with other "
        "arguments: argv[3] is '/data/on/node1' on node 1, missing on node 0 "
        "(fine for per-node paths)"], []], outs)


class NodeSpecTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("rank_past_nodes", dict(nnodes=2, node_rank=2, master_addr="h",
                               master_port=1), "node_rank"),
      ("bad_master_addr", dict(nnodes=2, master_addr="a..b", master_port=1),
       "master_addr"),
      ("zero_nodes", dict(nnodes=0), "nnodes"),
      ("negative_gpus", dict(gpus_per_task=-1), "gpus_per_task"),
      ("empty_node", dict(nnodes=2, master_addr="h", master_port=1,
                          num_workers=0), "num_workers"),
  )
  def test_bad_node_fields_are_named(self, kwargs, field):
    with self.assertRaises(ConfigError) as raised:
      spec_lib.LaunchSpec(command=("python", "x.py"), **kwargs)
    self.assertEqual(raised.exception.field, field)

  @parameterized.named_parameters(
      ("no_master_addr", dict(master_port=1), "master_addr"),
      ("no_master_port", dict(master_addr="h"), "master_port"))
  def test_several_nodes_need_node_0s_address_and_port(self, kwargs, field):
    spec = spec_lib.LaunchSpec(command=(sys.executable, "-c", "pass"),
                               nnodes=2, **kwargs)
    with self.assertRaises(ConfigError) as raised:
      spec_lib.preflight(spec)
    self.assertEqual(raised.exception.field, field)

  def test_several_nodes_need_a_secret(self):
    spec = spec_lib.LaunchSpec(command=(sys.executable, "-c", "pass"), nnodes=2,
                            master_addr="127.0.0.1", master_port=1)
    saved = os.environ.pop(_net.JOB_SECRET_VARIABLE, None)
    try:
      with self.assertRaisesRegex(ConfigError, "TFDIST_JOB_SECRET"):
        spec_lib.preflight(spec)
    finally:
      if saved is not None:
        os.environ[_net.JOB_SECRET_VARIABLE] = saved

  def test_a_secret_file_others_can_read_is_refused(self):
    directory = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, directory)
    path = os.path.join(directory, "secret")
    with open(path, "w") as f:
      f.write("s3cret\n")
    os.chmod(path, 0o644)
    spec = spec_lib.LaunchSpec(command=("x",), nnodes=2, master_addr="h",
                            master_port=1, secret_file=path,
                            env={_net.JOB_SECRET_VARIABLE: ""})
    with self.assertRaisesRegex(ConfigError, "chmod 600"):
      spec_lib.job_secret(spec)
    os.chmod(path, 0o600)
    self.assertEqual(spec_lib.job_secret(spec), "s3cret")

  @parameterized.named_parameters(
      ("even_split", "0,1,2,3", ["worker", "worker"], None,
       ["0,1", "2,3"]),
      ("ps_gets_none", "0,1", ["chief", "worker", "ps"], None,
       ["0", "1", ""]),
      ("fewer_gpus_than_tasks_round_robin", "0", ["worker", "worker"], None,
       ["0", "0"]),
      ("asked_per_task", "0,1,2,3", ["worker", "evaluator"], 1, ["0", "1"]),
      ("no_gpu_leaves_it_alone", "", ["worker"], None, [None]),
  )
  def test_gpu_plan(self, visible, kinds, each, expected):
    spec = spec_lib.LaunchSpec(command=("x",), gpus_per_task=each)
    self.assertEqual(spec_lib.gpu_plan(
        spec, kinds, {"CUDA_VISIBLE_DEVICES": visible} if visible else {}),
        expected if visible or os.path.isdir("/proc/driver/nvidia/gpus")
        else [None] * len(kinds))

  def test_gpu_plan_refuses_more_than_there_are(self):
    spec = spec_lib.LaunchSpec(command=("x",), gpus_per_task=3)
    with self.assertRaises(ConfigError) as raised:
      spec_lib.gpu_plan(spec, ["worker", "worker"],
                     {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    self.assertEqual(raised.exception.field, "gpus_per_task")


_BED = netbed.netbed_unavailable_reason()


@pytest.mark.timeout(240)
@absltest.skipIf(_BED is not None, _BED)
class TwoHostsTest(absltest.TestCase):

  def test_all_reduce_across_two_hosts_with_tfdist_launch(self):
    with netbed.NetBed(hosts=("node1", "node2"), resolvable=False) as bed:
      master = bed.address("node1")
      env = cluster_utils.base_env({_net.JOB_SECRET_VARIABLE: SECRET})
      procs = [bed.popen(host, LAUNCH + [
          "--nnodes", "2", "--node-rank", str(rank), "--master-addr", master,
          "--master-port", "29400", "--", sys.executable, ALLREDUCE,
          "multi_worker_mirrored"], env=env, cwd=cluster_utils.REPO,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for rank, host in enumerate(bed.hosts)]
      outs = [p.communicate(timeout=180)[0] for p in procs]
    self.assertEqual([p.returncode for p in procs], [0, 0], outs)
    results = [json.loads(line.split("] ", 1)[1]) for out in outs
               for line in out.splitlines() if '"sum"' in line]
    self.assertLen(results, 2, outs)
    for r in results:
      self.assertEqual(r["sum"], 3.0)
      self.assertEqual(r["cluster"]["worker"],
                       ["198.18.0.11:" + r["cluster"]["worker"][0]
                        .split(":")[1],
                        "198.18.0.12:" + r["cluster"]["worker"][1]
                        .split(":")[1]])

  def test_a_failure_on_one_host_stops_both_and_a_stranger_joins_nothing(self):
    stranger = (
        "import sys\n"
        "from tfdist.launch import rendezvous\n"
        "try:\n"
        "  rendezvous.Member(master=(sys.argv[1], 29400), rank=1,\n"
        "                    secret=b'guessed', timeout=20)\n"
        "except rendezvous.RendezvousError as e:\n"
        "  print('refused:', e)\n")
    with netbed.NetBed(hosts=("node1", "node2", "intruder")) as bed:
      master = bed.address("node1")
      env = cluster_utils.base_env({_net.JOB_SECRET_VARIABLE: SECRET})
      node0 = bed.popen("node1", LAUNCH + [
          "--nnodes", "2", "--node-rank", "0", "--master-addr", master,
          "--master-port", "29400", "--", sys.executable, TASK, "fail1"],
          env=env, cwd=cluster_utils.REPO, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, text=True)
      intruder = bed.run("intruder", [sys.executable, "-c", stranger, master],
                         env=cluster_utils.base_env(), timeout=60)
      node1 = bed.popen("node2", LAUNCH + [
          "--nnodes", "2", "--node-rank", "1", "--master-addr", master,
          "--master-port", "29400", "--", sys.executable, TASK, "fail1"],
          env=env, cwd=cluster_utils.REPO, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, text=True)
      outs = [p.communicate(timeout=BOUND_S + 60)[0] for p in (node0, node1)]
    self.assertIn("refused:", intruder.stdout, intruder.stderr)
    self.assertIn("secret", intruder.stdout)
    self.assertEqual([node0.returncode, node1.returncode], [3, 3], outs)
    self.assertIn("turned away a connection from 198.18.0.13", outs[0])
    self.assertIn("task worker:1 on node 1 failed", outs[0])


if __name__ == "__main__":
  absltest.main()
