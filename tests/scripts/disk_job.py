"""A job whose backups fill a small filesystem: tfdist.fit of a 3 MB model.

Usage: disk_job.py DIR. Three epochs of 8 steps, a backup in DIR every 2
steps; each backup is 3.1 MB (Dense 768 -> 1000 -> 1, plain SGD), so with
the two kept an 8 MB filesystem is full at the third.
"""

import sys

import keras
import numpy as np

import tfdist

STEPS, EPOCHS, BATCH = 8, 3, 8


def model() -> keras.Model:
  m = keras.Sequential([keras.Input((768,)), keras.layers.Dense(1000),
                        keras.layers.Dense(1)])
  m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
  return m


def fit(m: keras.Model, backup_dir: str, **kwargs) -> keras.callbacks.History:
  rng = np.random.default_rng(0)
  x = rng.random((STEPS * BATCH, 768), "float32")
  return tfdist.fit(m, x, x[:, :1], batch_size=BATCH, epochs=EPOCHS,
                    backup_dir=backup_dir, backup_every_steps=2, verbose=0,
                    **kwargs)


if __name__ == "__main__":
  with tfdist.make_strategy().scope():
    job_model = model()
  fit(job_model, sys.argv[1])
  print("trained", flush=True)
