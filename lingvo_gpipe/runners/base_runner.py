"""What the trainer binary and the Estimator share around the training step.

The host side of training (run the device loop, write TensorBoard summaries,
log progress, save checkpoints, stop on non-finite values), evaluation over a
dataset with exact (value, weight) metric averaging, and the input contract.

Input contract (base_input_generator.BaseInputGenerator's): an experiment's
input params are InstantiableParams whose instance has
`GetDataset(start_batch=0)`, a tf.data.Dataset of NestedMap batches with a
static batch size from batch `start_batch` on. A resumed trainer passes its
global step, so training continues with the batches it has not seen.
"""

import dataclasses
import datetime
import functools
import os
import re
import time
from typing import Any, Callable, Iterator

from absl import logging
import numpy as np
import tensorflow as tf

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.insight import balance_plan
from lingvo_gpipe.insight import pipeline_stats as pipeline_stats_lib
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.pipeline import pipeline_params
from lingvo_gpipe.training import checkpointer as checkpointer_lib

# Splits override text at ';' outside quotes.
_OVERRIDE_SEPARATOR = re.compile(r""";(?=(?:[^'"]|'[^']*'|"[^"]*")*$)""")


class NonFiniteError(errors.UserError):
  """The loss, the gradients or the updated weights became NaN or Inf."""


def CheckPipelineBatches(model_params: hyperparams.Params) -> None:
  """UserError naming both params if a pipeline of the task cannot split the input's batch."""
  batch_size = InputBatchSize(model_params)
  if batch_size is None:
    return  # An input without a fixed batch size: the pipeline takes whatever comes.
  try:
    pipeline_params.CheckBatch(model_params.task, batch_size, 'input.batch_size', 'task')
  except ValueError as e:
    raise errors.UserError(str(e)) from None


def OverrideKeys(override: str) -> list[str]:
  """The dotted keys an override text ('a.b : value' lines, see LoadModelParams) sets."""
  lines = '\n'.join(_OVERRIDE_SEPARATOR.split(override)).splitlines()
  return [line.split(':', 1)[0].strip() for line in lines if line.strip()]


def LoadModelParams(key: str, dataset: str, override: str = '',
                    max_steps: int | None = None) -> hyperparams.Params:
  """Model params of `key` for `dataset`, with overrides and max_steps applied.

  The override is Lingvo-style params text, 'a.b : value' lines separated by ';'
  (outside quotes) or newlines.
  """
  try:
    params = model_registry.GetParams(key, dataset)
  except (LookupError, ImportError, ValueError) as e:
    raise errors.UserError(str(e)) from None
  text = '\n'.join(_OVERRIDE_SEPARATOR.split(override))
  for key in OverrideKeys(override):
    if key == 'task.input' or key.startswith('task.input.'):
      raise errors.UserError(f'model_params_override sets {key}, but the input that runs is the '
                      f"model's input (the task gets a copy): set {key[len('task.'):]} instead.")
  try:
    params.FromText(text)
  except (AttributeError, IndexError, TypeError, ValueError) as e:
    raise errors.UserError(f'model_params_override: {e}') from None
  if max_steps is not None:
    params.train.max_steps = max_steps
  if isinstance(params.task, hyperparams.Params) and params.task.IsDefined('input'):
    # The model's input is the one that runs: the task checks itself against it.
    params.task.input = params.input.Copy()
  return params


# What an evaler does not take from the trainer's params: where the trainer placed its
# pipelines (another process's devices), how long it trained, the task's copy of the input.
_NOT_CARRIED = re.compile(r'(^|\.)(devices|num_replicas)$|^train\.max_steps$|^task\.input(\.|$)')


def TrainersSettings(key: str, dataset: str, params_text: str) -> list[str]:
  """['a.b : value'] lines of the trainer's recorded params (<logdir>/train/params.txt) that
  an evaler of `dataset` takes: the trainer's overrides (where they differ from the
  registered Train() params) of settings that `dataset` shares with Train(), such as the
  model's size or an input file; a setting the dataset has its own value of (a seed, a
  number of batches) stays the dataset's."""
  train = dict(_ParamsLines(LoadModelParams(key, 'Train').ToText()))
  evaluated = dict(_ParamsLines(LoadModelParams(key, dataset).ToText()))
  return [f'{k} : {v}' for k, v in _ParamsLines(params_text)
          if k in train and train[k] != v and evaluated.get(k) == train[k] and
          not _NOT_CARRIED.search(k)]


