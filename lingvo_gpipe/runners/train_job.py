"""The trainer job: trains a task to train.max_steps, resuming from its newest intact
checkpoint, and says in the log what it traces and runs. Apart from the binary's flags and
dispatch, which only choose where it runs (locally or as a cluster client)."""

import dataclasses
import os
import time
from typing import Any, Callable

from absl import logging
import tensorflow as tf

from lingvo_gpipe.foundation import devices as devices_lib
from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import pipeline_params
from lingvo_gpipe.pipeline import schedule as schedule_lib
from lingvo_gpipe.pipeline import steady_state
from lingvo_gpipe.runners import base_runner
from lingvo_gpipe.runners import jobs
from lingvo_gpipe.training import learner as learner_lib
from lingvo_gpipe.training import preemption
from lingvo_gpipe.training import run_lock


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """How the trainer job runs (the trainer's flags that are not params).

  steps_per_loop: training steps per tf.function call (--steps_per_loop).
  checkpoint_max_to_keep: recent checkpoints kept (--checkpoint_max_to_keep).
  pipeline_stats_every: time the pipeline every N steps; 0: off (--pipeline_stats_every).
  """
  steps_per_loop: int = 1
  checkpoint_max_to_keep: int = 5
  pipeline_stats_every: int = 0


def _Describe(pipe: gpipe.PipeliningLayer) -> str:
  """How a pipeline runs, in one line: its K, v and M come from several params."""
  p = pipe.params
  m = (f'M={p.num_micro_batches}' if p.micro_batch_size is None else
       f'micro_batch_size={p.micro_batch_size}')
  replicas = f' x {p.num_replicas} replicas' if p.num_replicas > 1 else ''
  k = pipe.num_stages
  stages = devices_lib.DescribeStages(pipe.devices[:k])
  return (f'{pipe.path}: {pipe.num_chunks} cells on K={k} device{"s" if k > 1 else ""} '
          f'(v={pipe.num_chunks // k}){replicas}, {m}, schedule '
          f'{schedule_lib.Name(p.schedule)}, remat {p.remat}; {stages}')


def _CheckBuiltPipelines(task: tf.Module, batch_size: int | None) -> None:
  """UserError if a pipeline the task built in code (its params hold none, so
  CheckPipelineBatches passed it) splits the training batch into empty micro-batches."""
  if batch_size is None:
    return
  for pipe in jobs.Pipelines(task):
    try:
      pipeline_params.CheckBatch(pipe.params, batch_size, 'input.batch_size', pipe.path)
    except ValueError as e:
      raise errors.UserError(str(e)) from None


def _TracedWork(task: tf.Module, batch_size: int | None) -> str:
  """What tracing a step of the task builds, e.g. 'K=8, M=64, zb_h1, 1,600 actions' per
  pipeline: each action is one call of a function traced once per chunk."""
  parts = []
  for pipe in jobs.Pipelines(task):
    sched = pipe.GetSchedule(batch_size) if batch_size else None
    actions = f', {len(sched.steps) * pipe.num_replicas:,} actions' if sched else ''
    m = sched.num_micro_batches if sched else pipe.params.num_micro_batches
    parts.append(f'K={pipe.num_stages}, M={m}, {schedule_lib.Name(pipe.params.schedule)}'
                 f'{actions}')
  return '; '.join(parts) or 'no pipeline'


LONG_TRACE_SECS = 5.0  # A trace this long gets the hint of _LoopLines.


def _LoopLines(task: tf.Module, batch_size: int | None, traced: float) -> list[str]:
  """Per pipeline whose steady state 'auto' loops, a line saying so and how to unroll it; per
  pipeline that unrolls one after a trace of over LONG_TRACE_SECS (loop_steady_state False,
  'auto' on a short one), how much repeats and how to trace that once
  (docs/pipeline.md)."""
  lines = []
  for pipe in jobs.Pipelines(task):
    p = pipe.params
    # Those that never loop (docs/pipeline.md): several replicas; inlined calls (a debugging
    # run); micro-batches of uneven size.
    if (pipe.num_replicas > 1 or not batch_size or p.inline_cell_functions or
        batch_size % pipe.GetSchedule(batch_size).num_micro_batches):
      continue
    instructions = pipe.GetProgram(batch_size).instructions
    windows = steady_state.Windows(instructions)
    repeated = sum(w.end - w.start for w in windows)
    counts = f'{repeated:,} of its {len(instructions):,} instructions repeat (a steady state)'
    if steady_state.Looped(windows, p) and p.loop_steady_state == 'auto':
      lines.append(
          f"Pipeline {pipe.path}: {counts}, run as one loop (loop_steady_state='auto'): a "
          'faster start; loop_steady_state=False unrolls them, for steps that measured 2-15% '
          'faster at layers of width 256, up to 1.5x at tiny ones, and a lower peak memory '
          '(docs/pipeline.md).')
    elif repeated and not steady_state.Looped(windows, p) and traced > LONG_TRACE_SECS:
      lines.append(
          f'Pipeline {pipe.path}: {counts}, each traced on its own (loop_steady_state='
          f"{p.loop_steady_state!r}); loop_steady_state=True (e.g. --model_params_override="
          "'task.stack.loop_steady_state : True') traces one period: a faster start "
          '(docs/pipeline.md).')
  return lines


def _PipelineNames(task: tf.Module) -> tuple[dict[tuple[int, int], str], str]:
  """({(replica, stage): device name}, schedule label) of the task's pipeline, for trace
  tracks and logs; ({}, '') unless it has exactly one. The label is the configured
  schedule's (schedule.Name): the records do not show where the loss runs, so read off
  the actions a fill-drain text with per-micro-batch losses would pass for 'gpipe'."""
  pipes = jobs.Pipelines(task)
  if len(pipes) != 1:
    return {}, ''
  pipe, = pipes
  k = pipe.num_stages
  return ({(r, s): pipe.devices[r * k + s] for r in range(pipe.num_replicas) for s in range(k)},
          schedule_lib.Name(pipe.params.schedule))


