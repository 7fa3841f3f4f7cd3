"""Tests of lingvo_gpipe.foundation.base_layer."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils


class _Affine(base_layer.BaseLayer):
  """y = x @ w + b."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 3, 'Input depth.')
    p.Define('output_dim', 4, 'Output depth.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable('w', py_utils.WeightParams([p.input_dim, p.output_dim]))
    self.CreateVariable('b', py_utils.WeightParams([p.output_dim],
                                                   py_utils.WeightInit.Constant(0.5)))

  def FProp(self, theta, x):
    return tf.matmul(x, theta.w) + theta.b


class _Stack(base_layer.BaseLayer):
  """Two affine layers in a list and one more as a named child."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateChildren('l', [_Affine.Params(), _Affine.Params().Set(input_dim=4)])
    self.CreateChild('out', _Affine.Params().Set(input_dim=4, output_dim=2))

  def FProp(self, theta, x):
    for layer, th in zip(self.l, theta.l):
      x = layer.FProp(th, x)
    return self.out.FProp(theta.out, x)


def _StackParams(seed=None):
  return _Stack.Params().Set(name='stack', random_seed=seed)


def testParamsAreFrozenAndNamed():
  layer = _StackParams().Instantiate()
  assert layer.params.is_frozen and layer.params.name == 'stack'
  with pytest.raises(ValueError, match='non-empty name'):
    _Stack.Params().Instantiate()


def testVariablePathsAndThetaMirrorChildren():
  layer = _StackParams().Instantiate()
  names = sorted(v.name for v in layer.variables)
  assert names == ['stack/l0/b:0', 'stack/l0/w:0', 'stack/l1/b:0', 'stack/l1/w:0',
                   'stack/out/b:0', 'stack/out/w:0']
  theta = layer.theta
  assert isinstance(theta, py_utils.NestedMap)
  assert [k for k, _ in theta.FlattenItems()] == [
      'l[0].b', 'l[0].w', 'l[1].b', 'l[1].w', 'out.b', 'out.w']
  assert theta.l[1].w is layer.l[1].vars.w
  assert layer.out.path == 'stack/out'


def testInitIsDeterministicPerSeedAndPath():
  a = _StackParams().Instantiate()
  b = _StackParams().Instantiate()
  c = _StackParams(seed=5).Instantiate()
  for x, y, z in zip(a.variables, b.variables, c.variables):
    np.testing.assert_array_equal(x.numpy(), y.numpy())
    if 'w' in x.name:
      assert not np.array_equal(x.numpy(), z.numpy())
  # Siblings with the same shape differ.
  assert not np.array_equal(a.l[0].vars.w.numpy()[:, :3], a.l[1].vars.w.numpy()[:3, :3])


def testFPropIsPureInTheta():
  layer = _StackParams().Instantiate()
  x = tf.random.stateless_normal([5, 3], [1, 2])
  zero_theta = layer.theta.Transform(tf.zeros_like)
  np.testing.assert_array_equal(layer.FProp(zero_theta, x).numpy(), np.zeros([5, 2]))

  def Plain(x):
    for name in ('l0', 'l1'):
      i = int(name[1])
      x = x @ layer.theta.l[i].w + layer.theta.l[i].b
    return x @ layer.theta.out.w + layer.theta.out.b

  np.testing.assert_allclose(layer(x).numpy(), Plain(x).numpy(), rtol=1e-6)


def testWorksInTfFunctionAndGradients():
  layer = _StackParams().Instantiate()
  x = tf.ones([2, 3])

  @tf.function
  def Step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer(x))
    return tape.gradient(loss, layer.trainable_variables)

  grads = Step()
  assert len(grads) == 6 and all(g is not None for g in grads)


def testCheckpointRoundTrip(tmp_path):
  a = _StackParams().Instantiate()
  b = _StackParams(seed=9).Instantiate()
  path = tf.train.Checkpoint(model=a).save(str(tmp_path / 'ckpt'))
  tf.train.Checkpoint(model=b).restore(path).assert_consumed()
  for x, y in zip(a.variables, b.variables):
    np.testing.assert_array_equal(x.numpy(), y.numpy())


def testDuplicateNamesAreErrors():
  class Dup(base_layer.BaseLayer):

    def __init__(self, params):
      super().__init__(params)
      self.CreateVariable('w', py_utils.WeightParams([1]))
      self.CreateChild('w', _Affine.Params())

  with pytest.raises(ValueError, match="'w' is already"):
    Dup.Params().Set(name='d').Instantiate()

  class DupChildren(base_layer.BaseLayer):

    def __init__(self, params):
      super().__init__(params)
      self.CreateChildren('l', [_Affine.Params().Set(name='a')] * 2)

  with pytest.raises(ValueError, match='duplicate names'):
    DupChildren.Params().Set(name='d').Instantiate()


def testFPropDtypeIsInherited():
  p = _StackParams().Set(fprop_dtype=tf.bfloat16)
  layer = p.Instantiate()
  assert layer.out.fprop_dtype == tf.bfloat16
  assert layer.out.vars.w.dtype == tf.float32
  assert layer.ToFPropDtype(tf.ones([2])).dtype == tf.bfloat16
  assert layer.ToFPropDtype(tf.ones([2], tf.int32)).dtype == tf.int32


def testDtypeIsInheritedByChildrenLeftAtTheDefault():
  layer = _StackParams().Set(dtype=tf.float64).Instantiate()
  assert {v.dtype for v in layer.variables} == {tf.float64}
  assert layer.out.fprop_dtype == tf.float64
  half = _StackParams().Set(dtype=tf.float64, fprop_dtype=tf.float32).Instantiate()
  assert half.out.vars.w.dtype == tf.float64 and half.out.fprop_dtype == tf.float32


def testParamsInitIsInheritedByChildrenLeftAtTheDefault():
  """Lingvo's rule: a parent's params_init reaches every child that names none; a child's
  own, and a variable's own (b's constant), still win."""
  p = _StackParams()
  p.params_init = py_utils.WeightInit.Constant(3.0)
  layer = p.Instantiate()
  for child in (layer.l[0], layer.l[1], layer.out):
    np.testing.assert_array_equal(child.vars.w.numpy(), 3.0)
    np.testing.assert_array_equal(child.vars.b.numpy(), 0.5)
  default = _StackParams().Instantiate()
  assert not np.all(default.out.vars.w.numpy() == 3.0)  # Xavier, as before.


def testFPropMetaIsOptional():
  assert not _Affine.HasFPropMeta()
  with pytest.raises(NotImplementedError):
    _Affine.FPropMeta(_Affine.Params(), tf.TensorShape([2, 3]))


class _Counter(base_layer.BaseLayer):
  """Counts the rows it has seen: a stand-in for batch-norm statistics."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateVariable('seen', py_utils.WeightParams(
        [], py_utils.WeightInit.Constant(0.0), trainable=False))

  def FProp(self, theta, x):
    self.RecordUpdate(tf.cast(tf.shape(x)[0], tf.float32))
    return x

  def CombineUpdates(self, stats_list):
    return tf.add_n(stats_list)

  def ApplyUpdate(self, stats):
    self.vars.seen.assign_add(stats)


