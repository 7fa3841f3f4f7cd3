"""The binaries' start: TensorFlow's load prints only what TF_CPP_MIN_LOG_LEVEL lets through."""

import os
import subprocess
import sys

import pytest

from lingvo_gpipe import binaries

_SCRIPT = ('from lingvo_gpipe import binaries\n'
           'binaries.QuietTensorFlow()\n'
           'import tensorflow as tf\n'
           'print(int(tf.constant(3) * 2))\n')


def testAHealthyStartPrintsNothingOnStderr():
  env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}  # A user's.
  proc = subprocess.run([sys.executable, '-c', _SCRIPT], env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0 and proc.stdout == '6\n' and proc.stderr == '', proc.stderr


@pytest.mark.parametrize('line,level,shown', [
    ('I0000 00:00:17.9 28299 port.cc:153] oneDNN custom operations are on.\n', 3, False),
    ('I0000 00:00:17.9 28299 port.cc:153] oneDNN custom operations are on.\n', 0, True),
    ('W1127 07:52:30.5 28299 x.cc:1] a warning\n', 1, True),
    ('W1127 07:52:30.5 28299 x.cc:1] a warning\n', 2, False),
    ('E0000 00:00:17.9 28299 cuda_platform.cc:52] failed call to cuInit\n', 3, False),
    ('F0000 00:00:17.9 28299 x.cc:1] Check failed\n', 3, True),
    ('WARNING: All log messages before absl::InitializeLog() is called are written to '
     'STDERR\n', 1, False),
    ('To enable the following instructions: AVX2, in other operations, rebuild\n', 3, True),
    ('Traceback (most recent call last):\n', 3, True),
])
def testTheLoadsLinesFollowTheLevel(line, level, shown):
  assert binaries._Shown(line, level) is shown  # pylint: disable=protected-access
