"""Tests of lingvo_gpipe.runners.keras_pipeline.PipelineModel against keras.Sequential."""

import functools
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import steady_state
from lingvo_gpipe.runners import keras_pipeline

_STEPS, _BATCH = 20, 16
# Chunks per device of the schedules that run more than one.
_V = {'interleaved_1f1b': 2, 'zbv': 2}


def _Layers(batch_norm=False, dropout=False):
  layers = [keras.layers.Dense(32, activation='relu')]
  if batch_norm:
    layers.append(keras.layers.BatchNormalization())
  if dropout:
    layers.append(keras.layers.Dropout(0.25))
  return layers + [keras.layers.Dense(16, activation='tanh'),
                   keras.layers.Dense(16, activation='relu'), keras.layers.Dense(4)]


def _Data(n=_STEPS * _BATCH, seed=0):
  rng = np.random.RandomState(seed)
  return rng.normal(size=(n, 12)).astype('float32'), rng.normal(size=(n, 4)).astype('float32')


class _BatchLosses(keras.callbacks.Callback):
  """The loss and metric Keras log after each batch (the epoch's running means)."""

  def __init__(self):
    super().__init__()
    self.losses = []

  def on_train_batch_end(self, batch, logs=None):
    self.losses.append((logs['loss'], logs['mae']))


def _Fit(model, x, y, sample_weight=None, batch_size=_BATCH):
  """[steps, 2]: the logged loss and mean absolute error of one epoch of fit()."""
  model.compile(keras.optimizers.Adam(1e-2), 'mse', metrics=['mae'])
  losses = _BatchLosses()
  model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size, shuffle=False, verbose=0,
            callbacks=[losses])
  return np.array(losses.losses)


def _RelativeDifference(a_list, b_list):
  return max(np.max(np.abs(a - b)) / np.max(np.abs(b)) for a, b in zip(a_list, b_list))


def testTrainingEqualsSequentialWithBatchNorm():
  keras.utils.set_random_seed(1)
  seq = keras.Sequential([keras.Input((12,))] + _Layers(batch_norm=True))
  pipe = keras_pipeline.PipelineModel(seq, num_stages=4, num_micro_batches=1)
  assert [w.shape for w in pipe.get_weights()] == [w.shape for w in seq.get_weights()]
  x, y = _Data()
  pipe_losses, seq_losses = _Fit(pipe, x, y), _Fit(seq, x, y)
  assert len(pipe_losses) == _STEPS
  np.testing.assert_allclose(pipe_losses, seq_losses, rtol=1e-5)
  # Every weight, the batch-norm moving statistics included, in Sequential's order.
  assert _RelativeDifference(pipe.get_weights(), seq.get_weights()) < 1e-5
  np.testing.assert_allclose(pipe.predict(x[:64], batch_size=_BATCH, verbose=0),
                             seq.predict(x[:64], verbose=0), rtol=1e-4, atol=1e-5)


class _ReferenceDropout(keras.layers.Layer):
  """Dropout whose mask is drawn over the whole batch at once from (seed, step): the noise
  KerasLayer's micro-batches claim to draw their parts of (py_utils_test checks the noise's
  numbers against numpy)."""

  def __init__(self, rate, seed, step_fn):
    super().__init__()
    self._rate, self._seed, self._step_fn = rate, seed, step_fn

  def call(self, x, training=False):
    if not training:
      return x
    keep = py_utils.BatchUniform(self._seed, self._step_fn(), x) < 1 - self._rate
    return tf.where(keep, x / (1 - self._rate), 0.0)


def _WithDropoutAndItsReference(random_seed, batch_norm=False, **pipeline_args):
  """(PipelineModel of _Layers with dropout, a keras.Sequential of the same weights whose
  dropout draws the pipeline's masks in plain TensorFlow)."""
  keras.utils.set_random_seed(random_seed)
  layers = _Layers(batch_norm=batch_norm, dropout=True)
  pipe = keras_pipeline.PipelineModel(layers, input_shape=(12,), **pipeline_args)
  i = next(i for i, layer in enumerate(layers) if isinstance(layer, keras.layers.Dropout))
  seed = pipe.pipeline.LayersByPath()[f'pipeline/dropout{i}'].layer_seed
  ref_layers = list(layers)
  ref_layers[i] = _ReferenceDropout(0.25, seed, lambda: ref.optimizer.iterations)
  ref = keras.Sequential([keras.Input((12,))] + ref_layers)
  ref.set_weights(pipe.get_weights())
  return pipe, ref


