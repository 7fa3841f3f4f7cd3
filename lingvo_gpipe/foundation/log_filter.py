"""Sends this process's stderr through a filter of C++ log lines for a block: the lines a
log level lets through (binaries.QuietTensorFlow's TensorFlow import).

TensorFlow's libraries log while they load, before they read TF_CPP_MIN_LOG_LEVEL: only a
filter on file descriptor 2 sees the lines. The filter is this script, run as a process of
its own: each line is forwarded (or dropped) as it comes, and what was read is out even if
the block kills the process (an illegal instruction, an abort).

  with log_filter.Filtered(LogLevel()):
    import tensorflow

  python log_filter.py <level>    # 0: every line; 3: none of INFO, WARNING, ERROR.

Run as a script it imports nothing of the project, so it runs by path wherever the package
lies.
"""

import contextlib
import os
import re
import subprocess
import sys

# A C++ log line's severity letter (absl / glog format: 'I1127 07:52:30.5 ...').
_SEVERITY = re.compile(r'([IWEF])\d{4} ')
_LEVELS = {'I': 0, 'W': 1, 'E': 2, 'F': 3}
_BEFORE_INIT = 'WARNING: All log messages before absl::InitializeLog() is called'


def Shown(line, level):
  """Whether a line passes C++ log level `level`; lines not in the log's format always do."""
  if line.startswith(_BEFORE_INIT):
    return level == 0
  severity = _SEVERITY.match(line)
  return not severity or _LEVELS[severity.group(1)] >= level


def LogLevel():
  """TF_CPP_MIN_LOG_LEVEL as TensorFlow reads it: 0 unless a non-negative integer."""
  level = os.environ.get('TF_CPP_MIN_LOG_LEVEL', '0')
  return int(level) if level.isdigit() else 0


def _FlushStderr():
  try:
    sys.stderr.flush()
  except (AttributeError, ValueError):  # None, or closed.
    pass


def _Python():
  """The interpreter to run this script with, or None: a frozen or embedded application's
  sys.executable is no Python."""
  executable = sys.executable
  if getattr(sys, 'frozen', False) or not isinstance(executable, str) or not (
      os.path.basename(executable).lower().startswith('python')):
    return None
  return executable


def _Start(level):
  """The filter's process, or None where there is no Python to run it."""
  python = _Python()
  if python is None:
    return None
  command = [python, os.path.abspath(__file__), str(level)]
  try:
    # A session of its own: a Ctrl-C to this process's group does not stop the forwarding.
    return subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)
  except (OSError, ValueError):
    return None


@contextlib.contextmanager
def Filtered(level):
  """Within the block, fd 2 goes through the filter; as it is where it cannot (no stderr,
  no Python to run the filter with)."""
  _FlushStderr()
  try:
    saved = os.dup(2)
  except OSError:  # No stderr.
    saved = None
  forward = _Start(level) if saved is not None else None
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


def main(level):
  for raw in sys.stdin.buffer:
    if Shown(raw.decode(errors='replace'), level):
      sys.stderr.buffer.write(raw)  # As written: bytes of any encoding.
      sys.stderr.flush()


if __name__ == '__main__':
  main(int(sys.argv[1]))
