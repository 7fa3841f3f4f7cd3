"""Fault injection into the trainer binary: a run is never lost.

Each fault is done to a real trainer (kill -9 at random moments and inside a
save, a damaged file of the latest checkpoint, a lost or garbled state file,
a second trainer, SIGTERM and a second signal mid-run, a NaN learning rate)
and the run is then resumed to MAX_STEPS. Every fault must leave:
  - no traceback, and at most one 'trainer:' line per run;
  - a resume from the newest checkpoint that reads back in full (found here
    by reading every tensor), so no step before it is lost;
  - final weights, optimizer slots and step bitwise equal to an
    uninterrupted run's.

The experiment is the toy pipelined regression (tests/testdata): its steps
take milliseconds, so a run costs mostly TensorFlow's start-up, and all
scenarios start together in a few worker threads. `pytest -s` prints the
table of outcomes (fault, tries, outcome, steps lost); FAULT_TRIES=N runs
each fault N times (default 1; kill -9 at a random moment: 2 N).
"""

import collections
import concurrent.futures
import dataclasses
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

_PARAMS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'testdata', 'params')
_MODEL = 'toy.regression.PipelinedRegression'
MAX_STEPS = 300
BASE_STEPS = 200  # The faults are done to a run trained this far, unless they need a live one.
_TRIES = int(os.environ.get('FAULT_TRIES', '1'))


# -- running the trainer ---------------------------------------------------------------


class _Trainer:
  """A trainer subprocess whose stderr goes to a file that can be read while it runs."""

  def __init__(self, logdir, max_steps=MAX_STEPS, interval=100, override=''):
    self.logdir = logdir
    self.train_dir = os.path.join(logdir, 'train')
    os.makedirs(logdir, exist_ok=True)
    self._err_path = os.path.join(logdir, f'stderr.{time.time_ns()}')
    settings = (f'train.save_interval_steps : {interval}; train.log_interval_steps : 1; '
                f'train.summary_interval_steps : 1000; {override}')
    env = dict(os.environ, LINGVO_GPIPE_PARAMS=_PARAMS_DIR, TF_CPP_MIN_LOG_LEVEL='2')
    with open(self._err_path, 'w') as err:
      self.proc = subprocess.Popen(
          [sys.executable, '-m', 'lingvo_gpipe.runners.trainer', f'--model={_MODEL}',
           f'--logdir={logdir}', f'--max_steps={max_steps}',
           f'--model_params_override={settings}'],
          env=env, stdout=subprocess.DEVNULL, stderr=err)

  def Err(self):
    with open(self._err_path) as f:
      return f.read()

  def LastStep(self):
    """The last step the trainer logged as done (0 if none)."""
    return max([int(s) for s in re.findall(r'\] step (\d+)/', self.Err())], default=0)

  def WaitForStep(self, step, timeout=120):
    deadline = time.time() + timeout
    while self.LastStep() < step:
      assert self.proc.poll() is None and time.time() < deadline, self.Err()[-3000:]
      time.sleep(0.005)

  def Finish(self, timeout=180):
    """(exit code, stderr), after checking that stderr holds no traceback."""
    self.proc.wait(timeout)
    err = self.Err()
    assert 'Traceback' not in err, err[-3000:]
    assert len([l for l in err.splitlines() if l.startswith('trainer:')]) <= 1, err[-3000:]
    return self.proc.returncode, err


def _Ok(trainer):
  code, err = trainer.Finish()
  assert code == 0, err[-3000:]
  return err


def _Restored(err):
  """The step a trainer resumed from (0 if it started afresh)."""
  found = re.findall(r'Restored \S+ \(global step (\d+)\)', err)
  return int(found[0]) if found else 0


# -- reading checkpoints independently -------------------------------------------------