def _Schedule(sched):
  """PipelineModel arguments of schedule `sched` on 2 devices."""
  return dict(num_stages=2, schedule=sched, virtual_stages=_V.get(sched, 1))


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testEveryScheduleTrainsLikeSequential(sched):
  """20 steps of batches of 14 rows, M=4 (micro-batches of 4, 4, 3 and 3), dropout: the
  logged loss and metric, the weights, evaluate() and predict() equal the Sequential's."""
  pipe, ref = _WithDropoutAndItsReference(2, num_micro_batches=4, **_Schedule(sched))
  x, y = _Data(_STEPS * 14, seed=3)
  pipe_losses, ref_losses = _Fit(pipe, x, y, batch_size=14), _Fit(ref, x, y, batch_size=14)
  assert len(pipe_losses) == _STEPS
  np.testing.assert_allclose(pipe_losses, ref_losses, rtol=1e-5)
  assert _RelativeDifference(pipe.get_weights(), ref.get_weights()) < 1e-5
  np.testing.assert_allclose(pipe.evaluate(x, y, batch_size=14, verbose=0),
                             ref.evaluate(x, y, batch_size=14, verbose=0), rtol=1e-5)
  np.testing.assert_allclose(pipe.predict(x[:7], batch_size=_BATCH, verbose=0),
                             ref.predict(x[:7], verbose=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testEveryScheduleTrainsBatchNormAndDropoutLikeSequential(sched):
  """M=1, where batch norm's statistics are the whole batch's as in the Sequential."""
  pipe, ref = _WithDropoutAndItsReference(1, batch_norm=True, num_micro_batches=1,
                                          **_Schedule(sched))
  x, y = _Data(seed=4)
  pipe_losses, ref_losses = _Fit(pipe, x, y), _Fit(ref, x, y)
  np.testing.assert_allclose(pipe_losses, ref_losses, rtol=1e-5)
  # Every weight, the batch-norm moving statistics included.
  assert _RelativeDifference(pipe.get_weights(), ref.get_weights()) < 1e-5


def testWeightsMoveBetweenSequentialAndPipeline():
  seq = keras.Sequential([keras.Input((12,))] + _Layers(batch_norm=True))
  pipe = keras_pipeline.PipelineModel(_Layers(batch_norm=True), num_stages=2,
                                      num_micro_batches=2, input_shape=(12,))
  x, y = _Data(64)
  _Fit(seq, x, y)  # Moving statistics away from their initial values.
  pipe.set_weights(seq.get_weights())
  np.testing.assert_allclose(pipe.predict(x, batch_size=_BATCH, verbose=0),
                             seq.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def testATrainingCallBeforeCompileIsDifferentiableLikeSequential():
  """model(x, training=True) needs no optimizer: batch norm normalizes by the batch,
  and the gradients under a tape are the Sequential's."""
  keras.utils.set_random_seed(5)
  seq = keras.Sequential([keras.Input((12,))] + _Layers(batch_norm=True))
  pipe = keras_pipeline.PipelineModel(seq, num_stages=2, num_micro_batches=1)
  x, _ = _Data(16)
  outputs, grads = [], []
  for model in (pipe, seq):
    with tf.GradientTape() as tape:
      outputs.append(model(x, training=True))
      loss = tf.reduce_sum(tf.square(outputs[-1]))
    grads.append([g.numpy() for g in tape.gradient(loss, model.trainable_weights)])
  np.testing.assert_allclose(*outputs, rtol=1e-5, atol=1e-6)
  assert _RelativeDifference(*grads) < 1e-5


def testCallbacksValidationSaveLoadAndExport(tmp_path):
  keras.utils.set_random_seed(2)
  # Built on its first batch: the layers do not say their input shape.
  pipe = keras_pipeline.PipelineModel(_Layers(), num_stages=2, num_micro_batches=2)
  pipe.compile('adam', 'mse')
  x, y = _Data(64)
  callbacks = [keras.callbacks.TensorBoard(str(tmp_path / 'tb')),
               keras.callbacks.ModelCheckpoint(str(tmp_path / 'last.keras')),
               keras.callbacks.EarlyStopping(min_delta=10.0, patience=1)]
  history = pipe.fit(x, y, batch_size=_BATCH, epochs=5, validation_data=_Data(32, seed=1),
                     callbacks=callbacks, verbose=0)
  assert len(history.history['val_loss']) == 2  # No epoch improves by 10: stopped.
  assert os.listdir(tmp_path / 'tb' / 'train') and os.listdir(tmp_path / 'tb' / 'validation')
  loaded = keras.models.load_model(tmp_path / 'last.keras')
  assert isinstance(loaded, keras_pipeline.PipelineModel) and loaded.pipeline.num_stages == 2
  expected = pipe.predict(x, batch_size=_BATCH, verbose=0)
  np.testing.assert_array_equal(loaded.predict(x, batch_size=_BATCH, verbose=0), expected)
  assert loaded.evaluate(x, y, batch_size=_BATCH, verbose=0) == pytest.approx(
      pipe.evaluate(x, y, batch_size=_BATCH, verbose=0), rel=1e-6)
  pipe.export(str(tmp_path / 'export'), verbose=False)  # A [None, 12] signature.
  exported = tf.saved_model.load(str(tmp_path / 'export'))  # Kept: serve needs its variables.
  for rows in (1, 5, _BATCH):  # Fewer rows than micro-batches, uneven, even.
    # Kernels sum in another order for another number of rows: absolute float32 noise.
    np.testing.assert_allclose(exported.serve(x[:rows]).numpy(), expected[:rows], rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize('sched,examples,num_micro', [
    ('gpipe', 40, 3), ('zbv', 40, 3)] + [(s, 34, 4) for s in named_schedules.SCHEDULE_NAMES])
def testPartialLastBatchTrainsLikeSequential(sched, examples, num_micro):
  """Batches of 16, 16 and a partial one, with dropout: 40 examples at M=3 (micro-batches
  6, 5, 5 and 3, 3, 2), and 34 at M=4, whose last batch of 2 leaves micro-batches of 1, 1, 0
  and 0 examples. Losses, weights and predictions equal the unpipelined model's, for the
  whole-batch loss of 'gpipe' and the per-micro-batch loss of the others."""
  pipe, ref = _WithDropoutAndItsReference(examples % 7, num_micro_batches=num_micro,
                                          **_Schedule(sched))
  x, y = _Data(examples, seed=examples % 7)
  pipe_losses, ref_losses = _Fit(pipe, x, y), _Fit(ref, x, y)
  assert len(pipe_losses) == 3
  np.testing.assert_allclose(pipe_losses, ref_losses, rtol=1e-5)
  assert _RelativeDifference(pipe.get_weights(), ref.get_weights()) < 1e-5
  np.testing.assert_allclose(pipe.predict(x[:7], batch_size=_BATCH, verbose=0),
                             ref.predict(x[:7], verbose=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('sched', ['gpipe', '1f1b'])
def testPerTokenOutputsWithAPartialLastBatchTrainLikeSequential(sched):
  """Dense layers over [rows, tokens, features] with a partial last batch (40 rows, batches
  of 16): their weight gradients' shapes are partly unknown at trace time, which failed
  every schedule ('Cannot convert a partially known TensorShape')."""
  rng = np.random.RandomState(0)
  x, y = rng.normal(size=(40, 6, 8)).astype('float32'), rng.randint(0, 5, (40, 6))
  keras.utils.set_random_seed(1)
  ref = keras.Sequential([keras.Input((6, 8)), keras.layers.Dense(16, activation='relu'),
                          keras.layers.Dense(5)])
  initial = ref.get_weights()
  pipe = keras_pipeline.PipelineModel(ref, num_micro_batches=2, **_Schedule(sched))
  ref.set_weights(initial)
  results = []
  for model in (pipe, ref):
    model.compile('sgd', keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    results.append(model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history['loss'])
  np.testing.assert_allclose(results[0], results[1], rtol=1e-6)
  assert _RelativeDifference(pipe.get_weights(), ref.get_weights()) < 1e-6


@pytest.mark.parametrize('sched', ['gpipe', 'zb_h1'])
def testBatchNormOfBatchesSmallerThanMTrainsAsMicroBatchesOfOneRow(sched):
  """Keras's batch norm normalizes each micro-batch, and its statistics over an empty one
  are NaN: batches of 2 rows at M=4 train as at M=2, in fit() (a batch size known when the
  step runs) and in train_on_batch() (known when traced), NaN nowhere."""
  results = []
  for m in (2, 4):
    keras.utils.set_random_seed(3)
    pipe = keras_pipeline.PipelineModel(_Layers(batch_norm=True, dropout=True),
                                        input_shape=(12,), num_micro_batches=m,
                                        **_Schedule(sched))
    x, y = _Data(10, seed=7)
    losses = _Fit(pipe, x, y, batch_size=2)
    losses = np.append(losses, pipe.train_on_batch(x[:2], y[:2]))
    results.append([losses] + pipe.get_weights())
  for a, b in zip(*results):
    assert not np.isnan(a).any()
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def testScheduleAndVirtualStagesAreChecked():
  for kwargs, message in (
      (dict(schedule='zb'), "Unknown schedule 'zb'"),
      (dict(schedule='zbv'), "'zbv' runs 2 chunk.* virtual_stages=1"),
      (dict(schedule='1f1b', virtual_stages=2), "'1f1b' runs 1 chunk.* virtual_stages=2"),
      (dict(schedule='interleaved_1f1b', virtual_stages=0), 'virtual_stages .* got 0'),
      (dict(schedule='interleaved_1f1b', virtual_stages=2, num_micro_batches=3),
       'num_micro_batches=3')):
    with pytest.raises(ValueError, match=message):
      keras_pipeline.PipelineModel(_Layers(), num_stages=2, **kwargs)



def testALoopedSteadyStateTrainsAsEveryActionUnrolled():
  """M=64 at K=2: 'auto' (the default) loops 1F1B's steady state; False unrolls it, and the
  fit's losses and weights are the same bit for bit (tests/steady_state_test.py)."""
  x, y = _Data(2 * 128)
  results = []
  for loop in ('auto', False):
    keras.utils.set_random_seed(1)
    model = keras_pipeline.PipelineModel(_Layers(), num_stages=2, num_micro_batches=64,
                                         schedule='1f1b', input_shape=(12,),
                                         loop_steady_state=loop)
    program = model._pipeline.GetProgram(128).instructions
    looped = steady_state.Looped(steady_state.Windows(program), model._pipeline.params)
    assert bool(looped) == (loop == 'auto')
    results.append((_Fit(model, x, y, batch_size=128), model.get_weights()))
  np.testing.assert_array_equal(results[0][0], results[1][0])
  for a, b in zip(results[0][1], results[1][1]):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="loop_steady_state must be True, False or 'auto', "
                     "got 'yes'"):
    keras_pipeline.PipelineModel(_Layers(), num_stages=2, loop_steady_state='yes')


def testAnInputShapeOtherThanTheLayersIsAClearError():
  seq = keras.Sequential([keras.Input((12,))] + _Layers())
  with pytest.raises(ValueError, match=r'input_shape=\(9,\), but the layers take examples of '
                     r'shape \(12,\)'):
    keras_pipeline.PipelineModel(seq, num_stages=2, input_shape=(9,))


def testAMaskIsRefusedNotLostAtACut():
  """Embedding(mask_zero=True) | pooling: the pooling would average the padding too."""
  layers = [keras.Input((6,), dtype='int32'), keras.layers.Embedding(10, 4, mask_zero=True),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)]
  with pytest.raises(ValueError, match="embedding0: the Keras layer .* makes a Keras mask"):
    keras_pipeline.PipelineModel(layers, num_stages=2, num_micro_batches=2)


def testMoreStagesThanDevicesNeedAllowDeviceReuse():
  """4 logical test devices: 8 stages are a ValueError, or round-robin when allowed."""
  with pytest.raises(ValueError, match=r'needs 8 devices .* allow_device_reuse=True'):
    keras_pipeline.PipelineModel(_Layers() + _Layers(), num_stages=8, input_shape=(12,))
  keras.utils.set_random_seed(1)
  seq = keras.Sequential([keras.Input((12,))] + _Layers() + _Layers())
  pipe = keras_pipeline.PipelineModel(seq, num_stages=8, num_micro_batches=2,
                                      allow_device_reuse=True)
  ref = keras.Sequential([keras.Input((12,))] + _Layers() + _Layers())
  ref.set_weights(seq.get_weights())
  x, y = _Data(4 * _BATCH)
  np.testing.assert_allclose(_Fit(pipe, x, y), _Fit(ref, x, y), rtol=1e-5)
  assert len(set(pipe.pipeline.ReplicaDevices(0))) == 4

def testWeightRegularizersAndSampleWeightsTrainLikeSequential():
  """Uneven micro-batches (16 rows, M=3) of a per-micro-batch schedule."""
  def Layers():
    return [keras.layers.Dense(16, activation='relu', kernel_regularizer='l2'),
            keras.layers.Dense(4, bias_regularizer=keras.regularizers.L1(0.1))]

  keras.utils.set_random_seed(5)
  seq = keras.Sequential([keras.Input((12,))] + Layers())
  pipe = keras_pipeline.PipelineModel(seq, num_micro_batches=3, **_Schedule('zb_h1'))
  x, y = _Data(5 * _BATCH, seed=6)
  weights = np.random.RandomState(7).uniform(0, 2, len(x)).astype('float32')
  pipe_losses, seq_losses = _Fit(pipe, x, y, weights), _Fit(seq, x, y, weights)
  np.testing.assert_allclose(pipe_losses, seq_losses, rtol=1e-5)
  assert _RelativeDifference(pipe.get_weights(), seq.get_weights()) < 1e-5
  with pytest.raises(ValueError, match='activity_regularizer'):
    keras_pipeline.PipelineModel([keras.layers.Dense(4, activity_regularizer='l2')],
                                 input_shape=(12,))


def testSaveAndLoadKeepTheSchedule(tmp_path):
  pipe = keras_pipeline.PipelineModel(_Layers(), num_micro_batches=2, input_shape=(12,),
                                      **_Schedule('zbv'))
  x, y = _Data(3 * _BATCH)
  _Fit(pipe, x[:2 * _BATCH], y[:2 * _BATCH])
  pipe.save(tmp_path / 'zbv.keras')
  loaded = keras.models.load_model(tmp_path / 'zbv.keras')
  config = loaded.get_config()
  assert (config['schedule'], config['virtual_stages']) == ('zbv', 2)
  assert loaded.pipeline.placement == pipe.pipeline.placement == [0, 1, 1, 0]
  np.testing.assert_array_equal(loaded.predict(x, verbose=0), pipe.predict(x, verbose=0))
  for model in (pipe, loaded):  # The optimizer's state came back too.
    model.fit(x[2 * _BATCH:], y[2 * _BATCH:], batch_size=_BATCH, verbose=0)
  assert _RelativeDifference(loaded.get_weights(), pipe.get_weights()) < 1e-6


def testMixedPrecisionPolicy():
  x, y = _Data(32)
  losses = {}
  for policy in ('float32', 'mixed_bfloat16'):
    keras.mixed_precision.set_global_policy(policy)
    try:
      keras.utils.set_random_seed(4)
      pipe = keras_pipeline.PipelineModel(_Layers(), num_stages=2, num_micro_batches=2,
                                          input_shape=(12,))
    finally:
      keras.mixed_precision.set_global_policy('float32')
    if policy != 'float32':
      pipe.set_weights(weights)
      assert pipe.pipeline.fprop_dtype == tf.bfloat16
      assert pipe(x[:_BATCH]).dtype == tf.bfloat16
    weights = pipe.get_weights()
    losses[policy] = _Fit(pipe, x, y)
    assert all(w.dtype == np.float32 for w in pipe.get_weights())
  np.testing.assert_allclose(losses['mixed_bfloat16'], losses['float32'], rtol=3e-2)


def testALayersOwnDTypeHoldsUnderAMixedPolicy():
  """Keras's advice for mixed precision, a float32 output layer: it computes in float32, on
  either side of a cut, and training matches the Sequential's (M=1: bfloat16 matmuls of
  other row counts round otherwise)."""
  keras.mixed_precision.set_global_policy('mixed_bfloat16')
  try:
    keras.utils.set_random_seed(6)
    seq = keras.Sequential([keras.Input((12,))] + _Layers()[:-1] +
                           [keras.layers.Dense(4, dtype='float32')])
    pipe = keras_pipeline.PipelineModel(seq, num_stages=2, num_micro_batches=1)
  finally:
    keras.mixed_precision.set_global_policy('float32')
  assert [layer.compute_dtype for layer in pipe.pipeline_layers] == [
      layer.compute_dtype for layer in seq.layers] == ['bfloat16'] * 3 + ['float32']
  x, y = _Data(64)
  assert pipe(x[:_BATCH]).dtype == tf.float32
  losses = _Fit(pipe, x, y, batch_size=_BATCH), _Fit(seq, x, y, batch_size=_BATCH)
  np.testing.assert_allclose(*losses, rtol=1e-5)
  assert _RelativeDifference(pipe.get_weights(), seq.get_weights()) < 1e-5
  # Inference too: the float32 layer's weights were rounded to bfloat16 in call() (2e-3).
  pipe.set_weights(seq.get_weights())
  np.testing.assert_allclose(pipe.predict(x, batch_size=_BATCH, verbose=0),
                             seq.predict(x, batch_size=_BATCH, verbose=0), rtol=1e-5, atol=1e-6)
  assert pipe.evaluate(x, y, batch_size=_BATCH, verbose=0) == pytest.approx(
      seq.evaluate(x, y, batch_size=_BATCH, verbose=0), rel=1e-5)


def testNumpyIntegersCountAsInts():
  """np.int64(2) stages were refused as 'must be a positive int, got np.int64(2)'."""
  pipe = keras_pipeline.PipelineModel(_Layers(), num_stages=np.int64(2),
                                      num_micro_batches=np.int32(4),
                                      virtual_stages=np.int64(1), input_shape=(12,))
  assert pipe.pipeline.num_stages == 2 and pipe.pipeline.params.num_micro_batches == 4
  config = pipe.get_config()
  assert [type(config[k]) for k in ('num_stages', 'num_micro_batches', 'virtual_stages')] == [
      int] * 3


@pytest.mark.parametrize('stages,virtual', [(5, 1), (2, 2)])
def testTooFewLayersForTheChunksAreRefusedNamingTheChunks(stages, virtual):
  """3 layers: 2 stages of 2 chunks were refused as 'into 4 non-empty stages'."""
  with pytest.raises(ValueError, match=f'3 layers cannot be cut into num_stages \\* '
                     f'virtual_stages = {stages} \\* {virtual} = {stages * virtual} chunks'):
    keras_pipeline.PipelineModel(_Layers()[:3], num_stages=stages, virtual_stages=virtual,
                                 schedule='interleaved_1f1b', input_shape=(12,))


def testAFrozenModelFitsLikeSequential():
  """trainable = False: fit() logs the Sequential's losses and moves no weight."""
  keras.utils.set_random_seed(7)
  seq = keras.Sequential([keras.Input((12,))] + _Layers())
  pipe = keras_pipeline.PipelineModel(seq, num_stages=2, num_micro_batches=2)
  before = seq.get_weights()
  x, y = _Data(64)
  losses = []
  for model in (pipe, seq):
    model.trainable = False
    with pytest.warns(UserWarning, match='does not have any trainable weights'):
      losses.append(_Fit(model, x, y))
  np.testing.assert_allclose(*losses, rtol=1e-5)
  for after, initial in zip(pipe.get_weights(), before):
    np.testing.assert_array_equal(after, initial)


def testASequentialBlockIsCutLikeItsLayersAndAFunctionalModelIsRefused():
  keras.utils.set_random_seed(8)
  block = keras.Sequential([keras.layers.Dense(16, activation='tanh'), keras.layers.Dense(16)])
  seq = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16), block,
                          keras.layers.Dense(4)])
  pipe = keras_pipeline.PipelineModel(seq, num_stages=2, num_micro_batches=2)
  assert len(pipe.pipeline_layers) == 4
  x, y = _Data(64)
  np.testing.assert_allclose(_Fit(pipe, x, y), _Fit(seq, x, y), rtol=1e-5)
  assert _RelativeDifference(pipe.get_weights(), seq.get_weights()) < 1e-5
  inputs = keras.Input((16,))
  functional = keras.Model(inputs, keras.layers.Dense(16)(inputs), name='inner')
  with pytest.raises(ValueError, match="got the Functional 'inner', a model whose layers"):
    keras_pipeline.PipelineModel([keras.Input((12,)), keras.layers.Dense(16), functional],
                                 num_stages=2)


def testAFloat32HeadUnderAFloat64Policy():
  """A float64 global policy and a Dense(dtype='float32') head: each layer keeps its
  variables and compute dtype, as in the Sequential."""
  keras.mixed_precision.set_global_policy('float64')  # Not floatx: another test's policy wins.
  try:
    keras.utils.set_random_seed(9)
    seq = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation='tanh'),
                            keras.layers.Dense(4, dtype='float32')])
    pipe = keras_pipeline.PipelineModel(seq, num_stages=2, num_micro_batches=2)
  finally:
    keras.mixed_precision.set_global_policy('float32')
  assert [w.dtype for w in pipe.get_weights()] == [w.dtype for w in seq.get_weights()] == [
      np.float64, np.float64, np.float32, np.float32]
  x, _ = _Data(8)
  y = pipe(x)
  assert y.dtype == tf.float32
  np.testing.assert_allclose(y, seq(x), rtol=1e-6)


