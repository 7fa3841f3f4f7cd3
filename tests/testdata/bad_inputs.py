"""Runs the trainer binary's main in this process on each of many bad command lines.

  python tests/testdata/bad_inputs.py CASES_JSON WORK_DIR

CASES_JSON: a list of [name, [flag, ...]]; '{work}' in a flag is a fresh directory of its own
case. Prints one JSON line per case: its exit code, its stderr, what it left in its
directory and whether it ran past its alarm (a hang). In one process, so the suite checks
80-odd command lines in seconds instead of a TensorFlow start each (tests/bad_input_test.py).
"""

import json
import os
import signal
import sys
import tempfile
import traceback

from lingvo_gpipe.runners import binaries
from lingvo_gpipe.runners import trainer

import tensorflow as tf  # pylint: disable=g-bad-import-order

_ALARM_SECS = 60


class _Hang(Exception):
  """A case ran past its alarm."""


def _Alarm(unused_signum, unused_frame):
  raise _Hang()


def _Written(directory):
  """The files a case left under its directory."""
  return sorted(os.path.relpath(os.path.join(root, name), directory)
                for root, _, names in os.walk(directory) for name in names)


def _RunCase(flags, work):
  """(exit code or 'traceback'/'hang', stderr) of the trainer's main on `flags`."""
  flags = [f.replace('{work}', work) for f in flags]
  with tempfile.TemporaryFile('w+') as captured:
    saved = os.dup(2)
    sys.stderr.flush()
    os.dup2(captured.fileno(), 2)
    code = 0
    signal.alarm(_ALARM_SECS)
    try:
      trainer.FLAGS.unparse_flags()
      trainer.main(binaries._ParseFlags(['trainer'] + flags))  # pylint: disable=protected-access
    except SystemExit as e:
      code = e.code
    except _Hang:
      code = 'hang'
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
      code = 'traceback'
    finally:
      signal.alarm(0)
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      trainer.FLAGS.unparse_flags()
    captured.seek(0)
    return code, captured.read()


def main(cases_json, work_dir):
  signal.signal(signal.SIGALRM, _Alarm)
  cpus = tf.config.list_physical_devices('CPU')
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * 4)
  with open(cases_json) as f:
    cases = json.load(f)
  for i, (name, flags) in enumerate(cases):
    work = os.path.join(work_dir, f'case{i}')
    os.makedirs(work)
    code, err = _RunCase(flags, work)
    print(json.dumps({'name': name, 'code': code, 'stderr': err, 'written': _Written(work)}),
          flush=True)


if __name__ == '__main__':
  main(*sys.argv[1:])