def _ParamsLines(text: str) -> list[tuple[str, ...]]:
  return [tuple(part.strip() for part in line.split(' : ', 1))
          for line in text.splitlines() if ' : ' in line]


def InputBatchSize(model_params: hyperparams.Params) -> int | None:
  """The batch size of the model's input params, or None if they fix none."""
  inputs = model_params.input
  if isinstance(inputs, hyperparams.Params) and 'batch_size' in inputs:
    return inputs.batch_size
  return None


def ApplyBalanceFile(model_params: hyperparams.Params, path: str, override: str = '',
                     train_batch_size: int | None = None) -> list[str]:
  """Cuts the task's pipelines by the balance plan at `path` (tools/plan_balance.py), with the
  M, schedule and remat it was made for; a UserError if `override` set another of them (a
  micro_batch_size is checked by the M it gives the training batch, `train_batch_size`).
  Returns what it changed (balance_plan.ApplyPlan's texts)."""
  try:
    return balance_plan.ApplyPlan(model_params.task, balance_plan.LoadPlan(path), 'task',
                             fixed=OverrideKeys(override), batch_size=train_batch_size)
  except ValueError as e:
    raise errors.UserError(f'--balance_file: {e}') from None


def InputDataset(input_params: hyperparams.Params | None,
                 start_batch: int = 0) -> tf.data.Dataset:
  """The tf.data.Dataset of an experiment's input params (see the module doc)."""
  return InputGenerator(input_params).Dataset(start_batch)


class InputGenerator:
  """An experiment's input generator, built (and so checked) before its dataset is made:
  a trainer refuses bad input params before it writes anything."""

  def __init__(self, input_params: hyperparams.Params | None):
    if input_params is None:
      raise errors.UserError('The model params have no input params (model.input is None).')
    try:
      self._generator = input_params.Instantiate()
    except ValueError as e:  # A bad config, e.g. from an override.
      raise errors.UserError(f'Cannot build the input generator: {e}') from None
    if not hasattr(self._generator, 'GetDataset'):
      raise errors.UserError(f'Input generator {type(self._generator).__name__} has no '
                      'GetDataset(start_batch) method returning a tf.data.Dataset.')

  def Dataset(self, start_batch: int = 0) -> tf.data.Dataset:
    """The batches from batch `start_batch` on."""
    try:
      dataset = self._generator.GetDataset(start_batch=start_batch)
    except ValueError as e:
      raise errors.UserError(f'Cannot build the input: {e}') from None
    if not isinstance(dataset, tf.data.Dataset):
      raise errors.UserError(f'{type(self._generator).__name__}.GetDataset() returned '
                      f'{type(dataset).__name__}, not a tf.data.Dataset.')
    return dataset


def BatchSize(element_spec) -> int | None:
  """The static leading dimension of the first tensor of a batch, or None."""
  leaves = tf.nest.flatten(element_spec)
  return leaves[0].shape[0] if leaves and leaves[0].shape.rank else None


# TensorBoard's scalar-plugin metadata, so scalars are written without the
# tensorboard package (tf.summary.scalar needs it installed).
_SCALAR_METADATA = tf.compat.v1.SummaryMetadata(
    plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name='scalars'),
    data_class='DATA_CLASS_SCALAR')


def WriteScalars(writer: tf.summary.SummaryWriter, step: int, scalars: dict[str, Any]) -> None:
  """Writes TensorBoard scalars name -> value at `step`."""
  with errors.Writing('TensorBoard summaries'), writer.as_default(step=step):
    for name, value in scalars.items():
      tf.summary.write(name, tf.cast(value, tf.float32), metadata=_SCALAR_METADATA)
    writer.flush()


def _Crossed(before: int, after: int, interval: int) -> bool:
  """Whether a multiple of `interval` lies in (before, after]."""
  return interval > 0 and after // interval > before // interval


