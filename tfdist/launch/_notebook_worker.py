"""One worker of `tfdist.launch.notebook.notebook_launcher`.

``python -m tfdist.launch._notebook_worker PAYLOAD``: loads ``(function,
args)`` from ``PAYLOAD/call.pkl``, calls it, and on the chief (task index 0)
writes the result to ``PAYLOAD/result.pkl`` (atomically). A raised exception
is written, as its traceback, to ``PAYLOAD/error-TYPE-INDEX.txt``, and the
worker exits 1; a `tfdist.PreemptedError`, as its message, to
``PAYLOAD/preempted-TYPE-INDEX.txt``, and the worker exits with its code.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from tfdist.errors import PreemptedError


def main(payload: str) -> int:
  import cloudpickle  # pylint: disable=g-import-not-at-top
  task = json.loads(os.environ["TF_CONFIG"])["task"]
  try:
    with open(os.path.join(payload, "call.pkl"), "rb") as f:
      function, args = cloudpickle.loads(f.read())
    result = function(*args)
  except PreemptedError as e:
    with open(os.path.join(payload, f"preempted-{task['type']}-"
                           f"{task['index']}.txt"), "w") as f:
      f.write(str(e))
    raise
  except Exception:  # pylint: disable=broad-except
    path = os.path.join(payload, f"error-{task['type']}-{task['index']}.txt")
    with open(path, "w") as f:
      f.write(traceback.format_exc())
    traceback.print_exc()
    return 1
  if task["index"] == 0:
    tmp = os.path.join(payload, f"result.pkl.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
      f.write(cloudpickle.dumps(result))
    os.replace(tmp, os.path.join(payload, "result.pkl"))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