def testAnAdaptedNormalizationPredictsLikeSequential():
  """adapt() computes the statistics from the data; the copy takes them with its weights."""
  x, _ = _Data(64)
  norm = keras.layers.Normalization()
  norm.adapt(x * 3.0 + 2.0)
  seq = keras.Sequential([keras.Input((12,)), norm, keras.layers.Dense(4)])
  pipe = keras_pipeline.PipelineModel(seq, num_stages=2, num_micro_batches=2)
  want = seq.predict(x, verbose=0)
  assert _RelativeDifference([pipe.predict(x, verbose=0)], [want]) < 1e-6
  # Discretization keeps its bins in its config, no weights: nothing to finalize.
  bins = keras.layers.Discretization(num_bins=4)
  bins.adapt(x[:, 0])
  seq = keras.Sequential([keras.Input((12,)), bins])
  pipe = keras_pipeline.PipelineModel(seq, num_stages=1, input_shape=x.shape[1:])  # A tuple...
  np.testing.assert_array_equal(pipe.predict(x, verbose=0), seq.predict(x, verbose=0))
  pipe = keras_pipeline.PipelineModel(seq, num_stages=1, input_shape=tf.TensorShape([12]))
  np.testing.assert_array_equal(pipe.predict(x, verbose=0), seq.predict(x, verbose=0))


