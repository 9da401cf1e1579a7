"""Ports, host names and cluster names, checked the way TensorFlow binds and
SLURM resolves: real sockets, real lookups, a real TensorFlow process."""

import json
import os
import socket
import sys
import threading

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist import _net
from tfdist.cluster import names
from tfdist.cluster import slurm as slurm_lib
from tfdist.errors import ConfigError

import cluster_utils

#: RFC 2606 reserves .invalid: such a name never resolves.
NOWHERE = "nohost-tfdist.invalid"


def _listener(address: str = "127.0.0.1", *, reuse_port: bool = False):
  """A listening socket; with ``reuse_port`` set up as gRPC, and so
  TensorFlow's servers, listen (SO_REUSEADDR and SO_REUSEPORT)."""
  s = socket.socket()
  if reuse_port:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
  s.bind((address, 0))
  s.listen()
  return s


@pytest.mark.beside
class PortProblemTest(parameterized.TestCase):

  def test_time_wait_of_an_earlier_server_is_free_as_for_tensorflow(self):
    server = _listener(reuse_port=True)  # An earlier run's TF server.
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # The server side closes first: its port in TIME_WAIT.
    client.recv(1)
    client.close()
    server.close()
    self.assertIsNone(_net.port_problem("127.0.0.1", port))
    with socket.socket() as plain:  # Without SO_REUSEADDR: refused.
      with self.assertRaises(OSError):
        plain.bind(("0.0.0.0", port))

  @parameterized.named_parameters(
      ("loopback_listener_asked_for_loopback", "127.0.0.1", False, "127.0.0.1"),
      ("wildcard_reuseport_listener", "0.0.0.0", True, "127.0.0.1"),
      ("loopback_listener_asked_for_this_host", "127.0.0.1", False,
       socket.gethostname()),
      ("reuseport_listener_on_loopback", "127.0.0.1", True, "127.0.0.1"),
  )
  def test_a_live_listener_is_in_use(self, listen_on, reuse_port, asked):
    with _listener(listen_on, reuse_port=reuse_port) as s:
      port = s.getsockname()[1]
      problem = _net.port_problem(asked, port)
    self.assertIsNotNone(problem)
    self.assertIn(str(port), problem)

  def test_a_free_port_is_free(self):
    port = _net.free_ports(1)[0]
    self.assertIsNone(_net.port_problem("127.0.0.1", port))

  def test_port_zero_asks_whether_the_host_is_this_machine(self):
    self.assertIsNone(_net.port_problem("127.0.0.1", 0))
    self.assertIsNotNone(_net.port_problem("198.18.0.254", 0))


@pytest.mark.beside
class GrpcAnswersTest(absltest.TestCase):
  """The probe `tfdist.serve` uses to tell that the chief is gone."""

  def test_a_listener_nobody_serves_does_not_answer(self):
    # As a socket a dead process's child inherited: it accepts, never answers.
    with socket.create_server(("127.0.0.1", 0)) as orphan:
      address = f"127.0.0.1:{orphan.getsockname()[1]}"
      self.assertTrue(_net.reachable(address))
      self.assertFalse(_net.grpc_answers(address, timeout=0.5))

  def test_a_free_port_does_not_answer(self):
    port = _net.free_ports(1)[0]
    self.assertFalse(_net.grpc_answers(f"127.0.0.1:{port}", timeout=0.5))

  def test_an_http2_server_answers(self):
    # The first bytes of an HTTP/2 server (what gRPC's are): a SETTINGS frame.
    with socket.create_server(("127.0.0.1", 0)) as server:

      def answer():
        conn, _ = server.accept()
        with conn:
          conn.recv(64)
          conn.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))

      replier = threading.Thread(target=answer, daemon=True)
      replier.start()
      self.assertTrue(_net.grpc_answers(
          f"127.0.0.1:{server.getsockname()[1]}", timeout=5))
      replier.join(5)


@pytest.mark.beside
class IsLocalTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("loopback", "127.0.0.1", True),
      ("localhost", "localhost", True),
      ("ipv6_loopback_bracketed", "[::1]", True),
      ("short_name", socket.gethostname(), True),
      ("fqdn", socket.getfqdn(), True),
      ("upper_case_with_root_dot", socket.gethostname().upper() + ".", True),
      ("benchmark_range_address_not_here", "198.18.0.254", False),
      ("unresolvable", NOWHERE, False),
  )
  def test_names_and_addresses(self, host, expected):
    self.assertEqual(_net.is_local(host), expected)

  def test_an_own_interface_address_is_local(self):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      try:
        s.connect(("198.18.0.254", 9))  # Picks a source address; sends nothing.
        own = s.getsockname()[0]
      except OSError as e:
        self.skipTest(f"this machine has no route to pick an address: {e}")
    self.assertTrue(_net.is_local(own), own)


