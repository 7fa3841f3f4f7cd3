"""Tests of lingvo_gpipe.keras_pipeline.PipelineModel against keras.Sequential."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import keras_pipeline

_STEPS, _BATCH = 20, 16


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
  """The loss Keras logs after each batch (the epoch's running mean)."""

  def __init__(self):
    super().__init__()
    self.losses = []

  def on_train_batch_end(self, batch, logs=None):
    self.losses.append(logs['loss'])


def _Fit(model, x, y):
  model.compile(keras.optimizers.Adam(1e-2), 'mse')
  losses = _BatchLosses()
  model.fit(x, y, batch_size=_BATCH, shuffle=False, verbose=0, callbacks=[losses])
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
  """Dropout whose mask plain TensorFlow draws over the whole batch from (seed, step):
  the numbers KerasLayer's micro-batches claim to draw their parts of."""

  def __init__(self, rate, seed, step_fn):
    super().__init__()
    self._rate, self._seed, self._step_fn = rate, seed, step_fn

  def call(self, x, training=False):
    if not training:
      return x
    seed = tf.random.experimental.stateless_fold_in(
        tf.constant([self._seed, 0], tf.int64), tf.cast(self._step_fn(), tf.int64))
    keep = tf.random.stateless_uniform(tf.shape(x), seed, alg='philox') < 1 - self._rate
    return tf.where(keep, x / (1 - self._rate), 0.0)


def _WithDropoutAndItsReference(random_seed, **pipeline_args):
  """(PipelineModel of _Layers with dropout, a keras.Sequential of the same weights whose
  dropout draws the pipeline's masks in plain TensorFlow)."""
  keras.utils.set_random_seed(random_seed)
  layers = _Layers(dropout=True)
  pipe = keras_pipeline.PipelineModel(layers, input_shape=(12,), **pipeline_args)
  seed = pipe.pipeline.LayersByPath()['pipeline/dropout1'].layer_seed
  ref_layers = list(layers)
  ref_layers[1] = _ReferenceDropout(0.25, seed, lambda: ref.optimizer.iterations)
  ref = keras.Sequential([keras.Input((12,))] + ref_layers)
  ref.set_weights(pipe.get_weights())
  return pipe, ref


def testTrainingEqualsSequentialWithDropoutOverMicroBatches():
  pipe, ref = _WithDropoutAndItsReference(2, num_stages=4, num_micro_batches=4)
  x, y = _Data(seed=3)
  pipe_losses, ref_losses = _Fit(pipe, x, y), _Fit(ref, x, y)
  np.testing.assert_allclose(pipe_losses, ref_losses, rtol=1e-5)
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


def testCallbacksValidationSaveLoadAndExport(tmp_path):
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
    np.testing.assert_allclose(exported.serve(x[:rows]).numpy(), expected[:rows], rtol=1e-6)


def testPartialLastBatchTrainsLikeSequential():
  """40 examples in batches of 16, 16 and 8, M=3: micro-batches 6, 5, 5 and 3, 3, 2, with
  dropout; losses and weights equal the unpipelined model's."""
  pipe, ref = _WithDropoutAndItsReference(4, num_stages=2, num_micro_batches=3)
  x, y = _Data(40, seed=5)
  pipe_losses, ref_losses = _Fit(pipe, x, y), _Fit(ref, x, y)
  assert len(pipe_losses) == 3
  np.testing.assert_allclose(pipe_losses, ref_losses, rtol=1e-5)
  assert _RelativeDifference(pipe.get_weights(), ref.get_weights()) < 1e-5
  np.testing.assert_allclose(pipe.predict(x[:7], batch_size=_BATCH, verbose=0),
                             ref.predict(x[:7], verbose=0), rtol=1e-5, atol=1e-6)


def testALastBatchSmallerThanMIsAClearErrorAndScheduleIsChecked():
  pipe = keras_pipeline.PipelineModel(_Layers(), num_stages=2, num_micro_batches=4,
                                      input_shape=(12,))
  pipe.compile('sgd', 'mse')
  x, y = _Data(34)  # Batches of 16, 16 and 2.
  with pytest.raises(tf.errors.InvalidArgumentError, match='at least num_micro_batches x '
                     'num_replicas = 4 examples'):
    pipe.fit(x, y, batch_size=_BATCH, verbose=0)
  with pytest.raises(ValueError, match='not supported'):
    keras_pipeline.PipelineModel(_Layers(), schedule='1f1b')


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
