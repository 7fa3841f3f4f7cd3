"""What the project's binaries (the trainer, tools/*.py) do at start: readable logs, --help.

A binary calls QuietTensorFlow() before anything imports TensorFlow (a user's
script may too), and runs its main with Run(main):

  from lingvo_gpipe import binaries
  binaries.QuietTensorFlow()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  ...
  if __name__ == '__main__':
    binaries.Run(main)

QuietTensorFlow imports TensorFlow; nothing else here does.
"""

import functools
import importlib.util
import logging
import os
import re
import sys
import tempfile

from absl import app
from absl import flags


@functools.cache
def _TensorFlowDir():
  """TensorFlow's package directory, found without importing it."""
  return os.path.dirname(importlib.util.find_spec('tensorflow').origin) + os.sep


def _NotTensorFlowInfo(record):
  """A logging filter: False for INFO (and finer) records logged from TensorFlow's files."""
  return record.levelno > logging.INFO or not record.pathname.startswith(_TensorFlowDir())


def QuietTensorFlow():
  """Keeps TensorFlow's messages that a user cannot act on out of the binary's log.

  TensorFlow's C++ log level becomes 3 unless TF_CPP_MIN_LOG_LEVEL is set: on
  a machine without a GPU its CUDA start-up logs an error line
  (`failed call to cuInit`) on every healthy run. Failures still reach the user
  as Python exceptions; TF_CPP_MIN_LOG_LEVEL=0 shows all of TensorFlow's lines.
  The INFO lines TensorFlow's Python code logs (through absl or its own logger:
  one per checkpoint save, the cluster client's session config) are dropped;
  its warnings stay. It then imports TensorFlow, so that the lines its
  libraries print while they load get the same level.
  """
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')  # No INFO, WARNING or ERROR lines.
  for name in ('absl', 'tensorflow'):
    logging.getLogger(name).addFilter(_NotTensorFlowInfo)  # Idempotent: the same filter.
  if 'tensorflow' not in sys.modules:
    _ImportTensorFlow()


# A C++ log line's severity letter (absl / glog format: 'I1127 07:52:30.5 ...').
_SEVERITY = re.compile(r'([IWEF])\d{4} ')
_LEVELS = {'I': 0, 'W': 1, 'E': 2, 'F': 3}
_BEFORE_INIT = 'WARNING: All log messages before absl::InitializeLog() is called'


def _ImportTensorFlow():
  """Imports TensorFlow, passing on only the stderr lines of its load that
  TF_CPP_MIN_LOG_LEVEL lets through.

  TensorFlow's C++ libraries log while they load (oneDNN is on, no CUDA
  driver), before they read the level; the load's stderr goes to a file and
  is written back filtered, whatever the import does.
  """
  level = os.environ['TF_CPP_MIN_LOG_LEVEL']
  level = int(level) if level.isdigit() else 0
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      lines = captured.read().decode(errors='replace').splitlines(keepends=True)
      sys.stderr.write(''.join(line for line in lines if _Shown(line, level)))
      sys.stderr.flush()


def _Shown(line, level):
  """Whether a line TensorFlow's load printed passes the C++ log level."""
  if line.startswith(_BEFORE_INIT):
    return level == 0
  severity = _SEVERITY.match(line)
  return not severity or _LEVELS[severity.group(1)] >= level


def _ParseFlags(argv):
  """absl's parsing, but --help and --helpfull exit 0: the help is what was asked for."""
  try:
    return app.parse_flags_with_usage(argv)
  except SystemExit as e:
    # A bad flag exits while handling its flags.Error; a help flag exits on its own.
    if e.code == 1 and not isinstance(e.__context__, flags.Error):
      raise SystemExit(0) from None
    raise


def Run(main):
  """absl.app.run(main) with the help flags exiting 0."""
  app.run(main, flags_parser=_ParseFlags)
