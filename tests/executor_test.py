"""The executor's hand-overs; the schedules it runs are tested against the plain model in
gpipe_test and transparency_test."""

import tensorflow as tf


def _TwoStagePipe(sched, **overrides):
  """A two-stage pipeline of 4 feed-forward layers, M=4; `overrides` are
  PipeliningLayer params (e.g. devices)."""
  from lingvo_gpipe.pipeline import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe import layers  # pylint: disable=g-import-not-at-top
  layer = layers.TransformerFeedForwardLayer.Params().Set(input_dim=8, hidden_dim=16)
  cells = gpipe.PartitionSequentialLayers([layer.Copy() for _ in range(4)], 2,
                                          tf.TensorShape([8, 8]))
  return gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells, num_micro_batches=4,
                                            schedule=sched, **overrides).Instantiate()


def _WaitsFor(op, target, seen=None):
  """Whether `op` runs after `target` (through inputs or control inputs)."""
  seen = set() if seen is None else seen
  if op is target:
    return True
  if op.name in seen:
    return False
  seen.add(op.name)
  return any(_WaitsFor(x, target, seen) for x in [t.op for t in op.inputs] + op.control_inputs)


def _StepGraph(pipe):
  x = tf.random.stateless_normal([8, 8], [1, 2])

  @tf.function
  def Step():
    return pipe.ForwardBackward(pipe.theta, x, lambda y: tf.reduce_mean(tf.square(y)),
                                loss_reduction='mean')

  return Step.get_concrete_function().graph


def _CopiedHandOvers(graph):
  return {op.name.split('/')[0] for op in graph.get_operations()
          if op.name.startswith('hand_over_to_')}


def testOnlyAFirstActionsHandOverIsAwaitedByItsSender():
  """The second stage's first forward waits idle for the first stage's output: that send
  is copied onto the second stage before the first stage goes on (TensorFlow ran it after
  the sender's next action had started: 2-4 ms late on two worker processes); later
  hand-overs, whose receivers are busy, are not."""
  pipe = _TwoStagePipe('zb_h1')
  graph = _StepGraph(pipe)
  copies = [op for op in graph.get_operations() if op.name.startswith('hand_over_to_')]
  assert _CopiedHandOvers(graph) == {'hand_over_to_chunk1_0'}, copies
  (copy,) = copies
  assert tf.DeviceSpec.from_string(copy.device) == tf.DeviceSpec.from_string(pipe.devices[1])
  ops = {op.name: op for op in graph.get_operations()}
  next_forward = [op for name, op in ops.items() if name.startswith('chunk0_F1/')]
  # Each forward is one call of its chunk's function (remat 'always', the default).
  assert next_forward and all(_WaitsFor(op, copy) for op in next_forward
                              if op.type.endswith('PartitionedCall')), 'chunk 0 went on'
  # The receiver's first forward computes on the copy.
  assert any(_WaitsFor(op, copy) for name, op in ops.items()
             if name.startswith('chunk1_F0/') and op.type.endswith('PartitionedCall'))


def testStagesSharingADeviceHandOverWithoutACopy():
  """With allow_device_reuse two stages may share a device: nothing is sent, so nothing is
  copied or waited for."""
  shared = _TwoStagePipe('1f1b', devices=['/device:CPU:0'], allow_device_reuse=True)
  assert not _CopiedHandOvers(_StepGraph(shared))
  assert _CopiedHandOvers(_StepGraph(_TwoStagePipe('1f1b'))) == {'hand_over_to_chunk1_0'}
