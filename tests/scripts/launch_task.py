"""A tiny task for launcher tests; behaviour chosen by argv[1].

Prints its role and pid first. Modes:
  ok          exit 0
  fail1       worker 1 exits 3 after 2 s (the others have printed their line
              by then), others sleep (until stopped)
  tf_fail     import TensorFlow (its start-up lines), print "something
              broke" and exit 3
  die N       worker 1 kills itself with signal N after 2 s, others sleep
  serve       chief exits 0 after 2 s (the others have printed their line by
              then); ps and workers sleep (servers)
  trap DIR    on SIGTERM, SIGINT, SIGUSR1 or SIGHUP write the signal's
              number to DIR/<role> and exit 0; sleep meanwhile
  saves R     print "ready"; on SIGTERM, SIGUSR1 or SIGINT print the line
              tfdist's tasks print after saving (at step 7) and exit as
              they do (42, or 130 for SIGINT); the task of role R ignores
              those signals instead (R "none": no task)
  flaky [K]   exit 5 on the first K runs (TFDIST_RESTART < K; K is 1 by
              default), else 0; prints when it started
  stubborn    ignore SIGTERM and SIGINT, print "ready" and sleep
  evalfail    the evaluator exits 4 after 2 s, every other task exits 0
  secret      print a digest of TFDIST_JOB_SECRET ("none" when unset)
  env         print "env=" and a JSON object of TF_CONFIG's cluster,
              CUDA_VISIBLE_DEVICES, TF_CPP_MIN_LOG_LEVEL, the host name and
              the launcher's TFDIST_* variables ("job"), then exit 0 (with
              ps tasks: the chief after 3 s, the others serve until stopped)
  envwait S   as env, then sleep S seconds and exit 0 (a round a test can
              interrupt)
  until DIR   print "job=" and a JSON object of the launcher's TFDIST_*
              variables and the cluster's worker count, then exit 0 once
              DIR/end exists; SIGTERM is ignored while the file named by
              DEAF_WHILE (when set) exists
  progress    worker 0 draws a progress bar of 5 states as Keras's does
              (backspaces, a carriage return, the state; a newline at the
              end), worker 1 prints 3 lines meanwhile; then exit 0
  keras_bar   worker 0 runs a real keras.utils.Progbar over 4 steps
  grpc        start TensorFlow's gRPC server for this task and print the
              address it listens on: "bound=wildcard" for every interface
"""

import hashlib
import json
import os
import signal
import sys
import time

task = json.loads(os.environ["TF_CONFIG"])["task"]
role = f"{task['type']}:{task['index']}"
restart = int(os.environ["TFDIST_RESTART"])
print(f"role={role} pid={os.getpid()} restart={restart}", flush=True)
mode = sys.argv[1]


def sleep_forever():
  deadline = time.monotonic() + 120  # Bounded even if nobody stops us.
  while time.monotonic() < deadline:
    time.sleep(0.05)
  sys.exit(9)


if mode == "ok":
  sys.exit(0)
if mode == "progress":
  if role == "worker:0":
    width = 0
    for i in range(1, 6):
      state = f"{i}/5 [{'=' * i}{'.' * (5 - i)}] - loss: {1 / i:.4f}"
      sys.stdout.write("\b" * width + "\r" + state)
      sys.stdout.flush()
      width = len(state)
      time.sleep(0.05)
    sys.stdout.write("\n")
  else:
    for i in range(3):
      print(f"line {i}", flush=True)
      time.sleep(0.06)
  sys.exit(0)
if mode == "keras_bar":
  if role == "worker:0":
    import keras  # pylint: disable=g-import-not-at-top
    bar = keras.utils.Progbar(4)
    for i in range(1, 5):
      bar.update(i, values=[("loss", 1.0 / i)])
  sys.exit(0)
