"""A TPUEstimator-style runner for TensorFlow 2: model_fn, input_fn, a model_dir.

  def model_fn(features, labels, mode, params):
    task = MyTask.Params().Set(name='my_task').Instantiate()
    return estimator.TaskSpec(task, features, mode)

  est = estimator.Estimator(model_fn, estimator.RunConfig(model_dir='/tmp/m'),
                            train_batch_size=32, eval_batch_size=32, predict_batch_size=8)
  est.train(input_fn, max_steps=1000)
  est.evaluate(input_fn, steps=10)        # {'loss': ..., <metrics>, 'global_step': 1000}
  for prediction in est.predict(input_fn):  # One dict per example.
    ...
  est.export_saved_model('/tmp/export', input_fn)

or, for a registered experiment, Estimator.from_registry(key, config) with
RegistryInputFn(key, 'Train' | 'Dev' | 'Test').

How it maps to TensorFlow 2: model_fn is called inside each mode's tf.function,
so its layers are rebuilt at every trace while their variables are created once,
at the first trace, and reused by name afterwards (the Estimator's variable
store does what TF1 variable scopes did), so model_fn keeps no state. TRAIN
runs iterations_per_loop steps per tf.function call (a device-side loop, as on
TPUs) with the trainer's Learner: same optimizer, clipping, NaN guard,
checkpoints (<model_dir>/ckpt-<step>), summaries and progress log. Every call
first restores the latest checkpoint of model_dir, so estimators resume.

Public methods keep TPUEstimator's names (train, evaluate, predict,
export_saved_model, from_registry).
"""

import contextlib
import dataclasses
import inspect
import numbers
import os
import sys
from typing import Any, Callable, Iterator, Optional

from absl import logging
import numpy as np
import tensorflow as tf

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.models import base_model
from lingvo_gpipe.models import base_model_params
from lingvo_gpipe.pipeline import metrics as metrics_lib
from lingvo_gpipe.runners import base_runner
from lingvo_gpipe.training import checkpoint_files
from lingvo_gpipe.training import checkpointer as checkpointer_lib
from lingvo_gpipe.training import learner as learner_lib
from lingvo_gpipe.training import run_lock


