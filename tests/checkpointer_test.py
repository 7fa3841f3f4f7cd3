"""Tests of the Checkpointer and checkpoint_files: discovery, verification, recovery, rotation.

Damage is done to real checkpoint files the way disks and kill -9 do it
(truncated, bit-flipped, emptied or deleted files, saves cut at each stage),
and the expected checkpoint is the one the test knows intact.
"""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.training import checkpoint_files as files
from lingvo_gpipe.training import checkpointer as checkpointer_lib


class _Model(tf.Module):

  def __init__(self):
    super().__init__(name='model')
    self.w = tf.Variable(tf.zeros([64, 8]), name='w')
    self.b = tf.Variable(tf.zeros([8]), name='b')


def _Checkpointer(directory, max_to_keep=3):
  model = _Model()
  step = tf.Variable(0, dtype=tf.int64, name='global_step')
  return checkpointer_lib.Checkpointer(str(directory), model.variables, step,
                                       max_to_keep=max_to_keep), model


def _TrainTo(checkpointer, model, steps):
  """Saves a checkpoint at each of `steps`; the weights are the step number."""
  for s in steps:
    model.w.assign(tf.fill([64, 8], float(s)))
    checkpointer._global_step.assign(s)  # pylint: disable=protected-access
    checkpointer.Save()


def _Trained(tmp_path, steps=(1, 2, 3)):
  checkpointer, model = _Checkpointer(tmp_path / 'train')
  _TrainTo(checkpointer, model, steps)
  return str(tmp_path / 'train')


def _Recovered(directory):
  """(restored path, the weight value restored) of a fresh Checkpointer's Recover."""
  checkpointer, model = _Checkpointer(directory)
  path = checkpointer.Recover()
  return path and os.path.basename(path), float(model.w.numpy()[0, 0])


def _Data(path):
  return path + '.data-00000-of-00001'


def _FlipByte(name, at=0.5):
  with open(name, 'r+b') as f:
    data = bytearray(f.read())
    data[int(len(data) * at)] ^= 0x40
    f.seek(0)
    f.write(data)


