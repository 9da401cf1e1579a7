"""What a node's fingerprint costs at start-up, beside one TensorFlow and
Keras import in the same run (docs/multi_node.md, "The same program").

  .venv/bin/python tests/scripts/fingerprint_cost.py
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

from tfdist.launch import fingerprint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _seconds(fn, n):
  start = time.perf_counter()
  for _ in range(n):
    fn()
  return (time.perf_counter() - start) / n


def main():
  folder = tempfile.mkdtemp()
  try:
    for i in range(20):  # 20 local modules of 300 lines.
      with open(os.path.join(folder, f"m{i}.py"), "w") as f:
        f.write("\n".join(f"def f{j}(x):\n  return x + {j}"
                          for j in range(150)))
    with open(os.path.join(folder, "train.py"), "w") as f:
      f.write("\n".join(f"import m{i}" for i in range(20)))
    example = _seconds(lambda: fingerprint.take(
        [sys.executable, os.path.join(REPO, "examples", "keras_fit.py")]), 10)
    local = _seconds(lambda: fingerprint.take(
        [sys.executable, "train.py"], cwd=folder), 10)
  finally:
    shutil.rmtree(folder)
  tf = _seconds(lambda: subprocess.run(
      [sys.executable, "-c", "import tensorflow, keras"], check=True,
      capture_output=True), 2)
  print(f"examples/keras_fit.py: {example / tf:.4f} of a TensorFlow and Keras "
        f"import; a script with 20 local modules: {local / tf:.3f}")


if __name__ == "__main__":
  main()