class ModeKeys:
  TRAIN = 'train'
  EVAL = 'eval'
  PREDICT = 'infer'


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Where and how often: checkpoints and summaries go to model_dir."""
  model_dir: str
  iterations_per_loop: int = 100
  save_checkpoints_steps: int = 1000
  keep_checkpoint_max: int = 5
  log_step_count_steps: int = 100

  def __post_init__(self) -> None:
    try:
      checkpoint_files.CheckDirectoryName(self.model_dir, 'RunConfig.model_dir')
    except ValueError as e:
      raise errors.UserError(str(e)) from None

  def LoopSettings(self, max_steps: float) -> base_runner.LoopSettings:
    """The host loop this config asks for (the trainer's, from train params), to max_steps."""
    return base_runner.LoopSettings(
        max_steps=max_steps, steps_per_loop=self.iterations_per_loop,
        save_interval_steps=self.save_checkpoints_steps,
        summary_interval_steps=self.log_step_count_steps,
        log_interval_steps=self.log_step_count_steps)


def _LogProgress(message: str, *args) -> None:
  """train()'s progress line: an absl INFO log where absl shows those, else on stderr, so
  that a Python user sees progress without configuring logging (as Keras's fit prints it)."""
  if logging.get_verbosity() >= logging.INFO:
    logging.info(message, *args)
  else:
    sys.stderr.write(f'Estimator: {message % args}\n')


@dataclasses.dataclass
class EstimatorSpec:
  """What model_fn returns.

  Attributes:
    mode: the ModeKeys value model_fn was called with.
    loss: TRAIN and EVAL: a scalar, or a Lingvo (value, weight) pair.
    predictions: PREDICT: dict name -> tensor whose first dimension is the batch.
    eval_metrics: dict name -> scalar or (value, weight); evaluation averages
      them over batches weighted by weight (also summarized in training).
    gradients: TRAIN, optional: [(gradient, variable)] computed by the model
      itself, e.g. by a pipeline's own backward (BaseTask.ForwardBackward, which
      1F1B schedules need); otherwise the Estimator differentiates the loss.
    train_params: TRAIN: base_model.TrainParams() (optimizer, learning rate,
      schedule, clipping); None takes its defaults.
  """
  mode: str
  loss: object = None
  predictions: object = None
  eval_metrics: object = None
  gradients: object = None
  train_params: object = None


def TaskSpec(task: base_model.BaseTask, input_batch, mode: str) -> EstimatorSpec:
  """The EstimatorSpec of a base_model.BaseTask in any mode; a plain dict batch (an input_fn
  of one's own) reads as the NestedMap the task expects."""
  input_batch = _AsNestedMap(input_batch)
  theta = task.theta
  if mode == ModeKeys.PREDICT:
    return EstimatorSpec(mode, predictions=task.Inference(theta, input_batch))
  if mode == ModeKeys.EVAL:
    metrics = task.FPropTower(theta, input_batch)
    return EstimatorSpec(mode, loss=metrics.loss, eval_metrics=metrics)
  metrics, grads = task.ForwardBackward(theta, input_batch)
  return EstimatorSpec(mode, loss=metrics.loss, eval_metrics=metrics,
                       gradients=learner_lib.GradientsAndVariables(theta, grads),
                       train_params=task.train_params)


def _AsNestedMap(value):
  """`value` with every dict (of identifier keys) a NestedMap, recursively."""
  if isinstance(value, dict):
    return py_utils.NestedMap({k: _AsNestedMap(v) for k, v in value.items()})
  return value


def RegistryInputFn(key: str, dataset: str,
                    model_params_override: str = '') -> Callable[[dict], tf.data.Dataset]:
  """input_fn of a registered experiment's Train, Dev or Test input.

  The batch size is params['batch_size'] where the input params define one;
  training starts at batch params['start_batch'], so it continues the data.
  """
  input_params = base_runner.LoadModelParams(key, dataset, model_params_override).input

  def InputFn(params):
    p = input_params.Copy()
    if 'batch_size' in p and params.get('batch_size'):
      p.batch_size = params['batch_size']
    return base_runner.InputDataset(p, start_batch=params.get('start_batch', 0))

  return InputFn


class _VariableStore(tf.Module):
  """The model's variables by name: created by the first trace of model_fn, then reused.

  A pipeline's scratch variables (py_utils.SCRATCH_SCOPE: gradient sums, clocks) are
  reused by name too, but are not the model's: not in `variables`, never saved.
  """

  _TF_MODULE_IGNORED_PROPERTIES = tf.Module._TF_MODULE_IGNORED_PROPERTIES | {'_scratch'}

  def __init__(self):
    super().__init__(name='model')
    self._by_name = {}
    self._scratch = {}

  @property
  def empty(self) -> bool:
    return not self._by_name

  @contextlib.contextmanager
  def Scope(self) -> Iterator[None]:
    """Within: tf.Variable(name=n) makes variable n once, later returns it."""
    created_here = set()

    def Creator(next_creator, **kwargs):
      name = kwargs.get('name')
      if name and name.startswith(py_utils.SCRATCH_SCOPE + '/'):
        if name not in self._scratch:
          self._scratch[name] = next_creator(**kwargs)
        return self._scratch[name]
      if not name:
        raise errors.UserError('model_fn created a tf.Variable without a name; the '
                                    'Estimator reuses variables by name (BaseLayer names them).')
      if name in created_here:
        raise errors.UserError(f'model_fn created two variables named {name!r}; names must '
                                    'be unique.')
      created_here.add(name)
      if name not in self._by_name:
        self._by_name[name] = next_creator(**kwargs)
      return self._by_name[name]

    with tf.variable_creator_scope(Creator):
      yield


def _CheckSteps(**counts: int | None) -> None:
  """Raises a ValueError naming a step count that is given but not a positive int."""
  for name, value in counts.items():
    if value is not None and (not isinstance(value, numbers.Integral) or
                              isinstance(value, bool) or value < 1):
      raise ValueError(f'{name} must be a positive int or None, got {value!r}.')


def _Features(element) -> tuple:
  """(features, labels) of an input element: a (features, labels) pair or features alone."""
  if isinstance(element, tuple) and len(element) == 2:
    return element
  return element, None


def _Metrics(spec: EstimatorSpec) -> py_utils.NestedMap:
  """NestedMap name -> (value, weight) of a spec's eval metrics and loss."""
  return metrics_lib.AsMetrics(dict(spec.eval_metrics or {}, loss=spec.loss))


def _FlatPredictions(predictions) -> dict[str, tf.Tensor]:
  return dict(py_utils.NestedMap(predictions).FlattenItems())


class Estimator:
  """Trains, evaluates, predicts with and exports a model_fn (see the module doc).

  Args:
    model_fn: (features, labels, mode, params) -> EstimatorSpec.
    config: RunConfig.
    params: dict passed to model_fn and input_fn, which also get 'batch_size'
      (the mode's batch size) and, input_fn only, 'start_batch' (TRAIN: the
      global step training resumes at; else 0).
    train_batch_size, eval_batch_size, predict_batch_size: params['batch_size']
      of each mode.
  """

  def __init__(self, model_fn: Callable[..., EstimatorSpec], config: RunConfig,
               params: dict[str, Any] | None = None, train_batch_size: int | None = None,
               eval_batch_size: int | None = None, predict_batch_size: int | None = None):
    for name in ('iterations_per_loop', 'save_checkpoints_steps', 'keep_checkpoint_max',
                 'log_step_count_steps'):
      if getattr(config, name) < 1:
        raise errors.UserError(f'RunConfig.{name} must be >= 1, got '
                                    f'{getattr(config, name)}.')
    self._model_fn = model_fn
    self._config = config
    self._params = dict(params or {})
    self._batch_sizes = {ModeKeys.TRAIN: train_batch_size, ModeKeys.EVAL: eval_batch_size,
                         ModeKeys.PREDICT: predict_batch_size}
    self._store = _VariableStore()
    self._global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
    self._learner = None
    self._functions = {}
    self._writers = {}

  @classmethod
  def from_registry(cls, key: str, config: RunConfig, model_params_override: str = '',
                    train_batch_size: int | None = None, eval_batch_size: int | None = None,
                    predict_batch_size: int | None = None) -> 'Estimator':
    """An Estimator of registered experiment `key`'s task; a batch size not given is its
    Train, Dev or Test input's (RegistryInputFn reads params['batch_size'])."""
    model_params = {d: base_runner.LoadModelParams(key, d, model_params_override)
                    for d in base_model_params.DATASETS}
    given = {'Train': train_batch_size, 'Dev': eval_batch_size, 'Test': predict_batch_size}
    for dataset, params in model_params.items():
      if given[dataset] is not None:
        if type(given[dataset]) is not int or given[dataset] < 1:
          raise errors.UserError(f'from_registry: the {dataset} batch size must be an '
                                      f'int >= 1, got {given[dataset]!r}.')
        if params.input is not None and 'batch_size' in params.input:
          params.input.batch_size = given[dataset]
      base_runner.CheckPipelineBatches(params)
    task_params = model_params['Train'].task

    def ModelFn(features, labels, mode, params):
      del labels, params  # The task reads everything from its input batch.
      return TaskSpec(task_params.Instantiate(), features, mode)

    def BatchSize(dataset):
      p = model_params[dataset].input
      if given[dataset] is not None or p is None or 'batch_size' not in p:
        return given[dataset]
      return p.batch_size

    return cls(ModelFn, config, train_batch_size=BatchSize('Train'),
               eval_batch_size=BatchSize('Dev'), predict_batch_size=BatchSize('Test'))

  @property
  def model_dir(self) -> str:
    return self._config.model_dir

  @property
  def global_step(self) -> int:
    return int(self._global_step.numpy())

  # -- public API ------------------------------------------------------------------------

  def train(self, input_fn: Callable[..., tf.data.Dataset], max_steps: Optional[int] = None,
            steps: Optional[int] = None) -> 'Estimator':
    """Trains `steps` more steps, or up to global step `max_steps`, or until the input ends.

    It holds model_dir's trainer lock (run_lock) meanwhile, as the trainer does: a trainer
    or another Estimator training into the same directory is a UserError naming it.
    """
    if max_steps is not None and steps is not None:
      raise ValueError('Give steps or max_steps, not both.')
    _CheckSteps(steps=steps, max_steps=max_steps)
    tf.io.gfile.makedirs(self.model_dir)
    with run_lock.RunLock(self.model_dir):
      self._Train(input_fn, max_steps, steps)
    return self

  def _Train(self, input_fn: Callable[..., tf.data.Dataset], max_steps: int | None,
             steps: int | None) -> None:
    """train()'s work, holding the lock of model_dir."""
    start = self._LatestStep()
    target = max_steps if max_steps is not None else start + steps if steps is not None else np.inf
    if start >= target:
      return
    dataset = self._Dataset(input_fn, ModeKeys.TRAIN, start_batch=start)
    if self._learner is None:
      train_params = self._Trace(dataset.element_spec, ModeKeys.TRAIN).train_params
      self._learner = learner_lib.Learner(train_params or base_model.TrainParams(),
                                          self._store.trainable_variables, self._global_step)
    checkpointer = self._Checkpointer()
    checkpointer.Recover()
    loop_fn = self._Function('train', dataset.element_spec, lambda: self._learner.BuildLoop(
        dataset.element_spec, self._ForwardBackward))
    def RerunStep(step):
      batch = next(iter(self._Dataset(input_fn, ModeKeys.TRAIN, start_batch=step)))
      self._learner.StepForwardBackward(self._ForwardBackward, batch,
                                        tf.constant(step, tf.int64))

    base_runner.RunTraining(loop_fn, iter(dataset), self._global_step, checkpointer,
                            self._Writer(self.model_dir), self._config.LoopSettings(target),
                            base_runner.BatchSize(dataset.element_spec),
                            log_progress=_LogProgress, rerun_step=RerunStep)

  def evaluate(self, input_fn: Callable[..., tf.data.Dataset],
               steps: Optional[int] = None) -> dict[str, Any]:
    """Metrics over `steps` batches (default: until the input ends) of the latest checkpoint.

    An input that repeats forever (tf.data's INFINITE_CARDINALITY) needs `steps`; one
    whose end tf.data cannot know (a generator) is read until it ends, with a progress
    line every base_runner.EVAL_PROGRESS_SECONDS.

    Returns:
      dict with 'loss', the eval metrics and 'global_step'; also summarized in
      <model_dir>/eval.
    """
    _CheckSteps(steps=steps)
    dataset = self._Dataset(input_fn, ModeKeys.EVAL)
    if steps is None and dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
      raise ValueError('evaluate: the input repeats forever; give steps, or an input that '
                       'ends.')
    self._Restore(dataset.element_spec, ModeKeys.EVAL)
    eval_fn = self._Function('eval', dataset.element_spec, lambda: tf.function(
        lambda element: _Metrics(self._CallModelFn(element, ModeKeys.EVAL)), autograph=False))
    metrics, _ = base_runner.Evaluate(eval_fn, dataset, steps)
    base_runner.WriteScalars(self._Writer(os.path.join(self.model_dir, 'eval')),
                             self.global_step, metrics)
    return dict(metrics, global_step=self.global_step)

  def predict(self, input_fn: Callable[..., tf.data.Dataset]) -> Iterator[dict[str, Any]]:
    """Yields one dict name -> numpy value per example, from the latest checkpoint."""
    dataset = self._Dataset(input_fn, ModeKeys.PREDICT)
    self._Restore(dataset.element_spec, ModeKeys.PREDICT)
    predict_fn = self._Function('predict', dataset.element_spec, lambda: tf.function(
        self._Predictions, autograph=False))
    for element in dataset:
      batch = {name: value.numpy() for name, value in predict_fn(element).items()}
      for i in range(len(next(iter(batch.values())))):
        yield {name: value[i] for name, value in batch.items()}

  def export_saved_model(self, export_dir: str, input_fn: Callable[..., tf.data.Dataset]) -> str:
    """Writes a SavedModel of the latest checkpoint's predictions; returns export_dir.

    Its 'serving_default' signature takes the features of input_fn's elements
    (as keyword arguments; a single tensor is named 'features'), batches of any
    size, and returns the predictions. Serving it needs only TensorFlow.
    """
    dataset = self._Dataset(input_fn, ModeKeys.PREDICT)
    self._Restore(dataset.element_spec, ModeKeys.PREDICT)
    spec, _ = _Features(dataset.element_spec)
    single = isinstance(spec, tf.TensorSpec)
    specs = {'features': spec} if single else dict(spec)
    if not all(isinstance(s, tf.TensorSpec) and s.shape.rank for s in specs.values()):
      raise errors.UserError('export_saved_model needs features that are one tensor or a '
                                  f'flat dict of tensors with a batch dimension; got {spec}.')
    specs = {k: tf.TensorSpec([None] + s.shape[1:], s.dtype, k) for k, s in specs.items()}

    def Serve(**features):
      return self._Predictions(features['features'] if single else py_utils.NestedMap(features))

    serving = tf.function(Serve, autograph=False).get_concrete_function(**specs)
    module = tf.Module()
    module.model = self._store
    tf.saved_model.save(module, export_dir, signatures={'serving_default': serving})
    return export_dir

  # -- internals -------------------------------------------------------------------------

  def _LatestStep(self) -> int:
    """The global step of model_dir's newest intact checkpoint (0 if none)."""
    path = checkpoint_files.Newest(self.model_dir)
    return checkpoint_files.Step(path) if path else 0

  def _Dataset(self, input_fn: Callable[..., tf.data.Dataset], mode: str,
               start_batch: int = 0) -> tf.data.Dataset:
    params = dict(self._params, batch_size=self._batch_sizes[mode], start_batch=start_batch)
    try:
      inspect.signature(input_fn).bind(params)
    except TypeError:
      raise errors.UserError(f'input_fn must take one argument, params (a dict of batch_size '
                             f'and start_batch, the batch to resume from); '
                             f'{getattr(input_fn, "__name__", input_fn)!r} cannot.') from None
    except ValueError:  # A callable whose signature Python cannot read: call it.
      pass
    dataset = input_fn(params)
    if not isinstance(dataset, tf.data.Dataset):
      raise errors.UserError(
          f'input_fn returned {type(dataset).__name__}, not a tf.data.Dataset: return one of '
          "batches (dicts, or (features, labels)), e.g. tf.data.Dataset.from_tensor_slices("
          "{'x': x, 'y': y}).batch(params['batch_size']).")
    return dataset

  def _CallModelFn(self, element, mode: str) -> EstimatorSpec:
    features, labels = _Features(element)
    params = dict(self._params, batch_size=self._batch_sizes[mode])
    context = py_utils.EvalMode() if mode != ModeKeys.TRAIN else contextlib.nullcontext()
    # The global step seeds random ops, also when model_fn is traced outside the training
    # loop (which sets it); layers would otherwise count calls in variables of their own.
    step = py_utils.CurrentContext().step
    with context, py_utils.Context(step=self._global_step if step is None else step), \
        self._store.Scope():
      spec = self._model_fn(features, labels, mode, params)
    if not isinstance(spec, EstimatorSpec):
      raise errors.UserError(f'model_fn returned {type(spec).__name__}, not an '
                                  'EstimatorSpec.')
    needed = 'predictions' if mode == ModeKeys.PREDICT else 'loss'
    if getattr(spec, needed) is None:
      raise errors.UserError(f'model_fn in mode {mode!r} returned an EstimatorSpec '
                                  f'without {needed}.')
    return spec

  def _Trace(self, element_spec, mode: str) -> EstimatorSpec:
    """Traces model_fn once without running it (creating variables); returns its spec."""
    specs = []
    tf.function(lambda element: specs.append(self._CallModelFn(element, mode)),
                autograph=False).get_concrete_function(element_spec)
    return specs[-1]

  def _Function(self, kind: str, element_spec, make: Callable[[], Callable]) -> Callable:
    key = (kind, repr(element_spec))
    if key not in self._functions:
      self._functions[key] = make()
    return self._functions[key]

  def _Checkpointer(self) -> checkpointer_lib.Checkpointer:
    return checkpointer_lib.Checkpointer(
        self.model_dir, self._store.variables, self._global_step,
        self._learner.state if self._learner else None,
        max_to_keep=self._config.keep_checkpoint_max)

  def _Restore(self, element_spec, mode: str) -> None:
    """Builds the model if needed and restores the latest checkpoint, which must exist."""
    if self._store.empty:
      self._Trace(element_spec, mode)
    if not self._Checkpointer().Restore():
      raise errors.UserError(f'No checkpoint in {self.model_dir}: train first.')

  def _Writer(self, directory: str) -> tf.summary.SummaryWriter:
    if directory not in self._writers:
      self._writers[directory] = tf.summary.create_file_writer(directory)
    return self._writers[directory]

  def _ForwardBackward(self, element) -> tuple[py_utils.NestedMap, list]:
    with tf.GradientTape() as tape:
      spec = self._CallModelFn(element, ModeKeys.TRAIN)
    metrics = _Metrics(spec)
    if spec.gradients is not None:
      return metrics, list(spec.gradients)
    variables = self._store.trainable_variables
    return metrics, list(zip(py_utils.ScaledGradients(tape, metrics.loss[0], variables),
                             variables))

  def _Predictions(self, element) -> dict[str, tf.Tensor]:
    return _FlatPredictions(self._CallModelFn(element, ModeKeys.PREDICT).predictions)
