"""`tfdist.notebook_launcher`: a function from a notebook cell on N workers.

Each test runs a driver as ``python -c``, so the function lives in
``__main__`` as in a notebook cell and travels by value.
"""

import json
import re
import signal
import sys
import textwrap

from absl.testing import absltest
import pytest

import cluster_utils

_ALLREDUCE = textwrap.dedent("""
    import json, tfdist

    def train(scale):
      import tensorflow as tf
      import tfdist
      strategy = tfdist.make_strategy("multi_worker_mirrored")
      ctx = tfdist.resolve_cluster()
      value = strategy.reduce(
          tf.distribute.ReduceOp.SUM,
          strategy.run(lambda: tf.constant(scale * (ctx.task_id + 1.0))),
          axis=None)
      print(f"task {ctx.task_id} done", flush=True)
      return {"sum": float(value), "task": ctx.task_id}

    print("RESULT " + json.dumps(tfdist.notebook_launcher(train, (10.0,))))
""")

_RAISES = textwrap.dedent("""
    import json, os, tfdist

    def train():
      task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
      if task == 1:
        raise ValueError("bad batch on worker 1")
      import time; time.sleep(30)

    try:
      tfdist.notebook_launcher(train)
    except tfdist.WorkerFailedError as e:
      print("RESULT " + json.dumps({"role": e.role, "code": e.code,
                                    "trace": e.remote_traceback}))
""")

_INTERRUPTED = textwrap.dedent("""
    import os, time, tfdist

    def train():
      print(f"pid={os.getpid()} ready", flush=True)
      time.sleep(60)

    try:
      tfdist.notebook_launcher(train)
    except KeyboardInterrupt:
      print("RESULT interrupted", flush=True)
""")


_PREEMPTED = textwrap.dedent("""
    import json, tempfile, tfdist

    def train(backup_dir):
      import os, signal
      import keras, numpy as np, tfdist
      strategy = tfdist.make_strategy()
      with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")

      class Preempt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
          if batch == 2:  # As a cloud VM's preemption does.
            os.kill(os.getpid(), signal.SIGTERM)

      x = np.ones((64, 2), "float32")
      tfdist.fit(model, x, x[:, :1], batch_size=8, epochs=2, verbose=0,
                 callbacks=[Preempt()], backup_dir=backup_dir)

    with tempfile.TemporaryDirectory() as d:
      try:
        tfdist.notebook_launcher(train, (d + "/b",), num_workers=1)
      except tfdist.WorkerFailedError as e:
        print("RESULT " + json.dumps({"role": e.role, "code": e.code,
                                      "message": str(e)}))
""")


def _driver(code):
  return cluster_utils.Tasks(commands=[[sys.executable, "-c", code]],
                             envs=[cluster_utils.base_env()],
                             cwd=cluster_utils.REPO, merge_stderr=True)


@pytest.mark.timeout(240)
class NotebookLauncherTest(absltest.TestCase):

  def _run(self, code, timeout):
    """The driver's output and the JSON object it printed after RESULT."""
    with _driver(code) as tasks:
      exit_code = tasks.wait(0, timeout)
      out = tasks.stdout(0)
    self.assertEqual(exit_code, 0, out)
    return out, json.loads(re.search(r"RESULT (\{.*\})", out).group(1))

  def test_returns_the_chiefs_value_after_a_real_all_reduce(self):
    out, result = self._run(_ALLREDUCE, 180)
    self.assertEqual(result, {"sum": 30.0, "task": 0})
    self.assertIn("[worker:1] task 1 done", out)  # Streamed with its role.

  def test_a_worker_that_raises_is_named_with_its_traceback(self):
    out, result = self._run(_RAISES, 120)
    self.assertEqual((result["role"], result["code"]), ("worker:1", 1))
    self.assertIn("ValueError: bad batch on worker 1", result["trace"])

  def test_a_preempted_worker_says_where_it_saved(self):
    out, result = self._run(_PREEMPTED, 180)
    self.assertEqual((result["role"], result["code"]), ("worker:0", 42))
    self.assertRegex(result["message"],
                     r"^worker:0 was preempted and saved at step \d+ in \S+; "
                     "call notebook_launcher again to resume$")
    # The cell's stream says the same as the error: no command to run again.
    self.assertRegex(out, r"tfdist: worker:0 was preempted and saved at step "
                     r"\d+ in \S+; call notebook_launcher again to resume\n")

  def test_interrupting_the_cell_stops_every_worker(self):
    with _driver(_INTERRUPTED) as tasks:
      for _ in range(2):
        tasks.wait_for(0, lambda line: "ready" in line, 60)
      ready = cluster_utils.wait_until(
          lambda: tasks.stdout(0).count("ready") == 2, 60)
      self.assertTrue(ready, tasks.stdout(0))
      pids = [int(p) for p in re.findall(r"pid=(\d+)", tasks.stdout(0))]
      tasks.signal(0, signal.SIGINT)
      code = tasks.wait(0, 60)
      out = tasks.stdout(0)
    self.assertEqual(code, 0, out)
    self.assertIn("RESULT interrupted", out)
    self.assertEqual([p for p in pids if cluster_utils.alive(p)], [])


if __name__ == "__main__":
  absltest.main()