_DAMAGE = {
    'truncated data': lambda p: os.truncate(_Data(p), os.path.getsize(_Data(p)) // 2),
    'empty data': lambda p: os.truncate(_Data(p), 0),
    'bit flip in data': lambda p: _FlipByte(_Data(p)),
    'deleted data': lambda p: os.remove(_Data(p)),
    'truncated index': lambda p: os.truncate(p + '.index', os.path.getsize(p + '.index') // 2),
    'empty index': lambda p: os.truncate(p + '.index', 0),
    'bit flip in index': lambda p: _FlipByte(p + '.index', 0.3),
    'deleted index': lambda p: os.remove(p + '.index'),
}


def testSaveRotatesAndWritesTheStateFile(tmp_path):
  directory = _Trained(tmp_path, steps=range(1, 6))
  assert files.Steps(directory) == [5, 4, 3]
  assert tf.train.latest_checkpoint(directory) == os.path.join(directory, 'ckpt-5')
  state = tf.train.get_checkpoint_state(directory)
  assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [
      'ckpt-3', 'ckpt-4', 'ckpt-5']
  assert _Recovered(directory) == ('ckpt-5', 5.0)


@pytest.mark.parametrize('damage', sorted(_DAMAGE))
def testADamagedLatestCheckpointIsMovedAsideAndTheNewestIntactOneUsed(tmp_path, damage):
  directory = _Trained(tmp_path)
  latest = os.path.join(directory, 'ckpt-3')
  names = sorted(n for n in os.listdir(directory) if n.startswith('ckpt-3'))
  _DAMAGE[damage](latest)
  assert files.Problem(latest)
  left = sorted(n for n in os.listdir(directory) if n.startswith('ckpt-3'))

  assert _Recovered(directory) == ('ckpt-2', 2.0)
  moved = os.path.join(directory, files.DAMAGED_DIR, 'ckpt-3')
  assert sorted(os.listdir(moved)) == left and set(left) <= set(names)  # Moved, not deleted.
  assert files.Steps(directory) == [2, 1]
  assert tf.train.latest_checkpoint(directory) == os.path.join(directory, 'ckpt-2')


@pytest.mark.parametrize('bad', [np.nan, np.inf, -np.inf])
def testACheckpointWithANonFiniteWeightCountsAsDamaged(tmp_path, bad, caplog):
  """A newest checkpoint holding one NaN (or Inf) weight is passed over by the evaler's
  Newest and moved aside by the trainer's Recover, which restores the newest finite one."""
  directory = _Trained(tmp_path, steps=(1, 2))
  checkpointer, model = _Checkpointer(directory)
  model.w.assign(tf.tensor_scatter_nd_update(tf.fill([64, 8], 3.0), [[5, 1]], [bad]))
  checkpointer._global_step.assign(3)  # pylint: disable=protected-access
  # pylint: disable-next=protected-access
  checkpointer._checkpoint.write(os.path.join(directory, 'ckpt-3'))
  assert files.Problem(os.path.join(directory, 'ckpt-3')) == 'model/w holds NaN or Inf'
  assert os.path.basename(_Checkpointer(directory)[0].Newest()) == 'ckpt-2'
  assert _Recovered(directory) == ('ckpt-2', 2.0)
  assert os.listdir(os.path.join(directory, files.DAMAGED_DIR)) == ['ckpt-3']
  assert any('ckpt-3 is damaged (model/w holds NaN or Inf): moved to' in r.getMessage()
             for r in caplog.records)


def testASaveOfNonFiniteWeightsIsRefusedAndTheOlderKept(tmp_path):
  directory = _Trained(tmp_path, steps=(1, 2))
  checkpointer, model = _Checkpointer(directory)
  checkpointer.Recover()
  model.b.assign(tf.fill([8], np.nan))
  checkpointer._global_step.assign(3)  # pylint: disable=protected-access
  with pytest.raises(errors.UserError, match='ckpt-3 does not read back after saving '
                     r'\(model/b holds NaN or Inf\); the older checkpoints are kept'):
    checkpointer.Save()
  assert files.Steps(directory)[1:] == [2, 1] and checkpointer.latest.endswith('ckpt-2')


def testDamagedCheckpointsOfTheSameStepAreAllKept(tmp_path):
  directory = _Trained(tmp_path)
  for _ in range(2):
    _DAMAGE['bit flip in data'](os.path.join(directory, 'ckpt-3'))
    assert _Recovered(directory) == ('ckpt-2', 2.0)
    checkpointer, model = _Checkpointer(directory)
    checkpointer.Recover()
    _TrainTo(checkpointer, model, [3])
  assert sorted(os.listdir(os.path.join(directory, files.DAMAGED_DIR))) == [
      'ckpt-3', 'ckpt-3.2']


@pytest.mark.parametrize('state', [None, b'', b'\x00\xff garbage \x9c',
                                   b'model_checkpoint_path: "ckpt-9"\n'])
def testTheStateFileIsNotTrusted(tmp_path, state):
  directory = _Trained(tmp_path)
  state_file = os.path.join(directory, files.STATE_FILE)
  os.remove(state_file)
  if state is not None:
    with open(state_file, 'wb') as f:
      f.write(state)
  assert _Recovered(directory) == ('ckpt-3', 3.0)
  assert tf.train.latest_checkpoint(directory) == os.path.join(directory, 'ckpt-3')


def _CutSave(directory, stage):
  """Leaves ckpt-4 as a kill -9 at `stage` of tf.train.Checkpoint.write would."""
  path = os.path.join(directory, 'ckpt-4')
  shutil.copy(os.path.join(directory, 'ckpt-3.index'), path + '.index')
  shutil.copy(_Data(os.path.join(directory, 'ckpt-3')), _Data(path))
  temp = path + '_temp'
  os.makedirs(temp)
  with open(os.path.join(temp, 'part-00000-of-00001.index'), 'wb') as f:
    f.write(b'partial')
  if stage == 'writing the shard':
    os.remove(path + '.index')
    os.remove(_Data(path))
  elif stage == 'data moved, no index':
    os.remove(path + '.index')
  elif stage == 'writing the index':
    os.truncate(path + '.index', 100)
  return path


@pytest.mark.parametrize('stage', ['writing the shard', 'data moved, no index',
                                   'writing the index', 'removing the temp folder'])
def testDebrisOfAnInterruptedSaveIsRemoved(tmp_path, stage):
  directory = _Trained(tmp_path)
  path = _CutSave(directory, stage)
  complete = stage == 'removing the temp folder'
  checkpointer, _ = _Checkpointer(directory)
  assert checkpointer.Newest() == os.path.join(directory, 'ckpt-3')  # Readers pass over it.

  expected = ('ckpt-4', 3.0) if complete else ('ckpt-3', 3.0)
  assert _Recovered(directory) == expected
  assert not os.path.exists(path + '_temp')
  assert os.path.exists(path + '.index') == complete == os.path.exists(_Data(path))
  assert not os.path.exists(os.path.join(directory, files.DAMAGED_DIR))


def testNewestOnlyReadsAndReportsDamageOnce(tmp_path, caplog):
  directory = _Trained(tmp_path)
  _DAMAGE['bit flip in data'](os.path.join(directory, 'ckpt-3'))
  before = sorted(os.listdir(directory))
  checkpointer, _ = _Checkpointer(directory)
  assert checkpointer.Newest() == os.path.join(directory, 'ckpt-2')
  assert checkpointer.Newest() == os.path.join(directory, 'ckpt-2')
  assert checkpointer.Newest(after=2) is None
  assert sorted(os.listdir(directory)) == before
  damaged = [r for r in caplog.records if 'is damaged' in r.getMessage()]
  assert len(damaged) == 1 and 'ckpt-3' in damaged[0].getMessage()


def testSaveDropsOnlyTheSaversOwnRetracingWarning(tmp_path, monkeypatch, caplog):
  """On a cluster TensorFlow's saver makes a new tf.function per save and warns of it (every
  fifth save); other warnings of the save still show, and none is dropped after it."""
  checkpointer, model = _Checkpointer(tmp_path / 'train')
  checkpoint = checkpointer._checkpoint  # pylint: disable=protected-access
  real_write = checkpoint.write
  retracing = ('5 out of the last 5 calls to <function MultiDeviceSaver.save.<locals>.'
               'tf_function_save at 0x7f> triggered tf.function retracing. Tracing is expensive')

  def Write(path):
    tf.get_logger().warning(retracing)
    tf.get_logger().warning('Another warning of the save.')
    return real_write(path)

  monkeypatch.setattr(checkpoint, 'write', Write)
  with caplog.at_level('WARNING', logger='tensorflow'):
    _TrainTo(checkpointer, model, [1])
    tf.get_logger().warning(retracing)  # Outside a save: kept.
  messages = [r.getMessage() for r in caplog.records if r.name == 'tensorflow']
  assert messages == ['Another warning of the save.', retracing]
  assert files.Steps(str(tmp_path / 'train')) == [1]


def testNothingIsRotatedAwayBeforeTheNewCheckpointReadsBack(tmp_path, monkeypatch):
  directory = _Trained(tmp_path)
  state = open(os.path.join(directory, files.STATE_FILE)).read()
  checkpointer, model = _Checkpointer(directory)
  checkpointer.Recover()
  real_problem = files.Problem
  monkeypatch.setattr(files, 'Problem',
                      lambda p: 'disk full' if p.endswith('ckpt-4') else real_problem(p))
  with pytest.raises(errors.UserError, match='ckpt-4 does not read back.*disk full'):
    _TrainTo(checkpointer, model, [4])
  assert files.Steps(directory) == [4, 3, 2, 1]
  assert open(os.path.join(directory, files.STATE_FILE)).read() == state


def testRestoreIsExact(tmp_path):
  directory = _Trained(tmp_path)
  checkpointer, model = _Checkpointer(directory)
  assert checkpointer.Restore(os.path.join(directory, 'ckpt-2')).endswith('ckpt-2')
  np.testing.assert_array_equal(model.w.numpy(), np.full([64, 8], 2.0, np.float32))
  assert int(checkpointer._global_step.numpy()) == 2  # pylint: disable=protected-access
  assert checkpointer.latest.endswith('ckpt-2')
