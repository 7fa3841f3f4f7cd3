"""Tests of lingvo_gpipe.training.optimizer against hand-computed and numpy reference updates."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.training import optimizer


def _Run(params, initial, grads, lr=0.1, use_function=False):
  """Applies grads[0], grads[1], ... to a variable; returns its values, optimizer, slots."""
  var = tf.Variable(np.array(initial, np.float32), name='w')
  opt = params.Instantiate()
  opt.CreateSlots([var])
  apply = tf.function(opt.Apply) if use_function else opt.Apply
  values = []
  for g in grads:
    apply(lr, [(tf.constant(g, tf.float32), var)])
    values.append(var.numpy().copy())
  return values, opt, opt.Slots(var)


def testSgd():
  values, _, slots = _Run(optimizer.SGD.Params(), [1.0, 2.0], [[0.5, -1.0]])
  assert not slots
  np.testing.assert_allclose(values[0], [0.95, 2.1], rtol=1e-6)


def testMomentumByHand():
  # m = 1 -> w = 1 - 0.1 * 1 = 0.9; m = 0.9 * 1 + 0.5 = 1.4 -> w = 0.9 - 0.14 = 0.76.
  values, opt, _ = _Run(optimizer.Momentum.Params(), [1.0], [[1.0], [0.5]])
  np.testing.assert_allclose([v[0] for v in values], [0.9, 0.76], rtol=1e-6)
  assert int(opt.iterations.numpy()) == 2


def testNesterovMomentumByHand():
  # w = 1 - 0.1 * (1 + 0.9 * 1) = 0.81; m = 1.4 -> w = 0.81 - 0.1 * (0.5 + 0.9 * 1.4) = 0.634.
  p = optimizer.Momentum.Params().Set(use_nesterov=True)
  values, _, _ = _Run(p, [1.0], [[1.0], [0.5]])
  np.testing.assert_allclose([v[0] for v in values], [0.81, 0.634], rtol=1e-6)


def _AdamReference(w, grads, lr, b1=0.9, b2=0.999, eps=1e-8):
  w, m, v, out = np.array(w, np.float64), 0.0, 0.0, []
  for t, g in enumerate(grads, 1):
    g = np.array(g, np.float64)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    w = w - lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
    out.append(w)
  return out


def testAdam():
  grads = [[2.0, -0.5], [1.0, 0.25], [-3.0, 1.0]]
  values, _, _ = _Run(optimizer.Adam.Params(), [1.0, 1.0], grads, use_function=True)
  # By hand: the first step moves each weight by lr against the sign of its gradient.
  np.testing.assert_allclose(values[0], [0.9, 1.1], rtol=1e-5)
  np.testing.assert_allclose(values, _AdamReference([1.0, 1.0], grads, 0.1), rtol=1e-5)


def _AdafactorReference(w, grads, lr, beta1=0.0, factored=True, clip=1.0):
  w = np.array(w, np.float64)
  state = {}
  out = []
  for t, g in enumerate(grads, 1):
    g = np.array(g, np.float64)
    decay = 1 - t**-0.8
    g2 = g * g + 1e-30
    if factored:
      state['r'] = decay * state.get('r', 0) + (1 - decay) * g2.mean(axis=1)
      state['c'] = decay * state.get('c', 0) + (1 - decay) * g2.mean(axis=0)
      v = np.outer(state['r'], state['c']) / state['r'].mean()
    else:
      v = state['v'] = decay * state.get('v', 0) + (1 - decay) * g2
    u = g / np.sqrt(v)
    u = u / max(1.0, np.sqrt(np.mean(u * u)) / clip)
    if beta1:
      u = state['m'] = beta1 * state.get('m', 0) + (1 - beta1) * u
    w = w - lr * max(1e-3, np.sqrt(np.mean(w * w))) * u
    out.append(w)
  return out


def testAdafactorFirstStepByHand():
  # g = outer([1, 2], [1, -1, 3]) has rank-1 g^2, so the factored estimate is exact:
  # v = g^2, u = sign(g), rms(u) = 1 (no clipping), step = lr * rms(w).
  g = np.outer([1.0, 2.0], [1.0, -1.0, 3.0])
  w = np.full([2, 3], 2.0)
  p = optimizer.Adafactor.Params().Set(min_dim_size_to_factor=2)
  values, _, slots = _Run(p, w, [g])
  np.testing.assert_allclose(values[0], w - 0.1 * 2.0 * np.sign(g), rtol=1e-6)
  assert sorted(slots) == ['vc', 'vr']


@pytest.mark.parametrize('factored', [True, False])
@pytest.mark.parametrize('beta1', [0.0, 0.9])
def testAdafactorAgainstReference(factored, beta1):
  rng = np.random.RandomState(0)
  grads = [rng.normal(size=[2, 3]) for _ in range(3)]
  grads[1] = 40.0 * grads[0]  # A sudden large gradient: update clipping acts.
  w = rng.normal(size=[2, 3])
  p = optimizer.Adafactor.Params().Set(beta1=beta1, factored=factored, min_dim_size_to_factor=2)
  values, _, slots = _Run(p, w, grads, use_function=True)
  np.testing.assert_allclose(values, _AdafactorReference(w, grads, 0.1, beta1, factored),
                             rtol=1e-4, atol=1e-6)
  slot_shapes = {k: v.shape.as_list() for k, v in slots.items()}
  expected = {'vr': [2], 'vc': [3]} if factored else {'v': [2, 3]}
  if beta1:
    expected['m'] = [2, 3]
  assert slot_shapes == expected


def testAdafactorDoesNotFactorSmallMatrices():
  var = tf.Variable(tf.zeros([4, 8]), name='small')
  opt = optimizer.Adafactor.Params().Instantiate()
  opt.CreateSlots([var])
  assert sorted(opt.Slots(var)) == ['v']


def testSlotsLiveOnTheVariablesDevice():
  with tf.device('/device:CPU:2'):
    var = tf.Variable(tf.zeros([3]), name='stage2/w')
  opt = optimizer.Adam.Params().Instantiate()
  opt.CreateSlots([var])
  assert all(s.device.endswith('CPU:2') for s in opt.Slots(var).values())


def testSlotsRoundTripThroughCheckpoints(tmp_path):
  _, opt, slots = _Run(optimizer.Adam.Params(), [1.0, 2.0], [[1.0, -1.0], [0.5, 0.5]])
  path = tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / 'ckpt'))
  var = tf.Variable([0.0, 0.0], name='w')
  fresh = optimizer.Adam.Params().Instantiate()
  fresh.CreateSlots([var])
  tf.train.Checkpoint(optimizer=fresh).read(path).assert_consumed()
  assert int(fresh.iterations.numpy()) == 2
  for name in ('m', 'v'):
    np.testing.assert_array_equal(fresh.Slots(var)[name].numpy(), slots[name].numpy())


def testApplyWithoutSlotsIsAClearError():
  opt = optimizer.SGD.Params().Instantiate()
  with pytest.raises(KeyError, match='CreateSlots'):
    opt.Apply(0.1, [(tf.ones([1]), tf.Variable([1.0], name='unknown'))])


@pytest.mark.parametrize('params,message', [
    (optimizer.Adam.Params().Set(beta1=2.0), r'Adam: beta1 must be in \[0, 1\), got 2.0'),
    (optimizer.Adam.Params().Set(beta2=-3.0), r'Adam: beta2 must be in \[0, 1\), got -3.0'),
    (optimizer.Adam.Params().Set(epsilon=-1.0), r'Adam: epsilon must be in \(0, inf\), got -1.0'),
    (optimizer.Momentum.Params().Set(momentum=1.0), r'momentum must be in \[0, 1\), got 1.0'),
    (optimizer.Adafactor.Params().Set(decay_exponent=float('nan')),
     r'Adafactor: decay_exponent must be in \(0, inf\), got nan'),
])
def testBadParamsAreClearErrors(params, message):
  with pytest.raises(ValueError, match=message):
    params.Instantiate()


_ALL_OPTIMIZERS = [optimizer.SGD.Params(), optimizer.Momentum.Params(), optimizer.Adam.Params(),
                   optimizer.Adafactor.Params().Set(beta1=0.9, min_dim_size_to_factor=2)]


@pytest.mark.parametrize('params', _ALL_OPTIMIZERS, ids=lambda p: p.cls.__name__)
@pytest.mark.parametrize('lr', [float('nan'), float('inf'), 1e39])
@pytest.mark.filterwarnings('ignore:overflow encountered in cast')  # 1e39 as a float32.
def testAnUpdateThatIsNotFiniteIsReported(params, lr):
  # The Learner gates on the learning rate and the gradients; Apply reports what it made.
  var = tf.Variable(np.ones([2, 2], np.float32), name='w')
  opt = params.Instantiate()
  opt.CreateSlots([var])
  grad = tf.constant([[0.5, -1.0], [2.0, 0.25]])
  assert bool(tf.function(opt.Apply)(0.1, [(grad, var)]))  # A finite update first.
  assert np.all(np.isfinite(var.numpy()))
  assert not bool(tf.function(opt.Apply)(lr, [(grad, var)]))
  assert not np.all([np.all(np.isfinite(v.numpy())) for v in opt.variables + (var,)])


def testAnUpdateThatOverflowsTheWeightsIsReported():
  var = tf.Variable([3e38, 1.0], name='w')
  opt = optimizer.SGD.Params().Instantiate()
  opt.CreateSlots([var])
  assert bool(opt.Apply(1.0, [(tf.constant([1e38, 0.0]), var)]))
  assert var.numpy()[0] == np.float32(3e38) - np.float32(1e38)
  assert not bool(opt.Apply(1.0, [(tf.constant([-3e38, 0.0]), var)]))  # 5e38 > float32 max.
  assert var.numpy()[1] == 1.0


@pytest.mark.parametrize('params', _ALL_OPTIMIZERS, ids=lambda p: p.cls.__name__)
def testEachNewValueIsComputedOnce(params):
  calls = []

  class Counting(params.cls):

    def _NewValuesOne(self, lr, grad, var, slots, t):
      calls.append(var.name)
      return super()._NewValuesOne(lr, grad, var, slots, t)

  opt = params.Copy().Set(cls=Counting).Instantiate()
  variables = [tf.Variable(np.ones([2, 2], np.float32), name='a'),
               tf.Variable(np.ones([3], np.float32), name='b')]
  opt.CreateSlots(variables)
  tf.function(opt.Apply)(0.1, [(tf.ones_like(v), v) for v in variables])
  assert calls == ['a:0', 'b:0']
