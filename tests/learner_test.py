"""Tests of the Learner: clipping, the finiteness guard, its loop, and float16 loss scaling."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.models import base_model
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import steady_state
from lingvo_gpipe.runners import base_runner
from lingvo_gpipe.training import learner as learner_lib
from lingvo_gpipe.training import loss_scale
from lingvo_gpipe.training import optimizer

def testGradientsAndVariablesSumsTiedWeightsAndSkipsFrozen():
  shared = tf.Variable([1.0, 2.0], name='shared')
  own = tf.Variable([3.0], name='own')
  frozen = tf.Variable([0.0], trainable=False, name='frozen')
  theta = py_utils.NestedMap(a=shared, b=[own, shared], c=frozen)
  grads = py_utils.NestedMap(a=tf.constant([1.0, 1.0]), b=[tf.constant([5.0]),
                                                           tf.constant([0.5, 2.0])],
                             c=tf.constant([9.0]))
  pairs = learner_lib.GradientsAndVariables(theta, grads)
  assert [v.name for _, v in pairs] == ['shared:0', 'own:0']
  np.testing.assert_array_equal(pairs[0][0].numpy(), [1.5, 3.0])
  np.testing.assert_array_equal(pairs[1][0].numpy(), [5.0])


def testGradientsThatDoNotMirrorThetaAreRefusedNotTruncated():
  theta = py_utils.NestedMap(a=tf.Variable([1.0]), b=tf.Variable([2.0]))
  with pytest.raises(ValueError, match='do not mirror theta'):
    learner_lib.GradientsAndVariables(theta, py_utils.NestedMap(a=tf.constant([1.0])))


def _SgdLearner(variables, clip=0.0, learning_rate=1.0):
  tp = base_model.TrainParams()
  tp.optimizer = optimizer.SGD.Params()
  tp.learning_rate = learning_rate
  tp.clip_gradient_norm_to_value = clip
  step = tf.Variable(0, dtype=tf.int64, name='global_step')
  return learner_lib.Learner(tp, variables, step)


def _Metrics(loss):
  return py_utils.NestedMap(loss=(tf.constant(loss), tf.constant(1.0)))


def testLearnerClipsByTheGlobalNormOfAllStages():
  with tf.device('/device:CPU:0'):
    a = tf.Variable([0.0], name='stage0/w')
  with tf.device('/device:CPU:1'):
    b = tf.Variable([0.0], name='stage1/w')
  learner = _SgdLearner([a, b], clip=1.0)
  out = learner.Apply(tf.constant(0, tf.int64), _Metrics(2.0),
                      [(tf.constant([3.0]), a), (tf.constant([4.0]), b)])
  assert float(out.grad_norm) == pytest.approx(5.0) and bool(out.finite)
  np.testing.assert_allclose([a.numpy()[0], b.numpy()[0]], [-0.6, -0.8], rtol=1e-6)
  assert int(learner.global_step.numpy()) == 1


@pytest.mark.parametrize('loss, grad', [(float('nan'), 1.0), (1.0, float('inf'))])
def testLearnerAppliesNothingWhenNotFinite(loss, grad):
  var = tf.Variable([1.0], name='w')
  learner = _SgdLearner([var])
  out = learner.Apply(tf.constant(0, tf.int64), _Metrics(loss), [(tf.constant([grad]), var)])
  assert not bool(out.finite)
  assert var.numpy()[0] == 1.0 and int(learner.global_step.numpy()) == 0
  assert int(learner.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize('learning_rate', [float('nan'), float('inf'), 1e39])
def testLearnerAppliesNothingWhenTheUpdateIsNotFinite(learning_rate):
  var = tf.Variable([1.0], name='w')
  learner = _SgdLearner([var], learning_rate=learning_rate)
  out = learner.Apply(tf.constant(0, tf.int64), _Metrics(1.0), [(tf.constant([0.5]), var)])
  assert not bool(out.finite) and np.isfinite(float(out.loss))
  assert var.numpy()[0] == 1.0 and int(learner.global_step.numpy()) == 0
  assert int(learner.optimizer.iterations.numpy()) == 0


def _LoopOver(values, learner, var):
  """Learner loop whose loss is the element times var; gradient = element."""
  dataset = tf.data.Dataset.from_tensor_slices(np.array(values, np.float32))

  def ForwardBackward(x):
    metrics = py_utils.NestedMap(loss=(x * var[0], tf.constant(1.0)))
    return metrics, [(tf.reshape(x, [1]), var)]

  return learner.BuildLoop(dataset.element_spec, ForwardBackward), iter(dataset)


def testLoopRunsStepsInOneCallAndStopsAtTheFirstNonFiniteStep():
  var = tf.Variable([0.0], name='w')
  learner = _SgdLearner([var], learning_rate=0.1)
  loop, it = _LoopOver([1.0, 2.0, float('nan'), 3.0, 4.0], learner, var)
  out = loop(it, tf.constant(4, tf.int64))  # Stops at the NaN element: step 2.
  assert not bool(out.finite) and int(learner.global_step.numpy()) == 2
  np.testing.assert_allclose(var.numpy(), [-0.3], rtol=1e-6)
  out = loop(it, tf.constant(1, tf.int64))
  assert bool(out.finite) and int(learner.global_step.numpy()) == 3
  with pytest.raises(tf.errors.OutOfRangeError):  # One element left: step 4 then the end.
    loop(it, tf.constant(5, tf.int64))
  assert int(learner.global_step.numpy()) == 4
  np.testing.assert_allclose(var.numpy(), [-1.0], rtol=1e-6)


def testLoopSetsTheFPropContextStep():
  var = tf.Variable([0.0], name='w')
  learner = _SgdLearner([var])
  seen = tf.Variable(-1, dtype=tf.int64, name='seen')
  dataset = tf.data.Dataset.from_tensors(np.float32(0.0)).repeat()

  def ForwardBackward(x):
    seen.assign(tf.cast(py_utils.CurrentContext().step, tf.int64))
    return _Metrics(0.0), [(tf.reshape(x, [1]), var)]

  loop = learner.BuildLoop(dataset.element_spec, ForwardBackward)
  loop(iter(dataset), tf.constant(3, tf.int64))
  assert int(seen.numpy()) == 2  # Steps 0, 1, 2 ran, each under its own step.


# -- float16 loss scaling ---------------------------------------------------------------


@pytest.mark.parametrize('key, value, message', [
    ('mode', 'static', r"loss_scale.mode='static': expected one of auto, dynamic, none\."),
    ('factor', 1.0, r'task.train.loss_scale: factor must be in \(1, inf\), got 1.0'),
    ('initial_scale', float('inf'), r'initial_scale must be in \(0, inf\), got inf'),
    ('min_scale', 2.0 ** 20, r'min_scale=1048576.0 is above initial_scale=32768.0'),
    ('growth_interval', 0, r'growth_interval=0: expected an integer >= 1'),
])
def testBadLossScaleParamsAreClearErrors(key, value, message):
  tp = base_model.TrainParams()
  tp.loss_scale.Set(**{key: value})
  with pytest.raises(ValueError, match=message):
    base_model._CheckTrainParams('task', tp)  # pylint: disable=protected-access


def _ScaledLearner(variables, **scale):
  tp = base_model.TrainParams()
  tp.optimizer = optimizer.SGD.Params()
  tp.learning_rate = 1.0
  tp.loss_scale.Set(mode='dynamic', **scale)
  step = tf.Variable(0, dtype=tf.int64, name='global_step')
  return learner_lib.Learner(tp, variables, step)


def testAnOverflowSkipsTheStepAndTheScaleAdapts():
  var = tf.Variable([1.0], name='w')
  learner = _ScaledLearner([var], initial_scale=4.0, growth_interval=2, min_scale=1.0)
  scale = learner.loss_scale

  def Step(grad, loss=1.0):
    step = learner.global_step.read_value()
    return learner.Apply(step, _Metrics(loss), [(tf.constant([grad]), var)])

  out = Step(float('inf'))  # Overflow: skipped, not applied, the scale halved; training goes on.
  assert bool(out.finite) and bool(out.skipped) and float(out.loss_scale) == 2.0
  assert var.numpy()[0] == 1.0 and int(learner.optimizer.iterations.numpy()) == 0
  assert int(learner.global_step.numpy()) == 1 and int(scale.skipped_steps.numpy()) == 1
  out = Step(0.5)
  assert bool(out.finite) and not bool(out.skipped) and float(out.loss_scale) == 2.0
  assert var.numpy()[0] == 0.5 and int(learner.global_step.numpy()) == 2
  out = Step(0.5)  # The second finite step in a row: the scale grows.
  assert float(out.loss_scale) == 4.0 and int(scale.good_steps.numpy()) == 0
  for expected in (2.0, 1.0):
    out = Step(float('nan'))
    assert bool(out.skipped) and float(out.loss_scale) == expected
  out = Step(float('nan'))  # At min_scale: not an overflow; the guard stops.
  assert not bool(out.finite) and not bool(out.skipped) and float(out.loss_scale) == 1.0
  assert int(learner.global_step.numpy()) == 5 and var.numpy()[0] == 0.0
  what, applied = base_runner._NonFinite(out)  # pylint: disable=protected-access
  assert not applied and what == ('loss 1, gradient norm nan is not finite at the minimum loss '
                                  'scale 1 (loss_scale.min_scale), so it is not skipped as a '
                                  'float16 overflow')
  out = Step(0.5, loss=float('nan'))  # A NaN loss is never an overflow.
  assert not bool(out.finite) and not bool(out.skipped) and float(out.loss_scale) == 1.0
  assert int(scale.skipped_steps.numpy()) == 3


def testALoopCountsItsSkippedSteps():
  var = tf.Variable([0.0], name='w')
  learner = _ScaledLearner([var], initial_scale=8.0)
  dataset = tf.data.Dataset.from_tensor_slices(
      np.array([1.0, np.inf, 2.0, np.inf, 3.0], np.float32))

  def ForwardBackward(x):  # A finite loss whose gradient is the element.
    return _Metrics(0.0), [(tf.reshape(x, [1]), var)]

  out = learner.BuildLoop(dataset.element_spec, ForwardBackward)(iter(dataset),
                                                                 tf.constant(5, tf.int64))
  assert bool(out.finite) and int(out.skips) == 2 and float(out.loss_scale) == 2.0
  assert int(learner.global_step.numpy()) == 5
  np.testing.assert_allclose(var.numpy(), [-6.0])


def testTheLoopRunsTheBackwardUnderTheScale():
  var = tf.Variable([0.0], name='w')
  learner = _ScaledLearner([var], initial_scale=8.0)
  seen = tf.Variable(0.0, name='seen')
  dataset = tf.data.Dataset.from_tensors(np.float32(1.0)).repeat()

  def ForwardBackward(x):
    seen.assign(py_utils.CurrentContext().loss_scale)
    return _Metrics(0.0), [(tf.reshape(x, [1]), var)]

  learner.BuildLoop(dataset.element_spec, ForwardBackward)(iter(dataset), tf.constant(1, tf.int64))
  assert float(seen.numpy()) == 8.0


_DIM, _BATCH = 8, 16


def _Stack(sched, fprop_dtype=tf.float32, **kwargs):
  cells = [layers.SequentialLayer.Params().Set(name=f'c{i}', sub=[
      layers.ProjectionLayer.Params().Set(name=f'p{i}{j}', input_dim=_DIM, output_dim=_DIM,
                                          activation='RELU') for j in range(2)])
           for i in range(2)]
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, schedule=sched, fprop_dtype=fprop_dtype,
      **dict(dict(num_micro_batches=4), **kwargs)).Instantiate()


def _Input():
  return tf.random.stateless_normal([_BATCH, _DIM], [3, 4])


def _MeanLoss(y, factor=1.0):
  return factor * tf.reduce_mean(tf.square(tf.cast(y, tf.float32) - 0.5))


@pytest.mark.parametrize('sched, loop', [('gpipe', False), ('1f1b', False), ('zb_h1', False),
                                         ('1f1b', True)])
def testAScaledFloat32BackwardGivesTheSameGradientsBitwise(sched, loop):
  pipe = _Stack(sched, num_micro_batches=8 if loop else 4, loop_steady_state=loop)
  x = _Input()
  step = tf.function(lambda: pipe.ForwardBackward(pipe.theta, x, _MeanLoss, loss_reduction='mean'))
  loss, grads = step()
  with py_utils.Context(loss_scale=tf.constant(2.0 ** 15)):
    scaled_step = tf.function(lambda: pipe.ForwardBackward(pipe.theta, x, _MeanLoss,
                                                           loss_reduction='mean'))
    scaled_loss, scaled_grads = scaled_step()
    graph = scaled_step.get_concrete_function().graph
  assert steady_state.LoopsIn(graph) == int(loop)
  assert float(scaled_loss) == float(loss)
  for g, s in zip(tf.nest.flatten(grads), tf.nest.flatten(scaled_grads)):
    np.testing.assert_array_equal(g.numpy(), s.numpy())


def testALossInFloat16IsScaledToo():
  """A loss_fn that returns float16 (value and weight) under a float32 scale."""
  pipe = _Stack('1f1b', fprop_dtype=tf.float16)
  x = _Input()

  def Loss(y):
    return tf.reduce_mean(tf.square(y - 0.5)), tf.constant(1.0, tf.float16)

  plain = tf.function(lambda: pipe.ForwardBackward(pipe.theta, x, Loss, loss_reduction='mean'))()
  with py_utils.Context(loss_scale=tf.constant(16.0)):
    scaled = tf.function(lambda: pipe.ForwardBackward(pipe.theta, x, Loss, loss_reduction='mean'))()
  for g, s in zip(tf.nest.flatten(plain[1]), tf.nest.flatten(scaled[1])):
    np.testing.assert_allclose(s.numpy(), g.numpy(), rtol=1e-2, atol=1e-3)


def testScaledGradientsOfATapeAreUnscaled():
  w = tf.Variable([[0.5, -1.0]], name='w')
  for scale in (None, tf.constant(1024.0)):
    with py_utils.Context(loss_scale=scale):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(w))
      grads = py_utils.ScaledGradients(tape, loss, [w, tf.Variable(1.0, name='unused')])
    np.testing.assert_array_equal(grads[0].numpy(), [[1.0, -2.0]])
    assert float(grads[1]) == 0.0


def testFloat16GradientsUnderflowWithoutTheScaleAndNotWithIt():
  """A loss whose gradients at the outputs (~1e-8) lie below float16's smallest value."""
  reference = _Stack('1f1b')
  pipe = _Stack('1f1b', fprop_dtype=tf.float16)
  for v, r in zip(pipe.variables, reference.variables):
    v.assign(r)
  x = _Input()

  def Grads(layer, scale=None):
    def Loss(y):
      return _MeanLoss(y, factor=1e-6)

    with py_utils.Context(loss_scale=scale):
      return tf.nest.flatten(tf.function(lambda: layer.ForwardBackward(layer.theta, x, Loss,
                                                                       loss_reduction='mean'))()[1])

  expected = Grads(reference)
  assert all(np.all(g.numpy() == 0) for g in Grads(pipe))
  scaled = Grads(pipe, tf.constant(2.0 ** 15))
  for g, e in zip(scaled, expected):
    assert g.dtype == tf.float32
    assert np.max(np.abs(g.numpy() - e.numpy())) <= 0.02 * np.max(np.abs(e.numpy()))


@pytest.mark.parametrize('fprop_dtype, mode, expected', [
    (tf.float16, 'auto', 'dynamic'), (tf.bfloat16, 'auto', 'none'), (tf.float32, 'auto', 'none'),
    (tf.float16, 'none', 'none'), (tf.float32, 'dynamic', 'dynamic')])
def testAutoScalesTheLossOfATaskThatComputesInFloat16(fprop_dtype, mode, expected):
  stack = _Stack('1f1b', fprop_dtype)
  assert loss_scale.Resolved(loss_scale.Params().Set(mode=mode), stack).mode == expected