@pytest.mark.parametrize('sched', ['gpipe', '1f1b'])
def testALossOfPerExampleValuesAndFitWithoutTargetsAreRefusedClearly(sched):
  """reduction=None was refused as "Metric 'loss' must be a scalar, got shape (8,)", and
  fit(x) without y as an input that holds no tensor to split ('1f1b')."""
  x, y = _Data(32)
  for reduction in (None, 'none'):
    pipe = keras_pipeline.PipelineModel(_Layers(), num_stages=2, num_micro_batches=2,
                                        schedule=sched, input_shape=(12,))
    pipe.compile('sgd', keras.losses.MeanSquaredError(reduction=reduction))
    with pytest.raises(ValueError, match=re.escape(
        f"the loss's reduction={reduction!r} returns a value per example")):
      pipe.fit(x, y, batch_size=_BATCH, verbose=0)
  with pytest.raises(ValueError, match=r'fit\(\) got inputs but no targets \(y\)'):
    pipe.fit(x, batch_size=_BATCH, verbose=0)


def testWhatAPipelineWouldDropOrChangeIsRefused():
  """SpatialDropout (its mask is not per element), add_loss in call(), an overridden
  compute_loss in fit(), a loss with ignore_class but for 'gpipe', an input_shape of an int."""

  @keras.saving.register_keras_serializable('keras_pipeline_test')
  class AddsLoss(keras.layers.Layer):

    def call(self, x):
      self.add_loss(tf.reduce_sum(x))
      return x

  class _OwnLoss(keras_pipeline.PipelineModel):

    def compute_loss(self, *args, **kwargs):
      return 10.0 * super().compute_loss(*args, **kwargs)

  with pytest.raises(ValueError, match='SpatialDropout1D is not supported'):
    keras_pipeline.PipelineModel([keras.layers.SpatialDropout1D(0.5), keras.layers.Dense(2)],
                                 num_stages=2, input_shape=(3, 4))
  x, y = _Data(32)
  pipe = keras_pipeline.PipelineModel([keras.layers.Dense(4), AddsLoss()], num_stages=2,
                                      input_shape=(12,))
  pipe.compile('sgd', 'mse')
  with pytest.raises(ValueError, match='adds a loss in call'):
    pipe.fit(x, y, batch_size=_BATCH, verbose=0)
  own = _OwnLoss(_Layers(), num_stages=2, input_shape=(12,))
  own.compile('sgd', 'mse')
  with pytest.raises(ValueError, match='an overridden compute_loss would not run'):
    own.fit(x, y, batch_size=_BATCH, verbose=0)
  labels = np.arange(32) % 4 - 1  # A quarter of them ignored.
  unmerged = [
      (keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1),
       'ignore_class=-1 makes it a mean over the labels'),
      (functools.partial(keras.losses.sparse_categorical_crossentropy, from_logits=True,
                         ignore_class=-1), 'ignore_class=-1 makes it a mean over the labels'),
      (keras.losses.SparseCategoricalCrossentropy(
          from_logits=True, reduction='mean_with_sample_weight'),
       "reduction='mean_with_sample_weight' divides by the batch's sum of sample weights")]
  for loss, message in unmerged:
    for sched, refused in (('1f1b', True), ('gpipe', False)):
      pipe = keras_pipeline.PipelineModel(_Layers(), num_stages=2, num_micro_batches=2,
                                          schedule=sched, input_shape=(12,))
      pipe.compile('sgd', loss)
      if refused:
        with pytest.raises(ValueError, match=re.escape(message)):
          pipe.fit(x, labels, sample_weight=np.ones(32), batch_size=_BATCH, verbose=0)
      else:
        pipe.fit(x, np.maximum(labels, 0), sample_weight=np.ones(32), batch_size=_BATCH,
                 verbose=0)
  for bad in (8, '64', [64.7]):
    with pytest.raises(ValueError, match='input_shape must be the shape of one example, ints'):
      keras_pipeline.PipelineModel(_Layers(), num_stages=2, input_shape=bad)

  class Unregistered(keras.layers.Layer):

    def call(self, x):
      return x

  with pytest.raises(ValueError, match=r"dense0: a pipeline builds each Keras layer from its "
                     r"config, and Keras cannot: Received an invalid value for `units`"):
    keras_pipeline.PipelineModel([dict(keras.layers.serialize(keras.layers.Dense(2)),
                                       config=dict(units=-3))], num_stages=1, input_shape=(4,))
  with pytest.raises(ValueError, match=r"unregistered0: a pipeline builds each Keras layer "
                     r"from its config, and Keras cannot: Could not locate class 'Unregistered'"
                     r".*register_keras_serializable"):
    keras_pipeline.PipelineModel([Unregistered(), keras.layers.Dense(2)], num_stages=2,
                                 input_shape=(4,))


