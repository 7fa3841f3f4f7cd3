"""memory_stats: the peak of a known allocation, and a clear error without statistics."""

import os
import subprocess
import sys

import tensorflow as tf

from lingvo_gpipe.core import memory_stats


def testPeakIsTheBytesOfATemporaryAboveTheLiveSet():
  kept = tf.ones([256, 256])  # Live before: not counted.

  def Fn():
    temporary = tf.ones([1024, 1024]) * 2.0  # 4 MiB, freed when Fn returns.
    return float(tf.reduce_sum(temporary) + tf.reduce_sum(kept))

  total, peak = memory_stats.PeakBytes(Fn)
  assert total == 2.0 * 1024 * 1024 + 256 * 256
  assert 4 * 2**20 <= peak < 3 * 4 * 2**20


def testWithoutStatisticsTheErrorSaysHowToTurnThemOn():
  code = ('import tensorflow as tf\n'
          'from lingvo_gpipe.core import memory_stats\n'
          'memory_stats.PeakBytes(lambda: tf.ones([2]))\n')
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='false', TF_ENABLE_ONEDNN_OPTS='0',
             TF_CPP_MIN_LOG_LEVEL='3')
  proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                        timeout=120, check=False)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      'RuntimeError: The allocator of CPU:0 keeps no statistics, so peak memory cannot be '
      'measured: call lingvo_gpipe.core.memory_stats.EnableStats() (or set '
      'TF_CPU_ALLOCATOR_USE_BFC=true) before TensorFlow runs its first op.')
