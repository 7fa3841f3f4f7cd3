"""memory_stats: the peak of a known allocation, and a clear error without statistics."""

import os
import subprocess
import sys

import pytest

from lingvo_gpipe.foundation import memory_stats


def testPeakIsTheBytesOfATemporaryAboveTheLiveSet():
  """In a process of its own: the allocator is the process's, and threads other tests left
  running (in the suite's process, once 1.4 MiB over the bound) would count too."""
  code = ('import tensorflow as tf\n'
          'from lingvo_gpipe.foundation import memory_stats\n'
          'kept = tf.ones([256, 256])\n'  # Live before: not counted.
          'def Fn():\n'
          '  temporary = tf.ones([1024, 1024]) * 2.0\n'  # 4 MiB, freed when Fn returns.
          '  return float(tf.reduce_sum(temporary) + tf.reduce_sum(kept))\n'
          'print(*memory_stats.PeakBytes(Fn))\n')
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true', TF_CPP_MIN_LOG_LEVEL='2')
  proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                        timeout=120, check=True)
  total, peak = proc.stdout.split()
  assert float(total) == 2.0 * 1024 * 1024 + 256 * 256
  assert 4 * 2**20 <= int(peak) < 3 * 4 * 2**20


def testWithoutStatisticsTheErrorSaysHowToTurnThemOn():
  code = ('import tensorflow as tf\n'
          'from lingvo_gpipe.foundation import memory_stats\n'
          'memory_stats.PeakBytes(lambda: tf.ones([2]))\n')
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='false', TF_ENABLE_ONEDNN_OPTS='0',
             TF_CPP_MIN_LOG_LEVEL='3')
  proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                        timeout=120, check=False)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      'RuntimeError: The allocator of CPU:0 keeps no statistics, so peak memory cannot be '
      'measured: call lingvo_gpipe.foundation.memory_stats.EnableStats() (or set '
      'TF_CPU_ALLOCATOR_USE_BFC=true) before TensorFlow runs its first op.')


def testLogForeverLogsWhatLoggedSinceReads():
  """A worker's memory log: the allocator's current bytes and its peak since the check before,
  read back from the log over all of it or from a time on."""
  code = ('import threading, time\n'
          'from absl import logging\n'
          'import tensorflow as tf\n'
          'from lingvo_gpipe.foundation import memory_stats\n'
          'kept = tf.ones([1024, 1024])\n'  # 4 MiB live.
          'tf.reduce_sum(tf.ones([2048, 1024]) * 2.0).numpy()\n'  # 8 MiB more, freed.
          'logging.set_verbosity(logging.INFO)\n'  # As in a worker run by the trainer.
          'threading.Thread(target=memory_stats.LogForever, args=(0.01,), daemon=True).start()\n'
          'time.sleep(0.3)\n'
          'print(time.time(), flush=True)\n'
          'tf.reduce_sum(tf.ones([4096, 1024]) * 2.0).numpy()\n'  # 16 MiB more, freed.
          'time.sleep(0.3)\n'
          'print(time.time(), flush=True)\n'
          'time.sleep(0.3)\n')
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true', TF_CPP_MIN_LOG_LEVEL='2')
  proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                        timeout=120, check=True)
  before, after = map(float, proc.stdout.split())
  current, peak = memory_stats.LoggedSince(proc.stderr)
  assert 4 * 2**20 <= current < 8 * 2**20
  assert current + 16 * 2**20 <= peak
  assert memory_stats.LoggedSince(proc.stderr, before) == (current, peak)
  # From after the 16 MiB on, nothing but what is kept.
  assert memory_stats.LoggedSince(proc.stderr, after) == (current, current)


def testLoggedSinceNamesTheMissingLine():
  with pytest.raises(ValueError, match="No 'allocator bytes:' line.*worker_memory_log_secs"):
    memory_stats.LoggedSince('I1126 worker task 0 serving\n')
