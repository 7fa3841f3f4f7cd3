"""Drops the lines TensorFlow's C++ runtime logs for an eager op that failed, in a block
that expects such failures: the loss probe (loss_probe.MicroBatchLoss) tries labels that a
loss may reject (-1, 255), takes the failure as an exception, and goes on; the lines
(`OP_REQUIRES failed ... label value of -1`) would tell the user their labels were bad.

Within the block, the process's stderr goes through log_filter.py, a process of its own
that forwards every other line as it comes (also if this process dies in the block).
A failed op's warning of another thread in the block is dropped too; its exception is
not. Where stdout and stderr go to one file, the block's stderr lines may come after stdout
lines written later. Nothing is redirected where TF_CPP_MIN_LOG_LEVEL (read once, when
TensorFlow loads) hides warnings anyway, nor where there is no stderr or no Python to run
the filter with.
"""

import contextlib
import threading

from lingvo_gpipe.foundation import log_filter

# One block redirects stderr at a time (another thread's would restore it early), and a
# block within a block (a probed loss that probes a loss of its own) redirects nothing.
_LOCK = threading.Lock()
_IN_BLOCK = threading.local()


@contextlib.contextmanager
def Dropped():
  """Within the block, failed ops' warnings are dropped; other stderr lines are forwarded."""
  level = log_filter.LogLevel()
  if level >= 2 or getattr(_IN_BLOCK, 'active', False):
    yield
    return
  with _LOCK:
    _IN_BLOCK.active = True
    try:
      with log_filter.Filtered(level, drop_failed_ops=True):
        yield
    finally:
      _IN_BLOCK.active = False