@dataclasses.dataclass(frozen=True)
class LoopSettings:
  """How often the host loop does what, in steps (max_steps may be math.inf: no end)."""
  max_steps: float
  steps_per_loop: int = 1
  save_interval_steps: int = 1000
  summary_interval_steps: int = 100
  log_interval_steps: int = 100

  def __post_init__(self) -> None:
    if self.max_steps < 0:
      raise errors.UserError(f'max_steps must be at least 0, got {self.max_steps}.')
    for name in ('steps_per_loop', 'save_interval_steps', 'summary_interval_steps',
                 'log_interval_steps'):
      if getattr(self, name) < 1:
        raise errors.UserError(f'{name} must be at least 1, got {getattr(self, name)}.')


@dataclasses.dataclass(frozen=True)
class PipelineStats:
  """Opt-in pipeline statistics: every `every` steps one training step runs measured.

  step_fn: iterator -> (Learner.Apply outputs, pipeline_stats.Timeline) of one
    training step (Learner.BuildMeasuredStep).
  trace_dir: if set, each measured step's Chrome trace goes to
    <trace_dir>/pipeline_trace_<step>.json.
  device_names: {(replica, stage): device name}, the trace's track names.
  schedule: the schedule's label in logs and summaries; '' reads it off the
    actions (pipeline_stats.Timeline.Schedule).

  The first measured step traces and first runs its function: its times are
  not written (they would show as a spike); statistics start at the second.
  """
  every: int
  step_fn: Callable[[Iterator], tuple]
  trace_dir: str = ''
  device_names: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
  schedule: str = ''


def _WritePipelineStats(writer: tf.summary.SummaryWriter, step: int,
                        timeline: pipeline_stats_lib.Timeline, stats: PipelineStats) -> None:
  summary = pipeline_stats_lib.Summarize(timeline, stats.schedule or None)
  WriteScalars(writer, step, summary.Scalars())
  if stats.trace_dir:
    pipeline_stats_lib.WriteChromeTrace(
        os.path.join(stats.trace_dir, f'pipeline_trace_{step}.json'), timeline,
        stats.device_names)
  logging.info('step %d pipeline (%s, K=%d, M=%d): bubble %.3f measured, %.3f simulated with '
               'the measured stage and hand-over times, %.3f in theory; %.4f s', step,
               summary.schedule, summary.num_stages, summary.num_micro_batches,
               summary.bubble_fraction, summary.simulated_bubble, summary.theoretical_bubble,
               summary.step_time)


class _Progress:
  """Speed and time-left estimates; the first loop call (tracing) is left out."""

  def __init__(self, max_steps: float, batch_size: int | None):
    self._max_steps = max_steps
    self._batch_size = batch_size
    self._steps = 0
    self._seconds = 0.0
    self._calls = 0

  def Record(self, steps: int, seconds: float) -> None:
    self._calls += 1
    if self._calls > 1:
      self._steps += steps
      self._seconds += seconds

  def Speed(self, steps: int | None, seconds: float) -> dict[str, float]:
    """step_time and examples_per_second of one loop call, or of the calls so far (after the
    first) when steps is None; none for the first call, whose time is mostly tracing (a
    spike in TensorBoard)."""
    if steps is not None and self._calls <= 1:
      return {}
    if steps is None:
      if not self._steps:
        return {}
      steps, seconds = self._steps, self._seconds
    speed = {'step_time': seconds / steps}
    if self._batch_size:
      speed['examples_per_second'] = self._batch_size * steps / seconds
    return speed

  def TimeLeft(self, step: int) -> str:
    if not self._steps or self._max_steps == np.inf:
      return '?'
    seconds = (self._max_steps - step) * self._seconds / self._steps
    return str(datetime.timedelta(seconds=round(seconds)))


def _NonFinite(out: py_utils.NestedMap) -> tuple[str, bool]:
  """What was not finite in a step's Learner.Apply outputs, and whether it was applied."""
  loss, grad_norm = float(out.loss), float(out.grad_norm)
  learning_rate = float(out.learning_rate)
  if not (np.isfinite(loss) and np.isfinite(grad_norm)):
    at_scale = (f' at the minimum loss scale {float(out.loss_scale):g} (loss_scale.min_scale), '
                'so it is not skipped as a float16 overflow'
                if 'loss_scale' in out and np.isfinite(loss) else '')
    return f'loss {loss:g}, gradient norm {grad_norm:g} is not finite{at_scale}', False
  if not np.isfinite(learning_rate):
    return f'learning rate {learning_rate:g} is not finite', False
  return (f'loss {loss:g} and gradient norm {grad_norm:g} are finite, but the update with '
          f'learning rate {learning_rate:g} made weights not finite', True)


