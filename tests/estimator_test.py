"""Tests of lingvo_gpipe.runners.estimator on the tiny pipelined regression experiment."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.runners import base_runner
from lingvo_gpipe.runners import estimator
from lingvo_gpipe.training import run_lock

_PARAMS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'testdata', 'params')
_MODEL = 'toy.regression.PipelinedRegression'

model_registry.ImportParams(_PARAMS_DIR)


def _Config(model_dir, **kwargs):
  settings = dict(iterations_per_loop=3, save_checkpoints_steps=3, log_step_count_steps=3)
  settings.update(kwargs)
  return estimator.RunConfig(model_dir=str(model_dir), **settings)


def _Scalars(directory):
  scalars = {}
  for name in sorted(os.listdir(directory)):
    if name.startswith('events.out.tfevents'):
      for event in tf.compat.v1.train.summary_iterator(os.path.join(directory, name)):
        for value in event.summary.value:
          scalars.setdefault(value.tag, {})[event.step] = float(tf.make_ndarray(value.tensor))
  return scalars


def _ModelValues(model_dir):
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(model_dir)))
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
          if name.startswith('model/')}


_SERVE = '''
import sys
sys.modules['lingvo_gpipe'] = None  # Any import of lingvo_gpipe now fails.
import numpy as np
import tensorflow as tf
serving = tf.saved_model.load(sys.argv[1]).signatures['serving_default']
x = np.load(sys.argv[2])['x']
np.save(sys.argv[3], serving(x=tf.constant(x))['y'].numpy())
'''


def testRegistryModelTrainEvaluatePredictExportAndResume(tmp_path):
  model_dir = tmp_path / 'model'
  est = estimator.Estimator.from_registry(_MODEL, _Config(model_dir))
  train_input = estimator.RegistryInputFn(_MODEL, 'Train')
  est.train(train_input, steps=6)
  assert est.global_step == 6
  assert tf.train.latest_checkpoint(str(model_dir)).endswith('ckpt-6')
  assert os.path.exists(model_dir / 'ckpt-3.index')
  scalars = _Scalars(model_dir)
  # Three steps per loop call: summaries at the ends of the calls.
  assert sorted(scalars['loss']) == [3, 6]
  for tag in ('learning_rate', 'grad_norm', 'abs_error'):
    assert sorted(scalars[tag]) == [3, 6], tag
  for tag in ('examples_per_second', 'step_time'):  # Not of the first call: it traced.
    assert sorted(scalars[tag]) == [6], tag

  # A new Estimator on the same model_dir resumes.
  est = estimator.Estimator.from_registry(_MODEL, _Config(model_dir))
  est.train(train_input, steps=3)
  assert est.global_step == 9
  assert sorted(_Scalars(model_dir)['loss']) == [3, 6, 9]

  dev_input = estimator.RegistryInputFn(_MODEL, 'Dev')
  results = est.evaluate(dev_input)
  assert sorted(results) == ['abs_error', 'global_step', 'loss'] and results['global_step'] == 9
  assert _Scalars(model_dir / 'eval')['loss'] == {9: pytest.approx(results['loss'])}

  # Predictions, one dict per example, agree with the evaluated loss.
  predictions = list(est.predict(dev_input))
  dev_batches = list(dev_input({'batch_size': 8}))
  assert len(predictions) == 16 and sorted(predictions[0]) == ['y']
  targets = np.concatenate([b.y.numpy() for b in dev_batches])
  predicted = np.stack([p['y'] for p in predictions])
  assert results['loss'] == pytest.approx(np.mean((predicted - targets)**2), rel=1e-5)

  # The SavedModel serves the same predictions in a process without lingvo_gpipe.
  # Its signature takes the features of the serving input: x, without the targets, and
  # batches of any size: 13 rows here (the predict batch is 8, and 13 is no multiple of M).
  serving_input = lambda params: dev_input(params).map(lambda b: py_utils.NestedMap(x=b.x))
  export_dir = est.export_saved_model(str(tmp_path / 'export'), serving_input)
  np.savez(tmp_path / 'x.npz', x=np.concatenate([b.x.numpy() for b in dev_batches])[:13])
  subprocess.run([sys.executable, '-c', _SERVE, export_dir, str(tmp_path / 'x.npz'),
                  str(tmp_path / 'y.npy')], check=True, timeout=120,
                 env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))
  np.testing.assert_allclose(np.load(tmp_path / 'y.npy'), predicted[:13], rtol=1e-5, atol=1e-6)


def _TaskParams():
  return model_registry.GetParams(_MODEL, 'Train').task


def _LossOnlyModelFn(features, labels, mode, params):
  """A TPUEstimator-style model_fn: the Estimator differentiates the returned loss."""
  assert params['batch_size'] == 8
  task = _TaskParams().Instantiate()
  if mode == estimator.ModeKeys.PREDICT:
    return estimator.EstimatorSpec(mode, predictions={'y': task.Inference(task.theta,
                                                                          features).y})
  metrics = task.FPropTower(task.theta, py_utils.NestedMap(x=features, y=labels))
  return estimator.EstimatorSpec(mode, loss=metrics.loss,
                                 eval_metrics={'abs_error': metrics.abs_error},
                                 train_params=task.params.train)


def _PairsInputFn(params):
  dataset = estimator.RegistryInputFn(_MODEL, 'Train')(params)
  return dataset.map(lambda batch: (batch.x, batch.y))


def testLossOnlyModelFnTrainsLikeThePipelinesOwnBackward(tmp_path):
  # The tape through the pipelined FProp and the pipeline's ForwardBackward
  # compute the same gradients, so both estimators end with the same weights.
  own = estimator.Estimator.from_registry(_MODEL, _Config(tmp_path / 'own', iterations_per_loop=2))
  own.train(estimator.RegistryInputFn(_MODEL, 'Train'), max_steps=4)
  tape = estimator.Estimator(_LossOnlyModelFn, _Config(tmp_path / 'tape', iterations_per_loop=2),
                             train_batch_size=8, eval_batch_size=8)
  tape.train(_PairsInputFn, max_steps=4)
  expected, actual = _ModelValues(tmp_path / 'own'), _ModelValues(tmp_path / 'tape')
  assert sorted(actual) == sorted(expected) and len(actual) == 4
  for name, value in expected.items():
    np.testing.assert_allclose(actual[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  results = tape.evaluate(_PairsInputFn, steps=2)
  assert sorted(results) == ['abs_error', 'global_step', 'loss'] and results['global_step'] == 4


def _Checkpoint(model_dir):
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(model_dir)))
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def testAModelFnsOwnLossIsScaledAndItsGradientsUnscaled(tmp_path):
  # A power-of-2 scale changes no float32 gradient: the scaled run ends bitwise equal.
  def ScaledModelFn(features, labels, mode, params):
    spec = _LossOnlyModelFn(features, labels, mode, params)
    if spec.train_params is not None:
      spec.train_params = spec.train_params.Copy()
      spec.train_params.loss_scale.mode = 'dynamic'
    return spec

  for name, model_fn in (('plain', _LossOnlyModelFn), ('scaled', ScaledModelFn)):
    est = estimator.Estimator(model_fn, _Config(tmp_path / name, iterations_per_loop=2),
                              train_batch_size=8, eval_batch_size=8)
    est.train(_PairsInputFn, max_steps=4)
  plain, scaled = _Checkpoint(tmp_path / 'plain'), _Checkpoint(tmp_path / 'scaled')
  assert not any(k.startswith('loss_scale/') for k in plain)
  assert scaled['loss_scale/scale/.ATTRIBUTES/VARIABLE_VALUE'] == 2.0 ** 15
  for name, value in _ModelValues(tmp_path / 'plain').items():
    np.testing.assert_array_equal(scaled[name], value, err_msg=name)


def testAFloat16RegistryModelScalesItsLoss(tmp_path):
  lm = 'lm.synthetic.GPipeTransformerLmTiny'
  est = estimator.Estimator.from_registry(
      lm, _Config(tmp_path), model_params_override='task.stack.fprop_dtype : tf.float16')
  est.train(estimator.RegistryInputFn(lm, 'Train'), max_steps=6)
  values = _Checkpoint(tmp_path)
  assert values['loss_scale/skipped_steps/.ATTRIBUTES/VARIABLE_VALUE'] >= 1  # 2^15 overflows.
  assert values['loss_scale/scale/.ATTRIBUTES/VARIABLE_VALUE'] < 2.0 ** 15
  assert 'loss_scale' in _Scalars(str(tmp_path))


def testNonFiniteLossStopsTrainingMidLoop(tmp_path):
  est = estimator.Estimator.from_registry(_MODEL, _Config(tmp_path),
                                          model_params_override='task.nan_at_step : 4')
  with pytest.raises(base_runner.NonFiniteError,
                     match=r'^The step from global step 4 to 5: loss nan'):
    est.train(estimator.RegistryInputFn(_MODEL, 'Train'), max_steps=9)
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith('ckpt-3')
  assert est.global_step == 4  # Step 3 ran in the second loop; step 4 was not applied.


def testTrainingHoldsTheTrainersLock(tmp_path):
  """A trainer (or another Estimator) training into model_dir: refused, nothing written."""
  est = estimator.Estimator.from_registry(_MODEL, _Config(tmp_path))
  with run_lock.RunLock(str(tmp_path)):
    with pytest.raises(errors.UserError, match=f'{tmp_path} is in use by another trainer'):
      est.train(estimator.RegistryInputFn(_MODEL, 'Train'), steps=1)
  assert not tf.train.latest_checkpoint(str(tmp_path))
  est.train(estimator.RegistryInputFn(_MODEL, 'Train'), steps=1)  # Released: it trains.
  assert est.global_step == 1 and not os.path.exists(tmp_path / run_lock.LOCK_FILE)


def testCheckpointOfAnotherModelIsRefused(tmp_path):
  estimator.Estimator.from_registry(_MODEL, _Config(tmp_path)).train(
      estimator.RegistryInputFn(_MODEL, 'Train'), steps=1)
  other = estimator.Estimator.from_registry(_MODEL, _Config(tmp_path),
                                            model_params_override='task.hidden_dim : 4')
  with pytest.raises(errors.UserError, match='is from a different model: variable '
                     r'regression/pipe/hidden/b is \[8\] float32 there, \[4\] float32 here'):
    other.evaluate(estimator.RegistryInputFn(_MODEL, 'Dev'))


def testModelFnMistakesAreClearErrors(tmp_path):
  def NoLoss(features, labels, mode, params):
    del features, labels, params
    return estimator.EstimatorSpec(mode)

  est = estimator.Estimator(NoLoss, _Config(tmp_path), train_batch_size=8)
  with pytest.raises(errors.UserError, match="mode 'train' returned an EstimatorSpec "
                     'without loss'):
    est.train(_PairsInputFn, steps=1)
  est = estimator.Estimator(lambda *args: {'loss': 1.0}, _Config(tmp_path), train_batch_size=8)
  with pytest.raises(errors.UserError, match='returned dict, not an EstimatorSpec'):
    est.train(_PairsInputFn, steps=1)
  est = estimator.Estimator(_LossOnlyModelFn, _Config(tmp_path / 'fresh'), eval_batch_size=8)
  with pytest.raises(errors.UserError, match='No checkpoint in .*fresh: train first'):
    est.evaluate(_PairsInputFn, steps=1)


def testBadStepsAndAnEndlessEvaluationAreClearErrors(tmp_path):
  est = estimator.Estimator.from_registry(_MODEL, _Config(tmp_path))
  train = estimator.RegistryInputFn(_MODEL, 'Train')  # Repeats forever.
  for kwargs, message in ((dict(steps=0), 'steps must be a positive int or None, got 0'),
                          (dict(steps=-5), 'got -5'), (dict(max_steps=1.5), 'got 1.5')):
    with pytest.raises(ValueError, match=message):
      est.train(train, **kwargs)
  est.train(train, steps=1)
  with pytest.raises(ValueError, match='steps must be a positive int or None, got -1'):
    est.evaluate(train, steps=-1)
  with pytest.raises(ValueError, match='evaluate: the input repeats forever; give steps'):
    est.evaluate(train)
  assert set(est.evaluate(train, steps=2)) > {'loss', 'global_step'}
  for name in ('iterations_per_loop', 'save_checkpoints_steps', 'keep_checkpoint_max',
               'log_step_count_steps'):  # Said when the Estimator is made.
    with pytest.raises(errors.UserError, match=f'RunConfig.{name} must be >= 1, got 0'):
      estimator.Estimator.from_registry(_MODEL, _Config(tmp_path, **{name: 0}))


def testStepsCancelledByAnOpFailingInAChunkRaiseThatOpsError(tmp_path):
  """toy.regression.FailsOnBatch2 fails inside stage 2 on training batch 2 and Dev batch 1,
  which TensorFlow may report only as CancelledError: train and evaluate then run that step
  again eagerly on the same batch and raise the op's own error; steps 0 and 1 stay trained."""
  model = 'toy.regression.FailsOnBatch2'
  est = estimator.Estimator.from_registry(
      model, _Config(tmp_path, iterations_per_loop=4, save_checkpoints_steps=2))
  with pytest.raises(ValueError, match='Pipeline cell 2 .* FailsOnNonFinite: a non-finite '
                     'activation') as raised:
    est.train(estimator.RegistryInputFn(model, 'Train'), steps=6)
  assert raised.value.__notes__ == [errors.RERUN_NOTE]
  assert est.global_step == 2  # The failed step's update did not run (its loss's check).
  assert not tf.config.functions_run_eagerly()
  # A forward alone: TensorFlow itself reports the op's InvalidArgumentError in about 1 of 2
  # runs; else the rerun raises the layer's ValueError naming its cell.
  with pytest.raises((ValueError, tf.errors.InvalidArgumentError),
                     match='FailsOnNonFinite: a non-finite activation') as raised:
    est.evaluate(estimator.RegistryInputFn(model, 'Dev'))
  assert (getattr(raised.value, '__notes__', None) == [errors.RERUN_NOTE]) != isinstance(
      raised.value, tf.errors.InvalidArgumentError)


