"""What the project's binaries (the trainer, tools/*.py) do at start: readable logs, --help.

A binary calls QuietTensorFlow() before anything imports TensorFlow (a user's
script may too), and runs its main with Run(main):

  from lingvo_gpipe.runners import binaries
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
import sys
from typing import Any, Callable

from absl import app
from absl import flags

from lingvo_gpipe.foundation import log_filter


@functools.cache
def _TensorFlowDir() -> str:
  """TensorFlow's package directory, found without importing it."""
  return os.path.dirname(importlib.util.find_spec('tensorflow').origin) + os.sep


def _NotTensorFlowInfo(record: logging.LogRecord) -> bool:
  """A logging filter: False for INFO (and finer) records logged from TensorFlow's files."""
  return record.levelno > logging.INFO or not record.pathname.startswith(_TensorFlowDir())


def QuietTensorFlow() -> None:
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


def _ImportTensorFlow() -> None:
  """Imports TensorFlow, passing on only the stderr lines of its load that
  TF_CPP_MIN_LOG_LEVEL lets through.

  TensorFlow's C++ libraries log while they load (oneDNN is on, no CUDA
  driver), before they read the level. The load's stderr goes through
  log_filter.py in a process of its own, so a line is out even if the import
  kills this one (a fatal line, an illegal instruction).
  """
  with log_filter.Filtered(log_filter.LogLevel()):
    import tensorflow  # pylint: disable=g-import-not-at-top,unused-import


def _ParseFlags(argv: list[str]) -> list[str]:
  """absl's parsing, but a bad flag is one line '<binary>: error: ...' (exit 1), and --help
  and --helpfull exit 0: the help is what was asked for."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    binary = os.path.splitext(os.path.basename(argv[0]))[0]
    sys.stderr.write(f'{binary}: error: {" ".join(str(e).split())} (--helpshort lists the '
                     'flags).\n')
    raise SystemExit(1) from None
  except SystemExit as e:  # A help flag prints the help and exits 1.
    raise SystemExit(0 if e.code == 1 else e.code) from None


def Run(main: Callable[[list[str]], Any]) -> None:
  """absl.app.run(main) with the help flags exiting 0; --helpshort lists the flags of main's
  module also where another file runs it (`python -m lingvo_gpipe.trainer`, a console script):
  absl lists those of the file run."""
  for flag in flags.FLAGS.get_key_flags_for_module(main.__module__):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  app.run(main, flags_parser=_ParseFlags)
