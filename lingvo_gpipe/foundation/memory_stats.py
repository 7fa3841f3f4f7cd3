"""An allocator's peak, the reference every memory figure and test is measured against.

Each GPU has its own allocator (with statistics); all logical CPU devices of a
process share one, so 'CPU:0' sees the whole process, and a stage's own memory
only when each stage is a worker process. By default these functions read this
process's first GPU's allocator, else its CPU's.

TensorFlow keeps allocator statistics on the CPU only when its CPU allocator is
a BFC allocator: by default that is so with oneDNN on (most Intel CPUs) and not
otherwise (e.g. AMD EPYC). `EnableStats()` asks for it explicitly; it must run
before TensorFlow's first op creates the allocator.
"""

import os
import time

import tensorflow as tf

_ENV = 'TF_CPU_ALLOCATOR_USE_BFC'


def EnableStats():
  """Asks for a CPU allocator that keeps statistics (unless the user set _ENV)."""
  os.environ.setdefault(_ENV, 'true')


def _Default(device):
  """`device`, or this process's first GPU (where its ops run by default), else its CPU."""
  if device is not None:
    return device
  gpus = [d.name for d in tf.config.list_logical_devices('GPU') if '/job:worker' not in d.name]
  return gpus[0] if gpus else 'CPU:0'


def _Checked(call, device):
  """call(device), with a clear error when the allocator keeps no statistics."""
  try:
    return call(device)
  except ValueError as e:
    raise RuntimeError(
        f'The allocator of {device} keeps no statistics, so peak memory cannot be measured: '
        f'call lingvo_gpipe.foundation.memory_stats.EnableStats() (or set {_ENV}=true) before '
        f'TensorFlow runs its first op.') from e


def PeakBytes(fn, device=None):
  """(fn()'s result, the allocator's peak bytes while fn ran above the bytes live before)."""
  device = _Default(device)
  _Checked(tf.config.experimental.reset_memory_stats, device)
  live = tf.config.experimental.get_memory_info(device)['current']
  result = fn()
  return result, tf.config.experimental.get_memory_info(device)['peak'] - live


# The line a worker logs (LogForever) and LoggedSince reads.
_HEAD = 'allocator bytes:'
_LOGGED = _HEAD + ' current={current} peak={peak} time={time:.6f}'


def LogForever(interval_secs, device=None):
  """Logs the allocator's current and peak bytes every interval_secs when they changed.

  A worker process serving one pipeline stage has the allocator to itself: its
  peak is that device's, which logical devices sharing one process cannot show
  (tools/memory_curves.py --per_device reads the log with LoggedSince). The peak
  statistic is reset after each check, so a line's peak is the most allocated
  since the check before (the process's whole past for the first line) and a
  reader can take the peak of any stretch of time, e.g. leave out a first,
  tracing step.
  """
  from absl import logging  # pylint: disable=g-import-not-at-top
  device = _Default(device)
  last = None
  while True:
    info = _Checked(tf.config.experimental.get_memory_info, device)
    tf.config.experimental.reset_memory_stats(device)
    now = (info['current'], info['peak'])
    if now != last:
      logging.info(_LOGGED.format(current=now[0], peak=now[1], time=time.time()))
      last = now
    time.sleep(interval_secs)


def LoggedSince(text, start=0.0):
  """(current bytes of the last LogForever line in a log's text, the most allocated in
  the lines logged after `start`, a time.time()): the peak from then on, give or take the
  logging interval before `start`. No line after `start` means nothing changed: the peak
  is the last current."""
  lines = [line[line.index(_HEAD) + len(_HEAD):] for line in text.splitlines() if _HEAD in line]
  if not lines:
    raise ValueError(f'No {_HEAD!r} line in the log (was --worker_memory_log_secs set?).')
  logged = [dict(part.split('=') for part in line.split()) for line in lines]
  current = int(logged[-1]['current'])
  return current, max([int(fields['peak']) for fields in logged if float(fields['time']) > start],
                      default=current)