def testAnInputFnOfNoParamsOrThatReturnsNoDatasetIsAClearError(tmp_path):
  est = estimator.Estimator.from_registry(_MODEL, _Config(tmp_path))
  with pytest.raises(errors.UserError, match=r"input_fn must take one argument, params .*"
                     r"'_NoParams' cannot"):
    est.train(_NoParams, steps=1)
  with pytest.raises(errors.UserError, match=r'input_fn returned dict, not a tf.data.Dataset: '
                     r'return one of batches'):
    est.train(lambda params: {'x': np.zeros([4, 2])}, steps=1)


def _NoParams():
  """An input_fn of the wrong signature."""


def testEvaluatingAnInputOfUnknownEndLogsProgress(tmp_path, monkeypatch):
  """A generator's end is unknown to tf.data: evaluate reads it until it ends and says
  how far it got, and how to bound it."""
  est = estimator.Estimator.from_registry(_MODEL, _Config(tmp_path))
  train = estimator.RegistryInputFn(_MODEL, 'Train')
  est.train(train, steps=1)
  batch = next(iter(train({})))

  def GeneratorInputFn(params):
    del params
    return tf.data.Dataset.from_generator(
        lambda: (batch for _ in range(3)),
        output_signature=tf.nest.map_structure(tf.TensorSpec.from_tensor, batch))

  lines = []
  monkeypatch.setattr(base_runner, 'EVAL_PROGRESS_SECONDS', 0)
  monkeypatch.setattr(base_runner.logging, 'info', lambda *a: lines.append(a[0] % a[1:]))
  assert set(est.evaluate(GeneratorInputFn)) > {'loss', 'global_step'}
  progress = [line for line in lines if line.startswith('Evaluated ')]
  assert [line.rsplit(' in ', 1)[0] for line in progress] == [
      f"Evaluated {n} batches (the input's end is unknown; give a number of steps or batches "
      'to bound it)' for n in (1, 2, 3)]
  lines.clear()
  est.evaluate(GeneratorInputFn, steps=2)
  assert [line.rsplit(' in ', 1)[0] for line in lines if line.startswith('Evaluated ')] == [
      'Evaluated 1 batches of at most 2', 'Evaluated 2 batches of at most 2']