@pytest.mark.beside
class ResolveHostTest(absltest.TestCase):

  def test_unresolvable_names_host_field_lookup_and_source(self):
    with self.assertRaises(ConfigError) as raised:
      names.resolve_host(NOWHERE, field="cluster.worker[1]",
                         source="TF_CONFIG from the environment")
    text = str(raised.exception)
    for part in (NOWHERE, "cluster.worker[1]", "TF_CONFIG from the environment",
                 "getaddrinfo", "/etc/hosts"):
      self.assertIn(part, text)

  def test_addresses_and_resolvable_names(self):
    self.assertEqual(names.resolve_host("127.0.0.1", field="f", source="s"),
                     ["127.0.0.1"])
    self.assertIn("127.0.0.1",
                  names.resolve_host("localhost", field="f", source="s"))


def _slurm_step(nodes: str = "n[9-10]", **extra: str) -> dict[str, str]:
  env = {
      "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
      "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURMD_NODENAME": "n9",
      "SLURM_STEP_NODELIST": nodes, "SLURM_STEP_NUM_NODES": "2",
      "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NUM_TASKS": "2",
      "PATH": "/nonexistent",  # No scontrol: only the aliases can help.
  }
  env.update(extra)
  return env


@pytest.mark.beside
class ResolveNamesTest(parameterized.TestCase):

  def test_slurm_node_aliases_give_node_addr(self):
    env = _slurm_step(SLURM_NODE_ALIASES="n9:198.18.0.9:n9,n10:198.18.0.10:n10")
    info = slurm_lib.resolve_slurm(env)
    port = info.cluster["worker"][0].rsplit(":", 1)[1]
    moved = names.resolve_names(info, environ=env)
    self.assertEqual(moved.cluster["worker"],
                     (f"198.18.0.9:{port}", f"198.18.0.10:{port}"))
    self.assertEqual((moved.task_type, moved.task_id), ("worker", 0))

  def test_unresolvable_slurm_node_without_node_addr_is_named(self):
    env = _slurm_step()
    with self.assertRaises(ConfigError) as raised:
      names.resolve_names(slurm_lib.resolve_slurm(env), environ=env)
    self.assertIn("'n9'", str(raised.exception))
    self.assertIn("cluster.worker[0]", str(raised.exception))

  def test_resolvable_names_are_kept(self):
    env = _slurm_step(nodes="localhost", SLURM_STEP_NUM_NODES="1",
                      SLURM_STEP_TASKS_PER_NODE="2",
                      SLURMD_NODENAME="localhost")
    info = slurm_lib.resolve_slurm(env)
    self.assertIs(names.resolve_names(info, environ=env), info)

  @parameterized.named_parameters(
      ("from_os_environ", True, "SLURM variables from the environment"),
      ("passed_mapping", False, "SLURM variables passed as environ"),
  )
  def test_slurm_runs_are_labelled_with_their_real_source(self, from_os,
                                                          label):
    env = _slurm_step()
    if not from_os:
      self.assertEqual(slurm_lib.resolve_slurm(env).origin, label)
      return
    saved = dict(os.environ)
    try:
      os.environ.update(env)
      from tfdist.cluster import resolve
      self.assertEqual(resolve.resolve_cluster(source="slurm").origin, label)
    finally:
      os.environ.clear()
      os.environ.update(saved)


@pytest.mark.timeout(180)
@pytest.mark.beside  # One short child process.
class UnresolvableClusterHostTest(absltest.TestCase):

  def test_tensorflow_task_fails_in_seconds_naming_the_host(self):
    port, other = _net.free_ports(2)
    config = {"cluster": {"worker": [f"127.0.0.1:{port}",
                                     f"{NOWHERE}:{other}"]},
              "task": {"type": "worker", "index": 0}}
    code = ("import tfdist\n"
            "tfdist.make_strategy('multi_worker_mirrored')\n")
    [result] = cluster_utils.run_processes(
        [[sys.executable, "-c", code]],
        [_net.child_env({"TF_CONFIG": json.dumps(config)})], timeout=120)
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("ConfigError", result.stderr)
    self.assertIn(NOWHERE, result.stderr)
    self.assertIn("cluster.worker[1]", result.stderr)
    self.assertNotIn("StartupTimeoutError", result.stderr)


if __name__ == "__main__":
  absltest.main()
