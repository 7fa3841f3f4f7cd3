"""Test set-up: quiet TensorFlow, allocator statistics, four logical CPU devices for pipelines.

The suite runs in pytest-xdist workers (setup.cfg: one per core, each file's tests in one
worker, so a module's fixture is built once). A worker sets TensorFlow up while pytest
imports this file, under pytest's capture, which keeps the lines TensorFlow prints while
its libraries load (no log level silences them) out of the output. The controlling process
runs no test and never loads TensorFlow; with `-n 0` the tests run in this process, which
sets TensorFlow up once pytest is configured.
"""

import os

NUM_TEST_DEVICES = 4
_WORKER = 'PYTEST_XDIST_WORKER' in os.environ


def _SetUpTensorFlow():
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.foundation import memory_stats  # pylint: disable=g-import-not-at-top
  memory_stats.EnableStats()
  cpus = tf.config.list_physical_devices('CPU')
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_TEST_DEVICES)


if _WORKER:
  _SetUpTensorFlow()


def pytest_configure(config):
  if not _WORKER and not getattr(config.option, 'numprocesses', None):
    _SetUpTensorFlow()