JOB = {name: os.environ.get(name) for name in (
    "TFDIST_RESTART", "TFDIST_RESTART_COUNT", "TFDIST_MAX_RESTARTS",
    "TFDIST_RUN_ID", "TFDIST_NNODES")}
if mode in ("env", "envwait"):
  import socket
  print("env=" + json.dumps({
      "cluster": json.loads(os.environ["TF_CONFIG"])["cluster"],
      "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
      "log_level": os.environ.get("TF_CPP_MIN_LOG_LEVEL"),
      "hostname": socket.gethostname(), "job": JOB}), flush=True)
  if "ps" in json.loads(os.environ["TF_CONFIG"])["cluster"]:
    if task["type"] != "chief":
      sleep_forever()  # A server, until the chief is done.
    time.sleep(3)  # The servers print meanwhile.
  if mode == "envwait":
    time.sleep(float(sys.argv[2]))
  sys.exit(0)
if mode == "until":
  deaf = os.environ.get("DEAF_WHILE")
  signal.signal(signal.SIGTERM, lambda signum, frame: None if deaf and
                os.path.exists(deaf) else sys.exit(143))
  workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
  print("job=" + json.dumps({**JOB, "workers": workers}), flush=True)
  deadline = time.monotonic() + 150  # Bounded even if nobody ends it.
  while not os.path.exists(os.path.join(sys.argv[2], "end")):
    if time.monotonic() > deadline:
      sys.exit(9)
    time.sleep(0.25)
  sys.exit(0)
if mode == "fail1":
  if role == "worker:1":
    time.sleep(2)
    print("something broke", flush=True)
    sys.exit(3)
  sleep_forever()
if mode == "tf_fail":
  import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
  print("something broke", flush=True)
  sys.exit(3)
if mode == "die":
  if role == "worker:1":
    time.sleep(2)
    os.kill(os.getpid(), int(sys.argv[2]))
  sleep_forever()
if mode == "serve":
  if task["type"] == "chief":
    time.sleep(2)
    sys.exit(0)
  sleep_forever()
if mode == "trap":
  def on_signal(signum, frame):
    with open(os.path.join(sys.argv[2], role), "w") as f:
      f.write(str(signum))
    sys.exit(0)
  for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
    signal.signal(s, on_signal)
  print("ready", flush=True)
  sleep_forever()
if mode == "saves":
  def on_signal(signum, frame):
    code = 130 if signum == signal.SIGINT else 42
    print(f"WARNING:absl:tfdist: checkpoint saved at step 7; exiting with "
          f"code {code}", flush=True)
    sys.exit(code)
  for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(s, signal.SIG_IGN if role == sys.argv[2] else on_signal)
  print("ready", flush=True)
  sleep_forever()
if mode == "stubborn":
  for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, signal.SIG_IGN)
  print("ready", flush=True)
  sleep_forever()
if mode == "flaky":
  print(f"started at {time.time():.3f}", flush=True)
  failures = int(sys.argv[2]) if len(sys.argv) > 2 else 1
  sys.exit(5 if restart < failures else 0)
if mode == "evalfail":
  if task["type"] == "evaluator":
    time.sleep(2)
    sys.exit(4)
  sys.exit(0)
if mode == "secret":
  secret = os.environ.get("TFDIST_JOB_SECRET")
  print("secret=" + (hashlib.sha256(secret.encode()).hexdigest()[:16]
                     if secret else "none"), flush=True)
  sys.exit(0)
if mode == "grpc":
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
  tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=task["type"],
                       task_index=task["index"], protocol="grpc")
  port = int(cluster[task["type"]][task["index"]].rsplit(":", 1)[1])
  for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(table) as f:
      for line in f.read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, local_port = local.rsplit(":", 1)
        if int(local_port, 16) == port and state == "0A":  # LISTEN.
          print("bound=" + ("wildcard" if set(address) == {"0"} else address),
                flush=True)
  sys.exit(0)
sys.exit(f"unknown mode {mode}")
