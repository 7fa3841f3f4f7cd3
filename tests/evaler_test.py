"""Unit tests of lingvo_gpipe.runners.evaler (its jobs end to end are in trainer_test.py)."""

import os
import time

import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.runners import evaler
from lingvo_gpipe.training import checkpointer as checkpointer_lib


def _WriteParams(train_dir, text):
  os.makedirs(train_dir, exist_ok=True)
  with open(os.path.join(train_dir, 'params.txt'), 'w') as f:
    f.write(text)


def testTheEvalerStopsAtTheTrainersRecordedEndUnlessGivenItsOwn(tmp_path):
  train_dir = str(tmp_path / 'train')
  # pylint: disable=protected-access
  assert evaler._TrainersMaxSteps(train_dir, 100, own_given=False) == 100  # No params.txt.
  _WriteParams(train_dir, 'task.x : 1\ntrain.max_steps : 40\n')
  assert evaler._TrainersMaxSteps(train_dir, 100, own_given=False) == 40
  assert evaler._TrainersMaxSteps(train_dir, 30, own_given=False) == 30
  assert evaler._TrainersMaxSteps(train_dir, 100, own_given=True) == 100


def testNewCheckpointsYieldsEachNewerOneAndEndsAfterTheTimeout(tmp_path):
  variable = tf.Variable(1.0, name='w')
  step = tf.Variable(0, dtype=tf.int64, name='global_step')
  checkpointer = checkpointer_lib.Checkpointer(str(tmp_path), [variable], step)
  step.assign(3)
  checkpointer.Save()
  # pylint: disable=protected-access
  found = evaler._NewCheckpoints(checkpointer, 0.3, poll_secs=0.05)
  assert os.path.basename(next(found)) == 'ckpt-3'
  step.assign(5)
  checkpointer.Save()
  assert os.path.basename(next(found)) == 'ckpt-5'
  start = time.monotonic()
  assert list(found) == []
  assert 0.3 <= time.monotonic() - start < 5


def testAnEvalTimeoutThatIsNotPositiveIsOneLine(tmp_path):
  settings = evaler.EvalSettings(job='evaler_dev', model='m', timeout_secs=0.0)
  with pytest.raises(errors.UserError, match=r'^--eval_timeout_secs must be > 0, got 0\.$'):
    evaler.Run(None, str(tmp_path), 'Dev', settings)
