"""Trains a small deterministic model with tfdist's Runner; prints JSON.

Usage: runner_job.py STRATEGY STEPS [--ckpt DIR] [--summary DIR]
  [--steps-per-loop K] [--ps-local WORKERS] [--devices LIST]
  [+ STRATEGY STEPS [options] ...]

Each run (runs are separated by ``+``) trains a fresh model under a strategy
of its own and prints one JSON line; every run's ``--devices`` must name as
many devices as the first's (the CPU is split once, at start-up).
"""

import argparse
import itertools
import json
import sys

import job_common
import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("strategy")
parser.add_argument("steps", type=int)
parser.add_argument("--ckpt")
parser.add_argument("--summary")
parser.add_argument("--steps-per-loop", type=int, default=2)
parser.add_argument("--ps-local", type=int, default=0)
parser.add_argument("--devices", default="")


def run(args, options):
  """Trains under the strategy ``args`` names; prints one JSON line."""
  cluster = (job_common.local_ps_cluster(args.ps_local)
             if args.ps_local else None)
  strategy = tfdist.make_strategy(args.strategy, cluster=cluster, **options)

  import keras  # pylint: disable=g-import-not-at-top

  x, y = job_common.data(512)
  with strategy.scope():
    model = job_common.model()
    optimizer = keras.optimizers.SGD(0.05)
    optimizer.build(model.trainable_variables)
    mae = keras.metrics.MeanAbsoluteError(name="mae")

  loss_fn = keras.losses.MeanSquaredError(reduction=None)
  step = tfdist.supervised_step(model, optimizer, loss_fn,
                                global_batch_size=job_common.GLOBAL_BATCH,
                                metrics=[mae])
  runner = tfdist.Runner(
      strategy=strategy, train_step=step,
      train_data=job_common.dataset_fn(x, y),
      checkpoint_items={"model": model, "optimizer": optimizer},
      metrics=[mae],
      options=tfdist.RunnerOptions(
          steps_per_loop=args.steps_per_loop, checkpoint_dir=args.ckpt,
          checkpoint_every=3 if args.ckpt else 0, summary_dir=args.summary,
          ps_synchronous=True))
  start_step = runner.step
  logs = runner.train(args.steps)
  print(json.dumps({"weights": job_common.weights(model),
                    "start_step": start_step, "step": runner.step,
                    "logs": logs, "replicas": strategy.num_replicas_in_sync}),
        flush=True)


runs = [parser.parse_args(list(group)) for plus, group in itertools.groupby(
    sys.argv[1:], lambda a: a == "+") if not plus]
# Splits the CPU once, before any other TensorFlow work.
job_common.strategy_options("", max((r.devices for r in runs), key=len))
for run_args in runs:
  key = ("compute_devices" if run_args.strategy == "central_storage"
         else "devices")
  run(run_args, {key: run_args.devices.split(",")} if run_args.devices else {})
