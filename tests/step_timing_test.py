"""Tests of step stamps (lingvo_gpipe/pipeline/step_timing.py)."""

import tensorflow as tf

from lingvo_gpipe.pipeline import step_timing


def testAStampWaitsForAGpuTensorsFirstElementOnTheHost():
  """A GPU kernel ends after its op returns: the stamp's token is a host copy of one element."""
  with tf.Graph().as_default():
    with tf.device('/device:CPU:1'):
      on_cpu = tf.zeros([3, 4])
    with tf.device('/job:worker/replica:0/task:1/device:GPU:0'):
      on_gpu = tf.zeros([3, 4])
      flag = tf.constant(True)
    tokens = step_timing.CompletionTokens((on_cpu, (on_gpu, flag)))
    assert tokens[0] is on_cpu
    copy = tokens[1]
    assert copy.op.type == 'Identity' and copy.device == '/job:worker/replica:0/task:1/device:CPU:0'
    first = copy.op.inputs[0]
    assert first.op.type == 'StridedSlice' and 'GPU:0' in first.device
    assert first.shape == [1] and first.op.inputs[0].op.inputs[0] is on_gpu
    assert tokens[2].op.type == 'Identity'  # A bool made on the GPU is waited for the same way.
