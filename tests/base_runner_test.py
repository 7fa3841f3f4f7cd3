"""Tests of lingvo_gpipe.runners.base_runner's host loops of training and evaluation."""

import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.runners import base_runner


def testACancelledStepSaysHowToSeeTheFailingOpsError():
  """TensorFlow may report an op failing inside a chunk only as the other devices' cancelled
  receives: the loop re-raises that CancelledError with the way to the op's own error."""
  def LoopFn(iterator, num_steps):
    del iterator, num_steps
    raise tf.errors.CancelledError(None, None, 'RecvAsync is cancelled.')

  step = tf.Variable(0, dtype=tf.int64)
  with pytest.raises(tf.errors.CancelledError) as raised:
    base_runner.RunTraining(LoopFn, iter([]), step, None, None,
                            base_runner.LoopSettings(max_steps=3), None)
  message = raised.value.message
  assert message.startswith(errors.CANCELLED_STEP_HINT)
  assert 'inline_cell_functions : True' in message
  assert message.endswith('RecvAsync is cancelled.')


class _Rerun:
  """A rerun_step that records its global step and whether tf.functions ran eagerly."""

  def __init__(self, error=None):
    self.error, self.calls = error, []

  def __call__(self, global_step):
    self.calls.append((global_step, tf.config.functions_run_eagerly()))
    if self.error:
      raise self.error


def _TrainCancelledAtStep2(rerun):
  """RunTraining whose loop applies steps 0 and 1 and then is cancelled (in step 2)."""
  step = tf.Variable(0, dtype=tf.int64)

  def LoopFn(iterator, num_steps):
    del iterator, num_steps
    step.assign(2)
    raise tf.errors.CancelledError(None, None, 'RecvAsync is cancelled.')

  base_runner.RunTraining(LoopFn, iter([]), step, None, None,
                          base_runner.LoopSettings(max_steps=3), None, rerun_step=rerun)


def testACancelledStepIsRunAgainEagerlyToRaiseTheFailingOpsOwnError():
  rerun = _Rerun(tf.errors.InvalidArgumentError(None, None, 'the op that failed'))
  with pytest.raises(tf.errors.InvalidArgumentError, match='the op that failed') as raised:
    _TrainCancelledAtStep2(rerun)
  assert rerun.calls == [(2, True)]  # The failed step's, eagerly.
  assert not tf.config.functions_run_eagerly()
  assert raised.value.__notes__ == [errors.RERUN_NOTE]
  assert isinstance(raised.value.__context__, tf.errors.CancelledError)


def testACancelledStepThatPassesOrIsLostWhenRunAgainSaysHowToSeeTheError():
  """A rerun that passes, or that fails in the run itself (a lost worker), cannot name the
  op: the CancelledError stays, with the hint (and that the rerun passed)."""
  rerun = _Rerun()
  with pytest.raises(tf.errors.CancelledError) as raised:
    _TrainCancelledAtStep2(rerun)
  assert rerun.calls == [(2, True)]
  assert raised.value.message.startswith(errors.RERUN_PASSED + errors.CANCELLED_STEP_HINT)
  rerun = _Rerun(tf.errors.UnavailableError(None, None, 'worker 1 is gone'))
  with pytest.raises(tf.errors.CancelledError) as raised:
    _TrainCancelledAtStep2(rerun)
  assert raised.value.message.startswith(errors.CANCELLED_STEP_HINT)
  assert not tf.config.functions_run_eagerly()


def testACancelledEvaluationBatchIsRunAgainEagerly():
  """The evaluation reruns the batch that failed: here batch 1 fails as CancelledError when
  traced and with its own error eagerly."""
  def EvalFn(batch):
    if int(batch) == 1:
      if tf.config.functions_run_eagerly():
        raise tf.errors.InvalidArgumentError(None, None, f'batch {int(batch)} failed')
      raise tf.errors.CancelledError(None, None, 'RecvAsync is cancelled.')
    return {'loss': (1.0, 1.0)}

  with pytest.raises(tf.errors.InvalidArgumentError) as raised:
    base_runner.Evaluate(EvalFn, tf.data.Dataset.range(3), None)
  assert raised.value.message == 'batch 1 failed'
  assert raised.value.__notes__ == [errors.RERUN_NOTE]


def testACancelledEvaluationStepSaysHowToSeeTheFailingOpsError():
  def EvalFn(batch):
    del batch
    raise tf.errors.CancelledError(None, None, 'RecvAsync is cancelled.')

  with pytest.raises(tf.errors.CancelledError, match='inline_cell_functions'):
    base_runner.Evaluate(EvalFn, tf.data.Dataset.range(2), None)


class _NoCheckpoints:
  latest = None

  def Save(self):
    pass


def testTheFirstLoopCallsTimeIsLoggedOnceWithItsSteps(caplog):
  """Start-up after tracing (graph optimization, placement) shows as the first call's line."""
  step = tf.Variable(0, dtype=tf.int64)

  def LoopFn(iterator, num_steps):
    del iterator
    step.assign_add(num_steps)
    return py_utils.NestedMap(finite=tf.constant(True), skips=tf.constant(0))

  caplog.set_level('INFO', logger='absl')  # Whatever verbosity an earlier test left.
  base_runner.RunTraining(LoopFn, iter([]), step, _NoCheckpoints(), None,
                          base_runner.LoopSettings(max_steps=6, steps_per_loop=2), None)
  lines = [r.getMessage() for r in caplog.records if 'first call of the training' in r.getMessage()]
  assert len(lines) == 1, lines
  assert lines[0].startswith('The first call of the training loop took ')
  assert ' s, steps 1-2: a new graph' in lines[0] and 'speeds leave this call out' in lines[0]