def testAPlainDictInputTrainsAsTheNestedMapInputDoes(tmp_path, capsys, monkeypatch):
  """An input_fn of one's own may yield plain dicts; training equals the registry's
  NestedMap batches. Where absl's verbosity hides INFO, progress lines go to stderr."""
  from absl import logging  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  monkeypatch.setattr(logging, 'get_verbosity', lambda: logging.WARNING)
  nested = estimator.Estimator.from_registry(_MODEL, _Config(tmp_path / 'nested'))
  nested.train(estimator.RegistryInputFn(_MODEL, 'Train'), max_steps=3)
  plain = estimator.Estimator.from_registry(_MODEL, _Config(tmp_path / 'plain'))
  dict_input = lambda params: estimator.RegistryInputFn(_MODEL, 'Train')(params).map(dict)
  plain.train(dict_input, max_steps=2)
  plain.train(dict_input, max_steps=3)
  expected, actual = _ModelValues(tmp_path / 'nested'), _ModelValues(tmp_path / 'plain')
  assert sorted(actual) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_array_equal(actual[name], value, err_msg=name)
  progress = [line for line in capsys.readouterr().err.splitlines()
               if line.startswith('Estimator: step ')]
  assert [line.split('  ')[0] for line in progress] == [
      'Estimator: step 3/3', 'Estimator: step 3/3'], progress
  assert all(' loss ' in line and 'time left' in line for line in progress)


def testFromRegistryTakesTheBatchSizesGiven(tmp_path):
  seen = []

  def InputFn(params):
    seen.append(params['batch_size'])
    return estimator.RegistryInputFn(_MODEL, 'Train')(params)

  est = estimator.Estimator.from_registry(_MODEL, _Config(tmp_path / 'm'), train_batch_size=4,
                                          eval_batch_size=2)
  est.train(InputFn, steps=1)
  est.evaluate(InputFn, steps=1)
  assert seen == [4, 2]
  with pytest.raises(errors.UserError, match='the Train batch size must be an int >= 1, '
                     'got 0'):
    estimator.Estimator.from_registry(_MODEL, _Config(tmp_path / 'n'), train_batch_size=0)


def testRunConfigIsTheTrainersLoopUnderItsOwnNames(tmp_path):
  config = estimator.RunConfig(model_dir=str(tmp_path), iterations_per_loop=7,
                               save_checkpoints_steps=11, log_step_count_steps=13)
  assert config.LoopSettings(50) == base_runner.LoopSettings(
      max_steps=50, steps_per_loop=7, save_interval_steps=11, summary_interval_steps=13,
      log_interval_steps=13)
  assert config.LoopSettings(np.inf).max_steps == np.inf
