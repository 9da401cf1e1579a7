"""Installs the Debian packages a test harness needs, once per machine.

Both xdist workers collect every module, and the harnesses check (and, as
root, install) their packages at collection. Two ``apt-get update`` side by
side fail on apt's lock, so one worker's collection raised and the two
workers' collections differed: the whole run stopped at collection (seen on a
fresh machine with neither SLURM nor munge installed). `install` holds an
exclusive `fcntl.flock` on this module's own file (so it writes no lock file)
while it works, and asks the caller again, under the lock, what is still
missing: the second worker finds the first one's packages in place and
installs nothing. apt-get also waits (up to the same bound) for an apt it did
not start, such as the system's own updates.

Example::

  apt_install.install(
      lambda: () if shutil.which("munged") else ("munge",), error=SlurmError)
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from typing import Callable, Sequence

__all__ = ["install"]

_TIMEOUT_S = 900


def install(missing: Callable[[], Sequence[str]], *,
            error: type[Exception]) -> None:
  """Installs the packages ``missing()`` names, if it still names any.

  Args:
    missing: the Debian packages still missing; called again under the lock.
    error: what a failed ``apt-get`` raises (the harness's own error).

  Raises:
    error: ``apt-get`` failed; its output's tail is in the message.
  """
  env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
  with open(__file__, "rb") as lock:  # Both workers run this checkout.
    fcntl.flock(lock, fcntl.LOCK_EX)  # Bounded: the holder's apt-get is.
    packages = sorted(set(missing()))
    if not packages:
      return
    wait = f"DPkg::Lock::Timeout={_TIMEOUT_S}"
    for cmd in (["apt-get", "-o", wait, "update"],
                ["apt-get", "-o", wait, "install", "-y",
                 "--no-install-recommends", *packages]):
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                            timeout=_TIMEOUT_S, check=False)
      if proc.returncode != 0:
        raise error(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                    f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