def testADropoutSeedChangesItsMasks():
  """Dropout(seed=s): the masks follow s (and are the same for the same s); no seed: the
  layer's path."""
  x = np.ones((16, 12), 'float32')

  def Masks(seed):
    pipe = keras_pipeline.PipelineModel([keras.layers.Dropout(0.5, seed=seed)], num_stages=1,
                                        input_shape=(12,))
    return pipe(x, training=True).numpy() == 0

  assert (Masks(1) == Masks(1)).all() and (Masks(None) == Masks(None)).all()
  assert (Masks(1) != Masks(2)).any() and (Masks(1) != Masks(None)).any()


def testAFitThatFailedToTraceLeavesTheModelTrainable():
  """A first fit() on inputs of the wrong width fails; a fit() on the right ones then trains
  as a model that never failed (Keras kept the failed step function, which returned nothing)."""
  x, y = _Data(32)
  weights = []
  for fail_first in (True, False):
    keras.utils.set_random_seed(0)
    pipe = keras_pipeline.PipelineModel(_Layers(), num_stages=2, num_micro_batches=2,
                                        schedule='1f1b', input_shape=(12,))
    pipe.compile('sgd', 'mse')
    if fail_first:
      with pytest.raises(ValueError, match='failed on the pipeline input'):
        pipe.fit(x[:, :5], y, batch_size=_BATCH, verbose=0)
    pipe.fit(x, y, batch_size=_BATCH, verbose=0, shuffle=False)
    weights.append(pipe.get_weights())
  assert _RelativeDifference(weights[0], weights[1]) == 0