def _Tensors(path):
  """The tensors of checkpoint `path` that training determines, or None if any does not read."""
  try:
    reader = tf.train.load_checkpoint(path)
    tensors = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
  except (tf.errors.OpError, IndexError, ValueError):
    return None
  return {name: value for name, value in tensors.items()
          if name.split('/')[0] in ('model', 'optimizer', 'global_step')}


def _NewestIntact(train_dir):
  """The largest step whose ckpt-<step> reads back in full, or 0."""
  steps = [int(m.group(1)) for m in map(re.compile(r'ckpt-(\d+)\.index$').match,
                                        os.listdir(train_dir)) if m]
  return max([s for s in steps if _Tensors(os.path.join(train_dir, f'ckpt-{s}'))], default=0)


def _AssertSameAs(reference, train_dir):
  final = _Tensors(os.path.join(train_dir, f'ckpt-{MAX_STEPS}'))
  assert final is not None and sorted(final) == sorted(reference)
  for name, value in reference.items():
    assert np.array_equal(final[name], value), name


@dataclasses.dataclass
class _Outcome:
  fault: str
  outcome: str
  steps_lost: int


def _Resume(logdir, reference, expected_step):
  """Resumes to MAX_STEPS; checks the resume step and the final weights; returns its stderr."""
  err = _Ok(_Trainer(logdir))
  assert _Restored(err) == expected_step, err[-3000:]
  _AssertSameAs(reference, os.path.join(logdir, 'train'))
  return err


# -- the faults --------------------------------------------------------------------------


def _KillAtRandom(tmp, reference, base):
  del base  # From scratch, saving every step, so kills land in and between saves.
  trainer = _Trainer(tmp, interval=1)
  trainer.WaitForStep(random.randint(5, MAX_STEPS - 50))
  time.sleep(random.uniform(0, 0.02))
  trainer.proc.send_signal(signal.SIGKILL)
  trainer.Finish()
  done, intact = trainer.LastStep(), _NewestIntact(trainer.train_dir)
  debris = sorted(n for n in os.listdir(trainer.train_dir) if n.endswith('_temp'))
  err = _Resume(tmp, reference, intact)
  assert 'Taking over the stale lock' in err
  where = f'inside a save ({", ".join(debris)} left)' if debris else 'between saves'
  return _Outcome('kill -9 at a random moment', f'killed {where}; resumed from the newest '
                  'intact checkpoint, equal', max(done, intact) - intact)


def _KillInsideASave(tmp, reference, base):
  del base
  trainer = _Trainer(tmp, interval=1)
  trainer.WaitForStep(random.randint(20, MAX_STEPS - 50))
  while not any(n.endswith('_temp') for n in os.listdir(trainer.train_dir)):
    assert trainer.proc.poll() is None, trainer.Err()[-3000:]
  trainer.proc.send_signal(signal.SIGKILL)
  trainer.Finish()
  done, intact = trainer.LastStep(), _NewestIntact(trainer.train_dir)
  debris = sorted(n for n in os.listdir(trainer.train_dir) if n.endswith('_temp'))
  _Resume(tmp, reference, intact)
  assert not any(n.endswith('_temp') for n in os.listdir(trainer.train_dir))
  return _Outcome('kill -9 inside a save', f'{len(debris)} temp folder(s) left, removed; '
                  'resumed from the newest intact checkpoint, equal', max(done, intact) - intact)