def testUpdatesApplyAtOnceOrWhenCollected():
  layer = _Counter.Params().Set(name='c').Instantiate()
  layer(tf.ones([3, 1]))
  assert layer.vars.seen.numpy() == 3
  updates = []
  with py_utils.Context(updates=updates):
    layer(tf.ones([2, 1]))
    layer(tf.ones([5, 1]))
  assert layer.vars.seen.numpy() == 3 and len(updates) == 2
  base_layer.ApplyRecordedUpdates(updates)
  assert layer.vars.seen.numpy() == 10


# -- identity: transparent groupings, checkpoint keys, the call count ----------------------


class _Group(base_layer.BaseLayer):
  """A transparent grouping of affine layers (as a pipeline cell is)."""

  TRANSPARENT = True

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('names', ['a'], 'Names of the affine children.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChildren('sub', [_Affine.Params().Set(name=n, input_dim=4)
                                for n in self.params.names])


class _Grouped(base_layer.BaseLayer):
  """The same affine layers a0..a3 in groups of the given sizes."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('sizes', [4], 'Layers per group.')
    return p

  def __init__(self, params):
    super().__init__(params)
    starts = np.cumsum([0] + self.params.sizes)
    self.CreateChildren('g', [_Group.Params().Set(names=[f'a{i}' for i in range(a, b)])
                              for a, b in zip(starts, starts[1:])])


def testTransparentGroupsAreNotPartOfNamesSeedsOrCheckpoints(tmp_path):
  one, two = (_Grouped.Params().Set(name='m', sizes=s).Instantiate() for s in ([4], [1, 3]))
  assert one.g[0].path == 'm/g0' and one.g[0].scope == 'm'
  assert one.g[0].sub[2].path == two.g[1].sub[1].path == 'm/a2'
  for a, b in zip(one.variables, two.variables):
    assert a.name == b.name and np.array_equal(a.numpy(), b.numpy())
  assert sorted(one.IdentityItems()) == ['a0', 'a1', 'a2', 'a3']
  path = tf.train.Checkpoint(model=one).save(str(tmp_path / 'ckpt'))
  keys = {k for k, _ in tf.train.list_variables(path)}
  assert 'model/a3/w/.ATTRIBUTES/VARIABLE_VALUE' in keys
  for v in two.variables:
    v.assign(tf.zeros_like(v))
  tf.train.Checkpoint(model=two).restore(path).assert_consumed()
  for a, b in zip(one.variables, two.variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  assert set(one.LayersByPath()) == {'m', 'm/g0', 'm/a0', 'm/a1', 'm/a2', 'm/a3'}


class _DuplicateGroups(base_layer.BaseLayer):
  """Two groups that both hold a layer a0: after the groups vanish, one name for two layers."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateChildren('g', [_Group.Params().Set(names=['a0']) for _ in range(2)])