def testMistakesOutsideGpipeAreOneLineErrors():
  """A per-example loss (reduction=None) and a training call are errors under a schedule that
  calls the loss per micro-batch; outputs of a variable length train there."""
  x, y = _Data(32)
  pipe = keras_pipeline.PipelineModel(_Layers(), num_stages=2, num_micro_batches=2,
                                      schedule='1f1b', input_shape=(12,))
  pipe.compile('sgd', keras.losses.MeanSquaredError(reduction=None))
  with pytest.raises(ValueError, match=r"the loss's reduction=None returns a value per example"):
    pipe.fit(x, y, batch_size=_BATCH, verbose=0)
  with pytest.raises(ValueError, match=r"training=True is differentiated as a whole, which "
                     r"only schedule='gpipe' runs; fit\(\) trains with schedule='1f1b'"):
    pipe(x, training=True)
  ragged = keras_pipeline.PipelineModel([keras.layers.Dense(3)], num_stages=1,
                                        num_micro_batches=2, schedule='1f1b',
                                        input_shape=(None, 4))
  ragged.compile('sgd', 'mse')
  # Outputs of a dimension unknown besides the batch train: the loss's reduction is declared.
  batches = ((np.ones((4, n, 4), 'float32'), np.ones((4, n, 3), 'float32')) for n in (5, 6))
  history = ragged.fit(tf.data.Dataset.from_generator(lambda: batches, output_signature=(
      tf.TensorSpec([4, None, 4]), tf.TensorSpec([4, None, 3]))), shuffle=False, verbose=0)
  assert np.isfinite(history.history['loss']).all()