def _FlipByte(path):
  with open(path, 'r+b') as f:
    data = bytearray(f.read())
    data[len(data) // 2] ^= 0x40
    f.seek(0)
    f.write(data)


def _DamageLatest(what):
  def Fault(tmp, reference, base):
    shutil.copytree(base, tmp)
    latest = os.path.join(tmp, 'train', f'ckpt-{BASE_STEPS}')
    if what == 'data file bit flip':
      _FlipByte(latest + '.data-00000-of-00001')
    else:
      os.truncate(latest + '.index', os.path.getsize(latest + '.index') // 2)
    intact = _NewestIntact(os.path.join(tmp, 'train'))
    assert intact < BASE_STEPS
    err = _Resume(tmp, reference, intact)
    assert f'Checkpoint {latest} is damaged' in err
    assert os.listdir(os.path.join(tmp, 'train', 'damaged', f'ckpt-{BASE_STEPS}'))
    return _Outcome(f'latest checkpoint: {what}', 'one line, moved to damaged/, resumed from '
                    'the previous checkpoint, equal', BASE_STEPS - intact)
  return Fault


def _BreakStateFile(what):
  def Fault(tmp, reference, base):
    shutil.copytree(base, tmp)
    state = os.path.join(tmp, 'train', 'checkpoint')
    os.remove(state)
    if what == 'garbled':
      with open(state, 'wb') as f:
        f.write(b'\x8f\x00 model_checkpoint_path: ckpt-\xff')
    _Resume(tmp, reference, BASE_STEPS)
    return _Outcome(f'state file {what}', 'resumed from the newest checkpoint, equal', 0)
  return Fault


def _TwoTrainers(tmp, reference, base):
  del base
  first = _Trainer(tmp, interval=10)
  first.WaitForStep(5)
  first.proc.send_signal(signal.SIGSTOP)  # Busy elsewhere: the second arrives meanwhile.
  try:
    second = _Trainer(tmp, override='task.train.learning_rate : 0.001')
    code, err = second.Finish()
  finally:
    first.proc.send_signal(signal.SIGCONT)
  lines = [l for l in err.splitlines() if l.startswith('trainer:')]
  assert code == 1 and lines == [
      f'trainer: error: {first.train_dir} is in use by another trainer (pid {first.proc.pid} '
      f'on host {socket.gethostname()} since ' + lines[0].split(' since ')[1]], err[-3000:]
  assert _Restored(_Ok(first)) == 0
  _AssertSameAs(reference, first.train_dir)
  assert 'learning_rate : 0.001' not in open(os.path.join(first.train_dir, 'params.txt')).read()
  return _Outcome('second trainer on the logdir', 'refused in one line; the first run finished '
                  'alone, equal', 0)


def _SigtermMidRun(tmp, reference, base):
  del base
  trainer = _Trainer(tmp)
  trainer.WaitForStep(150)
  trainer.proc.send_signal(signal.SIGTERM)
  code, err = trainer.Finish()
  last = err.splitlines()[-1]
  match = re.fullmatch(r'trainer: SIGTERM: stopped at step (\d+) after saving (\S+); rerun to '
                       r'resume\.', last)
  assert code == 128 + signal.SIGTERM and match, err[-3000:]
  step = int(match.group(1))
  assert match.group(2) == os.path.join(trainer.train_dir, f'ckpt-{step}')
  assert step == trainer.LastStep() == _NewestIntact(trainer.train_dir)
  _Resume(tmp, reference, step)
  return _Outcome('SIGTERM mid-run', 'saved the step it was on and exited with one line; '
                  'resumed from it, equal', 0)


def _SecondSignal(tmp, reference, base):
  del base
  trainer = _Trainer(tmp)
  trainer.WaitForStep(150)
  trainer.proc.send_signal(signal.SIGTERM)  # Then Ctrl-C: (the same signal again would merge
  trainer.proc.send_signal(signal.SIGINT)   # with the first while that is pending).
  code, err = trainer.Finish()
  at_once = 'second signal' in err.splitlines()[-1]
  assert code in (128 + signal.SIGTERM, 128 + signal.SIGINT), err[-3000:]
  done, intact = trainer.LastStep(), _NewestIntact(trainer.train_dir)
  _Resume(tmp, reference, intact)
  how = ('exited at once with one line' if at_once else
         'saved and exited before the second arrived')
  return _Outcome('SIGTERM then SIGINT mid-run', f'{how}; resumed from the newest intact '
                  'checkpoint, equal', max(done, intact) - intact)


def _NanLearningRate(tmp, reference, base):
  shutil.copytree(base, tmp)
  before = _Tensors(os.path.join(tmp, 'train', f'ckpt-{BASE_STEPS}'))
  trainer = _Trainer(tmp, interval=1, override='task.train.learning_rate : nan')
  code, err = trainer.Finish()
  lines = [l for l in err.splitlines() if l.startswith('trainer: error:')]
  assert code == 1 and len(lines) == 1, err[-3000:]
  assert _NewestIntact(trainer.train_dir) == BASE_STEPS  # Nothing saved after the last good.
  after = _Tensors(os.path.join(tmp, 'train', f'ckpt-{BASE_STEPS}'))
  assert all(np.array_equal(after[k], v) and np.all(np.isfinite(v)) for k, v in before.items())
  _Resume(tmp, reference, BASE_STEPS)
  return _Outcome('NaN learning rate', 'stopped in one line, nothing saved; the last good '
                  'checkpoint is finite; resumed, equal', 0)


_FAULTS = {
    'kill9_random': (_KillAtRandom, 2 * _TRIES),
    'kill9_in_save': (_KillInsideASave, _TRIES),
    'damaged_data': (_DamageLatest('data file bit flip'), _TRIES),
    'damaged_index': (_DamageLatest('index file truncated'), _TRIES),
    'state_file_deleted': (_BreakStateFile('deleted'), _TRIES),
    'state_file_garbled': (_BreakStateFile('garbled'), _TRIES),
    'two_trainers': (_TwoTrainers, _TRIES),
    'sigterm': (_SigtermMidRun, _TRIES),
    'second_signal': (_SecondSignal, _TRIES),
    'nan_learning_rate': (_NanLearningRate, _TRIES),
}


# -- running them all --------------------------------------------------------------------


def _Table(outcomes):
  """Markdown rows: fault, tries, outcome (with counts when they differ), steps lost."""
  rows = ['| fault | tries | outcome | steps lost |', '| --- | --- | --- | --- |']
  by_fault = collections.defaultdict(list)
  for o in outcomes:
    by_fault[o.fault].append(o)
  for fault, items in by_fault.items():
    counts = collections.Counter(o.outcome for o in items)
    outcome = '; '.join(f'{n}x {text}' if len(counts) > 1 else text
                        for text, n in counts.items())
    lost = sorted({o.steps_lost for o in items})
    lost = str(lost[0]) if len(lost) == 1 else f'{lost[0]}-{lost[-1]}'
    rows.append(f'| {fault} | {len(items)} | {outcome} | {lost} |')
  return '\n'.join(rows)


@pytest.fixture(scope='module')
def results(tmp_path_factory):
  """Runs every fault's tries, a few at a time; {name: [Outcome or the exception]}."""
  tmp = tmp_path_factory.mktemp('faults')
  start = time.time()
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    reference_run = pool.submit(_Ok, _Trainer(str(tmp / 'reference')))
    base_run = pool.submit(_Ok, _Trainer(str(tmp / 'base'), max_steps=BASE_STEPS))
    reference_run.result()
    base_run.result()
    reference = _Tensors(str(tmp / 'reference' / 'train' / f'ckpt-{MAX_STEPS}'))
    futures = {name: [pool.submit(fault, str(tmp / f'{name}_{i}'), reference, str(tmp / 'base'))
                      for i in range(tries)] for name, (fault, tries) in _FAULTS.items()}
    out = {}
    for name, items in futures.items():
      out[name] = []
      for future in items:
        try:
          out[name].append(future.result())
        except Exception as e:  # pylint: disable=broad-except
          out[name].append(e)
  outcomes = [o for items in out.values() for o in items if isinstance(o, _Outcome)]
  print(f'\n{_Table(outcomes)}\n({time.time() - start:.0f} s)')
  return out


@pytest.mark.parametrize('name', sorted(_FAULTS))
def testNoFaultLosesTheRun(results, name):
  for outcome in results[name]:
    if isinstance(outcome, Exception):
      raise outcome