def _PipelineStats(task: tf.Module, learner: learner_lib.Learner,
                   forward_backward_fn: Callable[[Any], tuple], train_dir: str,
                   every: int) -> base_runner.PipelineStats | None:
  """base_runner.PipelineStats every `every` steps (--pipeline_stats_every), or None when it
  is 0."""
  if not every:
    return None
  device_names, schedule = _PipelineNames(task)
  return base_runner.PipelineStats(every, learner.BuildMeasuredStep(forward_backward_fn),
                                   train_dir, device_names, schedule)


def RunTrainer(model_params: hyperparams.Params, logdir: str, train_settings: TrainSettings,
               input_device: str | None = None,
               stop: preemption.StopOnSignals | None = None) -> None:
  """Trains to train.max_steps, resuming from the newest intact checkpoint of <logdir>/train.

  Args:
    model_params: the experiment's params.
    logdir: checkpoints and summaries go to <logdir>/train.
    train_settings: the TrainSettings.
    input_device: None makes batches in this process. A cluster client gives
      the first stage's host CPU: batches are made there, not sent from the
      client each step, and ops the model leaves unplaced stay with their inputs.
    stop: None, or a preemption.StopOnSignals: a signal ends training after the
      current loop call with a checkpoint, and then raises preemption.Interrupted.
  """
  base_runner.CheckPipelineBatches(model_params)
  t = model_params.train
  settings = base_runner.LoopSettings(
      max_steps=t.max_steps, steps_per_loop=train_settings.steps_per_loop,
      save_interval_steps=t.save_interval_steps, summary_interval_steps=t.summary_interval_steps,
      log_interval_steps=t.log_interval_steps)
  train_dir = os.path.join(logdir, 'train')
  # What the params build is checked before anything is written.
  with tf.device(input_device):
    generator = base_runner.InputGenerator(model_params.input)
  built = jobs.Instantiate(model_params, train_dir, with_learner=True,
                          max_to_keep=train_settings.checkpoint_max_to_keep)
  _CheckBuiltPipelines(built[0], base_runner.InputBatchSize(model_params))
  jobs.MakeWritableDir(train_dir)
  with run_lock.RunLock(train_dir):
    _Train(model_params, settings, built, generator, logdir, input_device, stop,
           train_settings.pipeline_stats_every)


def _Train(model_params: hyperparams.Params, settings: base_runner.LoopSettings, built: tuple,
           generator: base_runner.InputGenerator, logdir: str, input_device: str | None,
           stop: preemption.StopOnSignals | None, pipeline_stats_every: int) -> None:
  """RunTrainer's work, holding the lock of the train dir: `built` is jobs.Instantiate's."""
  task, global_step, learner, checkpointer = built
  train_dir = checkpointer.directory
  checkpointer.Recover()
  step = int(global_step.numpy())
  if step >= settings.max_steps:
    logging.info('Global step %d is at train.max_steps=%d already: nothing to train.', step,
                 settings.max_steps)
    return
  with tf.device(input_device):
    dataset = generator.Dataset(start_batch=step)
    iterator = iter(dataset)

  def ForwardBackward(batch):
    theta = task.theta
    with jobs.StepPlacement(input_device is not None):
      metrics, grads = task.ForwardBackward(theta, batch)
    return metrics, learner_lib.GradientsAndVariables(theta, grads)

  batch_size = base_runner.BatchSize(dataset.element_spec)
  for pipe in jobs.Pipelines(task):
    logging.info('Pipeline %s.', _Describe(pipe))
  started = time.perf_counter()
  logging.info('Tracing the training step: %s ...', _TracedWork(task, batch_size))
  try:
    loop_fn = learner.BuildLoop(dataset.element_spec, ForwardBackward)
  except ValueError as e:  # The model does not fit its input, e.g. from an override.
    raise errors.UserError(f'Cannot build the training step: {e}') from None
  traced = time.perf_counter() - started
  logging.info('Traced the training step in %.1f s; its first run optimizes the graph.', traced)
  for line in _LoopLines(task, batch_size, traced):
    logging.info(line)
  # Once the run can start (the params build, the checkpoints fit them, the input makes a
  # dataset): where it ends, for an evaler (evaler._TrainersMaxSteps).
  params_path = os.path.join(train_dir, 'params.txt')
  with errors.Writing(params_path), tf.io.gfile.GFile(params_path, 'w') as f:
    f.write(model_params.ToText())
  writer = tf.summary.create_file_writer(train_dir)
  logging.info('Training %s from step %d to train.max_steps=%d (--max_steps=N to change). '
               'Checkpoints: %s; TensorBoard: tensorboard --logdir=%s', model_params.name, step,
               settings.max_steps, train_dir, logdir)
  def RerunStep(step):
    with tf.device(input_device):
      batch = next(iter(generator.Dataset(start_batch=step)))
    learner.StepForwardBackward(ForwardBackward, batch, tf.constant(step, tf.int64))

  step = base_runner.RunTraining(loop_fn, iterator, global_step, checkpointer, writer,
                                 settings, batch_size,
                                 _PipelineStats(task, learner, ForwardBackward, train_dir,
                                                pipeline_stats_every), stop,
                                 rerun_step=RerunStep)
  if stop:
    stop.Check(step, checkpointer.latest)
  logging.info('Trained to step %d. Latest checkpoint: %s; TensorBoard: tensorboard --logdir=%s',
               step, checkpointer.latest, logdir)