def _Steps(first_step: int, last_step: int) -> str:
  """The steps a loop call from global step `first_step` to `last_step` ran, as logs say them."""
  return (f'step {last_step}' if last_step == first_step + 1 else
          f'steps {first_step + 1}-{last_step}')


def _LogFirstCall(first_step: int, last_step: int, seconds: float) -> None:
  """The first loop call's time: where start-up goes after tracing (docs/pipeline.md)."""
  logging.info('The first call of the training loop took %.1f s, %s: a new graph\'s first run '
               'includes TensorFlow optimizing, placing and partitioning it (speeds leave this '
               'call out).', seconds, _Steps(first_step, last_step))


def _LogSkips(out: py_utils.NestedMap, first_step: int, last_step: int) -> None:
  """A line when float16 overflows skipped steps of a loop call (out.skips)."""
  skips = int(out.skips)
  if skips:
    steps = _Steps(first_step, last_step)
    steps += '' if last_step == first_step + 1 else f': {skips}'
    logging.info('%s skipped (float16 gradients overflowed; nothing applied); loss scale now '
                 '%g.', steps, float(out.loss_scale))


def RunTraining(loop_fn: Callable[..., py_utils.NestedMap], iterator: Iterator,
                global_step: tf.Variable, checkpointer: checkpointer_lib.Checkpointer,
                writer: tf.summary.SummaryWriter, settings: LoopSettings, batch_size: int | None,
                pipeline_stats: PipelineStats | None = None, stop=None,
                log_progress: Callable[..., None] = logging.info,
                rerun_step: Callable[[int], Any] | None = None) -> int:
  """Trains until settings.max_steps, the end of the input or a stop; returns the global step.

  Args:
    loop_fn: Learner.BuildLoop's function.
    iterator: the input iterator.
    global_step: the global step variable.
    checkpointer: a Checkpointer; saves at multiples of save_interval_steps and at the end.
    writer: a tf.summary writer for the training summaries.
    settings: LoopSettings.
    batch_size: examples per step, for examples_per_second (None to leave it out).
    pipeline_stats: a PipelineStats to measure the steps that reach multiples of
      its `every` and write their statistics as summaries; None measures nothing.
    stop: None, or an object whose Stopped() becomes true to end training early
      (preemption.StopOnSignals): checked before each loop call; the steps
      done are saved.
    log_progress: logs the progress line (a %-format and its arguments).
    rerun_step: None, or rerun_step(global_step) runs the forward and backward of that
      step's batch; a step that fails as CancelledError is run again by it eagerly, to
      raise the error of the op that failed (errors.ExplainingCancelledSteps).

  Raises:
    NonFiniteError: when a step's loss, gradients or new weights are not finite;
      that step is not applied and no checkpoint is written for it.
  """
  s = settings
  step = int(global_step.numpy())
  progress = _Progress(s.max_steps, batch_size)
  measured_before = False
  first_call = True
  while step < s.max_steps and not (stop and stop.Stopped()):
    # Loops end at checkpoint steps, so checkpoints land on multiples of the interval.
    to_save = s.save_interval_steps - step % s.save_interval_steps
    num_steps = int(min(s.steps_per_loop, s.max_steps - step, to_save))
    # Loops also end before each measured step; a measured step runs alone.
    measure = pipeline_stats is not None and (step + 1) % pipeline_stats.every == 0
    if pipeline_stats is not None and not measure:
      num_steps = min(num_steps, pipeline_stats.every - (step + 1) % pipeline_stats.every)
    start = time.time()
    rerun = rerun_step and (lambda: rerun_step(int(global_step.numpy())))
    try:
      with errors.ExplainingCancelledSteps(rerun):
        if measure:
          out, timeline = pipeline_stats.step_fn(iterator)
        else:
          out = loop_fn(iterator, tf.constant(num_steps, tf.int64))
    except tf.errors.OutOfRangeError:
      step = int(global_step.numpy())
      logging.info('The input ended at step %d.', step)
      break
    seconds = time.time() - start
    new_step = int(global_step.numpy())
    _LogSkips(out, step, new_step)
    if not bool(out.finite):
      what, applied = _NonFinite(out)
      kept = ('training stopped; those weights are not saved' if applied else
              'training stopped without applying it')
      raise NonFiniteError(f'The step from global step {new_step} to {new_step + 1}: '
                           f'{what}; {kept} (global step {new_step}). Last good checkpoint: '
                           f'{checkpointer.latest or "none"}.')
    if not measure:  # A measured step's time includes tracing it and the timing ops.
      progress.Record(new_step - step, seconds)
    if first_call:
      _LogFirstCall(step, new_step, seconds)
      first_call = False
    speed = progress.Speed(None if measure else new_step - step, seconds)
    if _Crossed(step, new_step, s.summary_interval_steps):
      scalars = {name: value for name, (value, _) in out.metrics.items()}
      scalars.update(learning_rate=out.learning_rate, grad_norm=out.grad_norm, **speed)
      if 'loss_scale' in out:
        scalars.update(loss_scale=out.loss_scale, skipped_steps=out.skipped_steps)
      WriteScalars(writer, new_step, scalars)
    if measure and measured_before:
      _WritePipelineStats(writer, new_step, timeline, pipeline_stats)
    elif measure:
      logging.info('step %d: the first measured step traced its function; pipeline statistics '
                   'start at step %d.', new_step, new_step + pipeline_stats.every)
      measured_before = True
    if _Crossed(step, new_step, s.log_interval_steps):
      examples = (f'  {speed["examples_per_second"]:.1f} examples/s'
                  if 'examples_per_second' in speed else '')
      step_time = f"  {speed['step_time']:.4f} s/step" if speed else ''
      log_progress('step %d/%s  loss %#.4g%s%s  time left %s', new_step, s.max_steps,
                   float(out.loss), examples, step_time, progress.TimeLeft(new_step))
    step = new_step
    if step % s.save_interval_steps == 0:
      checkpointer.Save()
  checkpointer.Save()
  return step


