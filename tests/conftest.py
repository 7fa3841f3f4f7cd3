"""Test set-up: quiet TensorFlow, allocator statistics, four logical CPU devices for pipelines."""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top

from lingvo_gpipe.core import memory_stats  # pylint: disable=g-import-not-at-top

memory_stats.EnableStats()

NUM_TEST_DEVICES = 4

_cpus = tf.config.list_physical_devices('CPU')
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_TEST_DEVICES)