def testNamesMustBeUniqueAcrossTransparentGroups():
  with pytest.raises(ValueError, match=r'two layers or variables are named m/a0'):
    _DuplicateGroups.Params().Set(name='m').Instantiate()


def testATransparentLayerOwnsNoVariables():
  class Bad(_Group):

    def __init__(self, params):
      super().__init__(params)
      self.CreateVariable('w', py_utils.WeightParams([1]))

  with pytest.raises(ValueError, match='groups layers and cannot own variable'):
    Bad.Params().Set(name='bad').Instantiate()


def testTrainingStepIsTheContextsElseTheCallCount():
  layer = _Affine.Params().Set(name='l').Instantiate()
  with py_utils.Context(step=7):
    assert int(layer.TrainingStep()) == 7
  assert [int(layer.TrainingStep()) for _ in range(2)] == [0, 1]
  assert int(tf.function(layer.TrainingStep)()) == 2
  assert not any('call_count' in v.name for v in layer.variables)


# -- mixed precision: FProp receives theta and inputs in fprop_dtype ----------------------


class _ResidualMlp(base_layer.BaseLayer):
  """The README's layer: no casts of its own."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateVariable('w1', py_utils.WeightParams([4, 8]))
    self.CreateVariable('w2', py_utils.WeightParams([8, 4]))
    self.CreateVariable('count', py_utils.WeightParams([4], trainable=False))

  def FProp(self, theta, x):
    self.seen = (theta.w1.dtype, theta.count.dtype, x.dtype)
    return x + tf.nn.relu(x @ theta.w1) @ theta.w2


class _OptedOut(_ResidualMlp):
  CAST_TO_FPROP_DTYPE = False

  def FProp(self, theta, x):
    self.seen = (theta.w1.dtype, theta.count.dtype, x.dtype)
    return x


def testFPropGetsTrainableThetaAndFloatInputsInFPropDtype():
  layer = _ResidualMlp.Params().Set(name='mlp', fprop_dtype=tf.bfloat16).Instantiate()
  x = tf.random.stateless_normal([3, 4], [1, 2])
  with tf.GradientTape() as tape:
    y = layer(x)
    loss = tf.reduce_sum(tf.cast(y, tf.float32))
  grads = tape.gradient(loss, [layer.vars.w1, layer.vars.w2])
  # Moving statistics and other non-trainable state keep their dtype.
  assert layer.seen == (tf.bfloat16, tf.float32, tf.bfloat16)
  assert [g.dtype for g in grads] == [tf.float32, tf.float32]
  w1, w2, xb = (tf.cast(v, tf.bfloat16) for v in (layer.vars.w1, layer.vars.w2, x))
  np.testing.assert_array_equal(y.numpy(), (xb + tf.nn.relu(xb @ w1) @ w2).numpy())
  assert all(v.dtype == tf.float32 for v in layer.variables)


def testCastLeavesIntegersAndMatchingDtypesAlone():
  layer = _ResidualMlp.Params().Set(name='mlp', fprop_dtype=tf.bfloat16).Instantiate()
  ids = tf.constant([1, 2])
  same = tf.zeros([2], tf.bfloat16)
  theta, args, kwargs = layer.CastToFPropDtype(layer.theta, (ids, same), {'x': np.ones(2)})
  assert args[0] is ids and args[1] is same
  assert kwargs['x'].dtype == tf.bfloat16 and theta.w1.dtype == tf.bfloat16
  assert isinstance(theta, py_utils.NestedMap) and theta.count is layer.vars.count


def testALayerCanOptOutOfTheCast():
  layer = _OptedOut.Params().Set(name='mlp', fprop_dtype=tf.bfloat16).Instantiate()
  layer(tf.zeros([2, 4]))
  assert layer.seen == (tf.float32, tf.float32, tf.float32)