def _ConvLayers():
  return [keras.layers.Conv2D(8, 3, activation='relu'),
          keras.layers.DepthwiseConv2D(3, activation='relu'), keras.layers.MaxPooling2D(2),
          keras.layers.SeparableConv2D(8, 2, activation='tanh'),
          keras.layers.AveragePooling2D(2, strides=1, padding='same'), keras.layers.Flatten(),
          keras.layers.Dense(4)]


@pytest.mark.parametrize('sched', ['gpipe', '1f1b'])
def testACnnWithBatchesSmallerThanMTrainsAndPredictsLikeSequential(sched, tmp_path):
  """Convolutions and pooling of an empty micro-batch (TensorFlow's CPU kernels returned their
  input on no rows; its max-pooling gradient aborted the process): a CNN at K=4, M=8 fits 22
  examples in batches of 16 and 6, and predicts (and its export serves) 5 and 1 rows, as the
  Sequential does."""
  keras.utils.set_random_seed(5)
  try:
    ref = keras.Sequential([keras.Input((8, 8, 3))] + _ConvLayers())
  finally:
    tf.random.set_seed(None)
  pipe = keras_pipeline.PipelineModel(ref, num_stages=4, num_micro_batches=8, schedule=sched)
  rng = np.random.RandomState(2)
  x = rng.normal(size=(22, 8, 8, 3)).astype('float32')
  y = rng.normal(size=(22, 4)).astype('float32')
  for rows in (5, 1):
    np.testing.assert_allclose(pipe.predict(x[:rows], verbose=0),
                               ref.predict(x[:rows], verbose=0), rtol=1e-5, atol=1e-6)
  pipe.export(str(tmp_path / 'export'))
  served = tf.saved_model.load(str(tmp_path / 'export'))
  for rows in (5, 1):
    np.testing.assert_allclose(served.serve(x[:rows]).numpy(), ref.predict(x[:rows], verbose=0),
                               rtol=1e-5, atol=1e-6)
  pipe_losses, ref_losses = _Fit(pipe, x, y), _Fit(ref, x, y)
  np.testing.assert_allclose(pipe_losses, ref_losses, rtol=1e-5)
  assert _RelativeDifference(pipe.get_weights(), ref.get_weights()) < 1e-5


