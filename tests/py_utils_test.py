"""Tests of lingvo_gpipe.foundation.py_utils."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import py_utils

NestedMap = py_utils.NestedMap


def _Map():
  return NestedMap(a=1, b=NestedMap(c=2, d=[3, NestedMap(e=4)]), f=5)


def testAttributeAccess():
  m = _Map()
  assert m.b.d[1].e == 4
  m.g = 6
  assert m['g'] == 6
  del m.g
  with pytest.raises(AttributeError, match="no key 'g'"):
    _ = m.g


@pytest.mark.parametrize('key', ['keys', '1a', 'a-b', 3])
def testBadKeys(key):
  with pytest.raises(ValueError, match='invalid'):
    NestedMap({key: 1})


def testTfNestHandlesItNatively():
  m = _Map()
  doubled = tf.nest.map_structure(lambda x: 2 * x, m)
  assert isinstance(doubled, NestedMap) and isinstance(doubled.b, NestedMap)
  assert doubled.b.d[1].e == 8
  assert tf.nest.flatten(m) == [1, 2, 3, 4, 5]


def testFlattenPackTransform():
  m = _Map()
  assert m.Flatten() == [1, 2, 3, 4, 5]
  assert [k for k, _ in m.FlattenItems()] == ['a', 'b.c', 'b.d[0]', 'b.d[1].e', 'f']
  packed = m.Pack([10, 20, 30, 40, 50])
  assert packed.b.d[1].e == 40 and isinstance(packed, NestedMap)
  assert m.Transform(lambda x: -x).Flatten() == [-1, -2, -3, -4, -5]


def testFilter():
  m = _Map()
  odd = m.Filter(lambda x: x % 2 == 1)
  assert odd.Flatten() == [1, 3, 5]
  assert 'c' not in odd.b and 'e' not in odd.b.d  # Emptied maps are dropped.
  assert NestedMap(a=2).Filter(lambda x: x > 5) == NestedMap()


def testIsCompatible():
  m = _Map()
  assert m.IsCompatible(m.Transform(str))
  other = _Map()
  other.b.d.append(0)
  assert not m.IsCompatible(other)
  assert not m.IsCompatible(NestedMap(a=1))


def testDebugString():
  m = NestedMap(x=tf.zeros([2, 3]), y=NestedMap(z='hi'))
  assert m.DebugString().splitlines() == ["x    float32[2, 3]", "y.z  'hi'"]


@pytest.mark.parametrize('init,check', [
    (py_utils.WeightInit.Constant(0.5), lambda v: np.all(v == 0.5)),
    (py_utils.WeightInit.Uniform(0.1), lambda v: np.all(np.abs(v) <= 0.1) and v.std() > 0.04),
    (py_utils.WeightInit.Gaussian(2.0), lambda v: abs(v.std() - 2.0) < 0.1),
    # Glorot bound for [400, 600]: sqrt(6 / 1000); uniform std = bound / sqrt(3).
    (py_utils.WeightInit.Xavier(1.0),
     lambda v: np.all(np.abs(v) <= (6 / 1000) ** 0.5) and
     abs(v.std() - (6 / 1000) ** 0.5 / 3 ** 0.5) < 0.002),
])
def testWeightInits(init, check):
  seed = py_utils.PathSeed(1, 'a/w')
  v = py_utils.InitialValue(init, [400, 600], tf.float32, seed).numpy()
  assert v.shape == (400, 600) and check(v)
  again = py_utils.InitialValue(init, [400, 600], tf.float32, seed).numpy()
  np.testing.assert_array_equal(v, again)


def testWeightParams():
  wp = py_utils.WeightParams([2, 3], py_utils.WeightInit.Gaussian(0.1), tf.float16)
  assert wp.shape == [2, 3] and wp.init.method == 'gaussian' and wp.dtype == tf.float16
  assert wp.trainable


def testUnknownInitIsAnError():
  bad = py_utils.WeightInit.Gaussian()
  bad.method = 'orthogonal'
  with pytest.raises(ValueError, match="'orthogonal'"):
    py_utils.InitialValue(bad, [2], tf.float32, py_utils.PathSeed(0, 'x'))


def testContextIsScoped():
  assert py_utils.CurrentContext().training
  with py_utils.EvalMode():
    assert not py_utils.CurrentContext().training
    with py_utils.Context(step=3):
      assert py_utils.CurrentContext().step == 3
      assert not py_utils.CurrentContext().training
    assert py_utils.CurrentContext().step is None
  assert py_utils.CurrentContext().training


def _NumpyMix(x):
  """The 32-bit avalanche BatchUniform's hash is made of, in numpy's uint32 arithmetic."""
  x = np.asarray(x, np.uint32)
  with np.errstate(over='ignore'):  # Products wrap modulo 2^32, as intended.
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):
      x = (x ^ (x >> np.uint32(shift))) * np.uint32(factor)
  return x ^ (x >> np.uint32(16))


def _WholeBatchNoise(seed, step, shape):
  """The reference: the hash of (seed, step, position) of each float of the whole batch,
  batch first, computed in numpy."""
  positions = np.arange(np.prod(shape), dtype=np.uint32)
  key = _NumpyMix((seed & 0x7FFFFFFF) ^ 0x9E3779B9)
  key = _NumpyMix(_NumpyMix(key ^ np.uint32(step & 0xFFFFFFFF)) ^ np.uint32(step >> 32))
  with np.errstate(over='ignore'):
    bits = _NumpyMix(positions * (_NumpyMix(key) | np.uint32(1)) + key)
  return ((bits >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)).reshape(shape)


@pytest.mark.parametrize('size,num_parts', [(12, 1), (12, 3), (12, 4), (12, 12)])
def testBatchUniformSlicesAreTheWholeBatchNoise(size, num_parts):
  # Rows of 5 x 3 floats: slices start at any float offset, not only at multiples of 4.
  whole = _WholeBatchNoise(7, 3, [size, 5, 3])
  rows = size // num_parts
  for part in range(num_parts):
    with py_utils.Context(batch_slice=py_utils.BatchSlice(part * rows, rows)):
      got = py_utils.BatchUniform(7, 3, tf.zeros([rows, 5, 3])).numpy()
    np.testing.assert_array_equal(got, whole[part * rows:(part + 1) * rows])


def testBatchUniformOfReshapedTensorsFollowsTheExamples():
  # [rows * 5, 3] is batch-major: each example owns 5 consecutive rows.
  whole = _WholeBatchNoise(7, 3, [8, 5, 3]).reshape([40, 3])
  with py_utils.Context(batch_slice=py_utils.BatchSlice(tf.constant(6), 2)):
    got = py_utils.BatchUniform(7, 3, tf.zeros([10, 3])).numpy()
  np.testing.assert_array_equal(got, whole[30:])


def testBatchUniformWithTimeMajorBatch():
  whole = _WholeBatchNoise(7, 3, [6, 4, 2])  # Batch first.
  with py_utils.Context(batch_slice=py_utils.BatchSlice(2, 2, batch_dim=1)):
    got = py_utils.BatchUniform(7, 3, tf.zeros([4, 2, 2])).numpy()
  np.testing.assert_array_equal(got, np.transpose(whole[2:4], [1, 0, 2]))


def testBatchUniformDependsOnSeedAndStep():
  x = tf.zeros([4, 4])
  draws = [py_utils.BatchUniform(seed, step, x).numpy() for seed, step in
           [(7, 3), (7, 4), (8, 3)]]
  assert not np.array_equal(draws[0], draws[1])
  assert not np.array_equal(draws[0], draws[2])
  np.testing.assert_array_equal(draws[0], py_utils.BatchUniform(7, tf.constant(3), x))
  # Large steps stay distinct (integers, never float-carried), also beyond 32 bits.
  for step in (2**24, 2**32):
    assert not np.array_equal(py_utils.BatchUniform(7, step, x),
                              py_utils.BatchUniform(7, step + 1, x))
    np.testing.assert_array_equal(py_utils.BatchUniform(7, step, x),
                                  _WholeBatchNoise(7, step, [4, 4]))


def testBatchUniformIsTheSameUnderXla():
  """XLA's own stateless random kernels give other numbers than TensorFlow's: the noise's
  hash is integer arithmetic, the same in both; uniform enough for dropout masks."""
  x = tf.zeros([64, 1024])
  compiled = tf.function(lambda x: py_utils.BatchUniform(7, 3, x), jit_compile=True)(x)
  eager = py_utils.BatchUniform(7, 3, x).numpy()
  np.testing.assert_array_equal(compiled.numpy(), eager)



def testBatchUniformIsUniformAndUncorrelated():
  """65536 numbers: in [0, 1), uniform, and neither neighbours nor the numbers of the next
  step, of a neighbouring seed or of the next rows correlate."""
  draw = lambda seed, step: py_utils.BatchUniform(seed, step, tf.zeros([64, 1024])).numpy()
  u = draw(7, 3)
  assert 0.0 <= u.min() and u.max() < 1.0
  assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
  histogram, _ = np.histogram(u, bins=16, range=(0.0, 1.0))
  assert np.all(np.abs(histogram / u.size - 1 / 16) < 0.003)
  flat = u.ravel()
  for other in (flat[1:], draw(7, 4).ravel(), draw(8, 3).ravel(), np.roll(flat, 1024)):
    assert abs(np.corrcoef(flat[:other.size], other)[0, 1]) < 0.02


def _Scaler(scale, function):
  @function(autograph=False)
  def Scaled(x):
    return x * scale
  return Scaled


@pytest.mark.parametrize('function,warns', [(tf.function, True),
                                            (py_utils.DistinctFunction, False)])
def testDistinctFunctionsOfOneClosureAreNotRetracesToTensorFlow(function, warns, caplog):
  """Eight functions of one closure, each traced once: tf.function's retracing warning
  counts them as one function (the premise), DistinctFunction's does not."""
  scalers = [_Scaler(float(i), function) for i in range(8)]
  assert [float(f(tf.constant(2.0))) for f in scalers] == [2.0 * i for i in range(8)]
  assert any('retracing' in r.getMessage() for r in caplog.records) == warns