# Seconds between evaluation progress lines.
EVAL_PROGRESS_SECONDS = 60


def Evaluate(eval_fn: Callable[[Any], py_utils.NestedMap], dataset: tf.data.Dataset,
             num_batches: int | None = None) -> tuple[dict[str, float], int]:
  """Metrics averaged over batches as sum(value * weight) / sum(weight); a progress line
  every EVAL_PROGRESS_SECONDS, so that a long or endless input (a generator whose end
  tf.data cannot know) is seen running.

  Args:
    eval_fn: batch -> NestedMap name -> (value, weight); a batch that fails as
      CancelledError is run again by it eagerly (errors.ExplainingCancelledSteps).
    dataset: the batches; evaluation stops at its end or after num_batches.
    num_batches: at most this many batches; None for the whole dataset.

  Returns:
    (dict name -> float, number of batches evaluated).
  """
  if num_batches is not None:
    dataset = dataset.take(num_batches)
  total = int(dataset.cardinality())
  if total >= 0:
    of = f' of {total}'
  elif num_batches is not None:
    of = f' of at most {num_batches}'
  else:
    of = " (the input's end is unknown; give a number of steps or batches to bound it)"
  sums, weights, count = {}, {}, 0
  start = last = time.monotonic()
  for batch in dataset:
    with errors.ExplainingCancelledSteps(functools.partial(eval_fn, batch)):
      metrics = eval_fn(batch)
    for name, (value, weight) in metrics.items():
      sums[name] = sums.get(name, 0.0) + float(value) * float(weight)
      weights[name] = weights.get(name, 0.0) + float(weight)
    count += 1
    if time.monotonic() - last >= EVAL_PROGRESS_SECONDS:
      last = time.monotonic()
      logging.info('Evaluated %d batches%s in %.0f s.', count, of, last - start)
  return {name: sums[name] / weights[name] for name in sums}, count
