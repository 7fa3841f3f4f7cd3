"""Tests of preemption.StopOnSignals in a child process that plays a training loop."""

import signal
import subprocess
import sys
import time

import pytest

from lingvo_gpipe.training import preemption

# The child counts 'steps' of 50 ms until asked to stop, or blocks in one long
# call (a sleep standing for a TensorFlow call) when told to.
_CHILD = '''
import sys, time
from lingvo_gpipe.training import preemption
with preemption.StopOnSignals() as stop:
  print('ready', flush=True)
  if sys.argv[1] == 'block':
    time.sleep(60)
  step = 0
  while not stop.Stopped():
    time.sleep(0.05)
    step += 1
  print(f'stopped by {stop.received} after step {step}', flush=True)
'''


def _Child(mode):
  proc = subprocess.Popen([sys.executable, '-c', _CHILD, mode], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  assert proc.stdout.readline() == 'ready\n'
  return proc


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def testTheFirstSignalAsksTheLoopToStop(signum):
  proc = _Child('loop')
  time.sleep(0.3)
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=30)
  assert proc.returncode == 0 and 'Traceback' not in err
  assert out.startswith(f'stopped by {int(signum)} after step ')
  assert f'{signum.name}: stopping after this step with a checkpoint' in err


def testASecondSignalExitsAtOnceEvenDuringALongCall():
  proc = _Child('block')
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.3)
  start = time.time()
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=30)
  assert time.time() - start < 5  # Not after the 60 s call.
  assert proc.returncode == 128 + signal.SIGINT and out == ''
  assert err.splitlines()[-1] == ('trainer: second signal (SIGINT): exiting at once; training '
                                  'resumes from the last checkpoint.')
  assert 'Traceback' not in err


def testHandlersAreRestoredOnExit():
  before = signal.getsignal(signal.SIGINT)
  with preemption.StopOnSignals():
    assert signal.getsignal(signal.SIGINT) is not before
  assert signal.getsignal(signal.SIGINT) is before
  assert signal.set_wakeup_fd(-1) == -1
