"""The binaries' start: TensorFlow's load prints only what TF_CPP_MIN_LOG_LEVEL lets through."""

import os
import subprocess
import sys

_SCRIPT = ('from lingvo_gpipe.runners import binaries\n'
           'binaries.QuietTensorFlow()\n'
           'import tensorflow as tf\n'
           'print(int(tf.constant(3) * 2))\n')


def _Start(env_changes, pythonpath=None):
  env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}  # A user's.
  env.update(env_changes)
  if pythonpath:
    env['PYTHONPATH'] = os.pathsep.join([str(pythonpath)] + sys.path)
  return subprocess.run([sys.executable, '-c', _SCRIPT], env=env, capture_output=True,
                        text=True, timeout=300, check=False)


def testAHealthyStartPrintsNothingOnStderr():
  proc = _Start({})
  assert proc.returncode == 0 and proc.stdout == '6\n' and proc.stderr == '', proc.stderr


def testAnImportThatKillsTheProcessStillShowsItsFatalLine(tmp_path):
  """The load's lines are forwarded as they come: a fatal line before an abort is out."""
  fake = tmp_path / 'tensorflow'
  fake.mkdir()
  (fake / '__init__.py').write_text(
      'import os\n'
      "os.write(2, b'I0000 00:00:1.0 1 port.cc:1] oneDNN custom operations are on.\\n')\n"
      "os.write(2, b'F0000 00:00:1.0 1 cpu.cc:1] This TensorFlow needs AVX.\\n')\n"
      'os.abort()\n')
  proc = _Start({}, pythonpath=tmp_path)
  assert proc.returncode != 0 and proc.stdout == ''
  assert proc.stderr == 'F0000 00:00:1.0 1 cpu.cc:1] This TensorFlow needs AVX.\n', proc.stderr
