"""Test-session set-up: split the CPU into 2 logical devices.

Single-process strategies (Mirrored, CentralStorage) get 2 replicas this way.
Multi-worker and parameter-server tests run in their own processes, started,
watched and ended by the one live-cluster harness, tests/cluster_utils.py
(`cluster_utils.Tasks`), because collective ops must be configured before
TensorFlow starts and a process can join only one cluster.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
