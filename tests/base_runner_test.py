"""Tests of lingvo_gpipe.runners.base_runner's host loops of training and evaluation."""

import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import errors
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


def testACancelledEvaluationStepSaysHowToSeeTheFailingOpsError():
  def EvalFn(batch):
    del batch
    raise tf.errors.CancelledError(None, None, 'RecvAsync is cancelled.')

  with pytest.raises(tf.errors.CancelledError, match='inline_cell_functions'):
    base_runner.Evaluate(EvalFn, tf.data.Dataset.range(2), None)
