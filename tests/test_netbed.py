"""The multi-host test bed itself: hosts, names, links, and nothing left."""

import os
import subprocess
import sys

from absl.testing import absltest
import pytest

import netbed

_REASON = netbed.netbed_unavailable_reason()
_ECHO = ("import socket,sys\n"
         "s=socket.socket();s.bind(('0.0.0.0',7000));s.listen(1)\n"
         "c,a=s.accept();c.sendall(socket.gethostname().encode()+b' '+"
         "a[0].encode());c.close()\n")
_ASK = ("import socket,sys,time\n"
        "for i in range(100):\n"
        "  try:\n"
        "    s=socket.create_connection((sys.argv[1],7000),timeout=5);break\n"
        "  except OSError: time.sleep(0.1)\n"
        "print(s.recv(100).decode())\n")


def _links() -> str:
  return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                        timeout=30, check=True).stdout


@pytest.mark.timeout(120)
@absltest.skipIf(_REASON is not None, _REASON)
class NetBedTest(absltest.TestCase):

  def test_hosts_reach_each_other_by_name_and_address_and_leave_nothing(self):
    before = _links()
    with netbed.NetBed(hosts=("node1", "node2")) as bed:
      server = bed.popen("node2", [sys.executable, "-c", _ECHO])
      answer = bed.run("node1", [sys.executable, "-c", _ASK, "node2"],
                       timeout=60)
      self.assertEqual(answer.stdout.split(), ["node2", "198.18.0.11"],
                       answer.stderr)
      server.wait(timeout=30)
      names = {h: bed.run(h, ["hostname"], timeout=30).stdout.strip()
               for h in bed.hosts}
      self.assertEqual(names, {"node1": "node1", "node2": "node2"})
      route = bed.run("node1", ["ip", "route", "show", "default"], timeout=30)
      self.assertEqual(route.stdout.strip(), "")  # No default route.
      self.assertEqual(_links(), before)  # Nothing in the root namespace.
      marked = [n for n in netbed._namespaces()
                if n.startswith(f"tfdist-{os.getpid()}-")]
      self.assertLen(marked, 3)  # The switch and two hosts.
    self.assertEqual([n for n in netbed._namespaces()
                      if n.startswith(f"tfdist-{os.getpid()}-")], [])
    self.assertEqual(_links(), before)

  def test_unresolvable_bed_resolves_only_itself(self):
    with netbed.NetBed(hosts=("node1", "node2"), resolvable=False) as bed:
      own = bed.run("node1", ["getent", "hosts", "node1"], timeout=30)
      other = bed.run("node1", ["getent", "hosts", "node2"], timeout=30)
    self.assertIn("198.18.0.11", own.stdout)
    self.assertNotEqual(other.returncode, 0)

  def test_rate_shapes_the_link_with_tbf(self):
    with netbed.NetBed(hosts=("node1",), rate="1gbit") as bed:
      qdisc = bed.run("node1", ["tc", "qdisc", "show", "dev", "eth0"],
                      timeout=30)
    self.assertIn("tbf", qdisc.stdout)
    self.assertIn("1Gbit", qdisc.stdout)

  def test_leftovers_of_dead_runs_go_and_live_ones_stay(self):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale, live = f"tfdist-{dead.pid}-old", f"tfdist-{os.getppid()}-live"
    for name in (stale, live):
      subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
      removed = netbed.sweep_leftovers()
      left = netbed._namespaces()
      self.assertIn(stale, removed)
      self.assertNotIn(stale, left)
      self.assertIn(live, left)
    finally:
      for name in (stale, live):
        subprocess.run(["ip", "netns", "del", name], timeout=30,
                       capture_output=True)


if __name__ == "__main__":
  absltest.main()