def testABalanceCutsTheLayersAndTheSummaryShowsWhereEachRuns():
  """torchgpipe's balance=[...]: layers per chunk, in order; summary() lists each chunk's
  stage, device and layers; a balance that does not fit is one ValueError."""
  pipe = keras_pipeline.PipelineModel(_Layers(), num_stages=2, num_micro_batches=2,
                                      balance=[3, 1], input_shape=(12,))
  assert [len(cell.sub) for cell in pipe.pipeline.cell] == [3, 1]
  lines = []
  pipe.summary(print_fn=lines.append)
  names = [layer.name for layer in pipe.pipeline_layers]
  devices = pipe.pipeline.devices
  assert lines[-3:] == ['Pipeline chunks (chunk: stage on its device: layers):',
                        f'  0: stage 0 on {devices[0]}: {", ".join(names[:3])}',
                        f'  1: stage 1 on {devices[1]}: {names[3]}']
  x, y = _Data(64, seed=1)
  ref = keras.Sequential([keras.Input((12,))] + _Layers())
  ref.set_weights(pipe.get_weights())
  np.testing.assert_allclose(_Fit(pipe, x, y), _Fit(ref, x, y), rtol=1e-5)
  for balance, cost in (([2, 1], 'auto'), ([4, 0], 'auto'), ([2, 2], 'params')):
    with pytest.raises(ValueError, match='balance|not both'):
      keras_pipeline.PipelineModel(_Layers(), num_stages=2, balance=balance, cost=cost,
                                   input_shape=(12,))


@keras.saving.register_keras_serializable(package='keras_pipeline_test')
class FailsOnLargeInputs(keras.layers.Layer):
  """An op that fails when the step runs on a bad value, as a check deep in a model would."""

  def call(self, x):
    tf.debugging.assert_less(tf.reduce_max(x), 100.0, message='an input over 100')
    return x


def _FailingOnBatch3(inline=False, steps_per_execution=1):
  """A model whose middle chunk fails on the third batch of 8 rows of _BadData's x."""
  layers = [keras.Input((8,))] + [keras.layers.Dense(8, 'relu') for _ in range(5)] + [
      FailsOnLargeInputs(), keras.layers.Dense(8), keras.layers.Dense(1)]
  pipe = keras_pipeline.PipelineModel(keras.Sequential(layers), num_stages=4,
                                      num_micro_batches=4, schedule='1f1b',
                                      inline_cell_functions=inline)
  pipe.compile(optimizer='sgd', loss='mse', steps_per_execution=steps_per_execution)
  return pipe


def _BadData():
  x, y = np.ones((24, 8), np.float32), np.ones((24, 1), np.float32)
  x[17] = 1e6  # In the third batch of 8.
  return x, y


def testAnOpFailingInAChunkRaisesItsOwnError():
  """fit, evaluate and predict of a layer failing in a middle chunk on the third batch:
  TensorFlow reports that step as CancelledError, so it runs again eagerly on that batch and
  raises the op's own error; with inline_cell_functions the traced step raises it itself."""
  x, y = _BadData()
  for inline in (False, True):
    pipe = _FailingOnBatch3(inline)
    rerun = []
    for run in (lambda: pipe.fit(x, y, batch_size=8, shuffle=False, verbose=0),
                lambda: pipe.evaluate(x, y, batch_size=8, verbose=0),
                lambda: pipe.predict(x, batch_size=8, verbose=0)):
      with pytest.raises((ValueError, tf.errors.InvalidArgumentError),
                         match='an input over 100') as raised:
        run()
      notes = getattr(raised.value, '__notes__', [])
      # A rerun raises the layer's ValueError naming its cell; TensorFlow itself, where it
      # reports the op (not always: 1 step in 18), raises its InvalidArgumentError.
      assert notes == [errors.RERUN_NOTE] or (
          not notes and isinstance(raised.value, tf.errors.InvalidArgumentError)), notes
      rerun.append(bool(notes))
    assert any(rerun) != inline, rerun


def testAnOpFailingInAChunkUnderManyStepsPerCallSaysHowToSeeItsError():
  """With steps_per_execution > 1 the batch stays inside Keras's loop: a CancelledError says
  (once) how to see the op's error."""
  x, y = _BadData()
  with pytest.raises((tf.errors.CancelledError, tf.errors.InvalidArgumentError)) as raised:
    _FailingOnBatch3(steps_per_execution=3).fit(x, y, batch_size=8, shuffle=False, verbose=0)
  message = raised.value.message
  if isinstance(raised.value, tf.errors.CancelledError):
    assert message.startswith(errors.CANCELLED_STEP_HINT)
    assert message.count(errors.CANCELLED_STEP_HINT) == 1
  else:  # TensorFlow itself reported the op (1 run in 6).
    assert 'an input over 100' in message
