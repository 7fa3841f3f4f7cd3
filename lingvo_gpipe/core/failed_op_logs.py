"""Drops the lines TensorFlow's C++ runtime logs for an eager op that failed, in a block
that expects such failures: the loss probe (metrics.MicroBatchLoss) tries labels that a
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
import os
import subprocess
import sys
import threading

_LOG_FILTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           'log_filter.py')
# One block redirects stderr at a time (another thread's would restore it early), and a
# block within a block (a probed loss that probes a loss of its own) redirects nothing.
_LOCK = threading.Lock()
_IN_BLOCK = threading.local()


def _Level():
  level = os.environ.get('TF_CPP_MIN_LOG_LEVEL', '0')
  return int(level) if level.isdigit() else 0


@contextlib.contextmanager
def Dropped():
  """Within the block, failed ops' warnings are dropped; other stderr lines are forwarded."""
  if _Level() >= 2 or getattr(_IN_BLOCK, 'active', False):
    yield
    return
  with _LOCK:
    _IN_BLOCK.active = True
    try:
      with _Redirected():
        yield
    finally:
      _IN_BLOCK.active = False


def _FlushStderr():
  try:
    sys.stderr.flush()
  except (AttributeError, ValueError):  # None, or closed.
    pass


def _Python():
  """The interpreter to run log_filter.py, or None: a frozen or embedded application's
  sys.executable is no Python."""
  executable = sys.executable
  if getattr(sys, 'frozen', False) or not isinstance(executable, str) or not (
      os.path.basename(executable).lower().startswith('python')):
    return None
  return executable


@contextlib.contextmanager
def _Redirected():
  """fd 2 into log_filter.py --drop_failed_ops; as it is if it cannot be."""
  python = _Python()
  _FlushStderr()
  try:
    saved = os.dup(2)
  except OSError:  # No stderr.
    saved = None
  forward = None
  if saved is not None and python is not None:
    try:
      # A session of its own: a Ctrl-C to this process's group does not stop the forwarding.
      forward = subprocess.Popen([python, _LOG_FILTER, str(_Level()), '--drop_failed_ops'],
                                 stdin=subprocess.PIPE, start_new_session=True)
    except (OSError, ValueError):
      pass
  if forward is None:
    if saved is not None:
      os.close(saved)
    yield
    return
  os.dup2(forward.stdin.fileno(), 2)
  try:
    yield
  finally:
    _FlushStderr()
    os.dup2(saved, 2)
    os.close(saved)
    forward.stdin.close()
    try:
      forward.wait(timeout=10)  # Its lines come before this process's next ones.
    except subprocess.TimeoutExpired:  # A child of the block holds the pipe: it goes on.
      pass
