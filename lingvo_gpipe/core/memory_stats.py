"""The CPU allocator's peak, the reference every memory figure and test is measured against.

TensorFlow keeps allocator statistics on the CPU only when its CPU allocator is
a BFC allocator: by default that is so with oneDNN on (most Intel CPUs) and not
otherwise (e.g. AMD EPYC). `EnableStats()` asks for it explicitly; it must run
before TensorFlow's first op creates the allocator. All logical CPU devices
share the one allocator, so 'CPU:0' sees the whole process.
"""

import os

import tensorflow as tf

_ENV = 'TF_CPU_ALLOCATOR_USE_BFC'


def EnableStats():
  """Asks for a CPU allocator that keeps statistics (unless the user set _ENV)."""
  os.environ.setdefault(_ENV, 'true')


def PeakBytes(fn, device='CPU:0'):
  """(fn()'s result, the allocator's peak bytes while fn ran above the bytes live before)."""
  try:
    tf.config.experimental.reset_memory_stats(device)
  except ValueError as e:
    raise RuntimeError(
        f'The allocator of {device} keeps no statistics, so peak memory cannot be measured: '
        f'call lingvo_gpipe.core.memory_stats.EnableStats() (or set {_ENV}=true) before '
        f'TensorFlow runs its first op.') from e
  live = tf.config.experimental.get_memory_info(device)['current']
  result = fn()
  return result, tf.config.experimental.get_memory_info(device)['peak'] - live
