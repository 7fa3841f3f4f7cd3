"""The evaler and decoder jobs: they follow a trainer's checkpoints and measure each.

An evaler (--job=evaler_dev / evaler_test) computes the task's metrics (FPropTower) on a
dataset for every new checkpoint of <logdir>/train and writes them to
<logdir>/eval_<dataset> for TensorBoard; a decoder (--job=decoder_dev / decoder_test)
decodes the dataset (lingvo_gpipe.models.decoder) and writes exact_match and BLEU to
<logdir>/decoder_<dataset>, the decodes to decodes-<step>.txt there. Both stop at the
trainer's last step, or after --eval_timeout_secs without a new checkpoint. They take the
data settings the trainer recorded (WithTrainersSettings), so they measure the model on the
data it trained on.
"""

import dataclasses
import math
import os
import re
import time
from typing import Callable, Iterator

from absl import logging
import tensorflow as tf

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.models import decoder
from lingvo_gpipe.models import tasks as tasks_lib
from lingvo_gpipe.runners import base_runner
from lingvo_gpipe.runners import jobs
from lingvo_gpipe.training import checkpoint_files
from lingvo_gpipe.training import checkpointer as checkpointer_lib

# Decodes shown in TensorBoard's text tab per checkpoint (all are in decodes-<step>.txt).
_DECODES_SHOWN = 8


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """How an evaler or decoder job runs (the trainer's --eval_* flags).

  job: its name, for messages ('evaler_dev', 'decoder_test', ...).
  model: the registry key, for messages.
  once: evaluate the newest checkpoint and exit.
  timeout_secs: stop when no new checkpoint came for this long (None: wait forever).
  batches: batches per evaluation (None: the whole dataset).
  max_steps_given: train.max_steps was given (--max_steps): evaluate up to it, not up
    to the end the trainer recorded.
  """
  job: str
  model: str
  once: bool = False
  timeout_secs: float | None = None
  batches: int | None = None
  max_steps_given: bool = False


def Run(model_params: hyperparams.Params, logdir: str, dataset_name: str,
        settings: EvalSettings, on_cluster: bool = False, decode: bool = False) -> None:
  """Evaluates checkpoints of <logdir>/train, summaries in <logdir>/eval_<dataset>; with
  `decode`, decodes them (lingvo_gpipe.models.decoder), in <logdir>/decoder_<dataset> with the
  decodes of each checkpoint in decodes-<step>.txt.

  settings: EvalSettings. on_cluster: the pipelines run on a cluster's workers; ops
  the model leaves unplaced stay with their inputs. Batches are made here
  (evaluation reads them one by one).
  """
  s = settings
  if s.timeout_secs is not None and s.timeout_secs <= 0:
    raise errors.UserError(f'--eval_timeout_secs must be > 0, got {s.timeout_secs:g}.')
  base_runner.CheckPipelineBatches(model_params)
  train_dir = os.path.join(logdir, 'train')
  job = f'{"decoder" if decode else "eval"}_{dataset_name.lower()}'
  eval_dir = os.path.join(logdir, job)
  task, global_step, _, checkpointer = jobs.Instantiate(model_params, train_dir)
  measure = (_Decoding(task, eval_dir, on_cluster, s) if decode else
             _Evaluation(task, on_cluster, s.batches))
  newest = checkpointer.Newest() if s.once else None
  if s.once and not newest:
    raise errors.UserError(f'No checkpoint in {train_dir} to evaluate.')
  dataset = base_runner.InputDataset(model_params.input)
  if s.batches is None and dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
    raise errors.UserError(f'The {dataset_name} input repeats forever: set its num_batches '
                                'or --eval_batches.')

  jobs.MakeWritableDir(eval_dir)
  writer = tf.summary.create_file_writer(eval_dir)

  def EvaluateCheckpoint(path):
    """The step of `path` once evaluated, or None if rotation removed it while it loaded."""
    try:
      checkpointer.Restore(path)
    except checkpoint_files.READ_ERRORS as e:
      if checkpoint_files.Exists(path):
        raise errors.UserError(f'Cannot load checkpoint {path}: '
                                    f'{checkpoint_files.ReadErrorLine(e)}') from None
      logging.warning('Checkpoint %s was removed (rotation) while it was loaded; skipped.', path)
      return None
    step = int(global_step.numpy())
    metrics, num_batches = measure(dataset, step, writer)
    base_runner.WriteScalars(writer, step, metrics)
    logging.info('%s step %d (%d batches): %s', job, step, num_batches,
                 '  '.join(f'{k} {v:.5g}' for k, v in sorted(metrics.items())))
    bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
    if bad:
      raise base_runner.NonFiniteError(
          f'{job} of {path} (step {step}): '
          f'{", ".join(f"{k} {metrics[k]}" for k in bad)} not finite.')
    return step

  if s.once:
    if EvaluateCheckpoint(newest) is None:
      raise errors.UserError(f'Checkpoint {newest} was removed before it was evaluated.')
    return
  max_steps = _TrainersMaxSteps(train_dir, model_params.train.max_steps, s.max_steps_given)
  logging.info('Waiting for checkpoints in %s; evaluating until train.max_steps=%d.', train_dir,
               max_steps)
  step = None
  for path in _NewCheckpoints(checkpointer, s.timeout_secs):
    evaluated = EvaluateCheckpoint(path)
    step = step if evaluated is None else evaluated
    # The trainer may resume with more steps.
    max_steps = _TrainersMaxSteps(train_dir, model_params.train.max_steps, s.max_steps_given)
    if step is not None and step >= max_steps:
      return
  evaluated = 'none evaluated yet' if step is None else f'last evaluated: step {step}'
  raise errors.UserError(
      f'No new checkpoint in {train_dir} for --eval_timeout_secs={s.timeout_secs:g} '
      f'({evaluated}, train.max_steps={max_steps}): is the trainer running?')


def _Evaluation(task: tf.Module, on_cluster: bool, batches: int | None) -> Callable:
  """(dataset, step, writer) -> (metrics of the task's FPropTower, batches evaluated)."""
  @tf.function(autograph=False)
  def EvalStep(batch):
    with py_utils.EvalMode(), jobs.StepPlacement(on_cluster):
      return task.FPropTower(task.theta, batch)

  def Measure(dataset, step, writer):
    del step, writer  # Written by the caller.
    return base_runner.Evaluate(EvalStep, dataset, batches)

  return Measure


def CheckDecodes(task: tf.Module, flag: str, model: str) -> None:
  """A UserError unless `task` decodes (--flag asks it to)."""
  if not isinstance(task, tasks_lib.DECODING_TASKS):
    raise errors.UserError(
        f'--{flag} decodes sequence tasks '
        f'({", ".join(c.__name__ for c in tasks_lib.DECODING_TASKS)}); the task of '
        f'--model={model} is {type(task).__name__}.')


def _Decoding(task: tf.Module, decode_dir: str, on_cluster: bool,
              settings: EvalSettings) -> Callable:
  """(dataset, step, writer) -> (exact_match and bleu of the decodes, batches decoded); the
  decodes go to <decode_dir>/decodes-<step>.txt and TensorBoard's text tab."""
  CheckDecodes(task, f'job={settings.job}', settings.model)
  p = task.params.decoder

  @tf.function(autograph=False)
  def DecodeStep(batch):
    with jobs.StepPlacement(on_cluster):
      return decoder.Decode(task, task.theta, batch)

  def Measure(dataset, step, writer):
    lines = []

    def DecodeBatch(batch):
      examples = decoder.Examples({k: v.numpy() for k, v in DecodeStep(batch).items()})
      lines.extend(decoder.Line(p, example) for example in examples)
      return decoder.BatchMetrics(examples, p)

    means, num_batches = base_runner.Evaluate(DecodeBatch, dataset, settings.batches)
    path = os.path.join(decode_dir, f'decodes-{step}.txt')
    with errors.Writing(path), tf.io.gfile.GFile(path, 'w') as f:
      f.write(decoder.LINE_HEADER + ''.join(line + '\n' for line in lines))
    with errors.Writing('TensorBoard summaries'), writer.as_default(step=step):
      tf.summary.text('decodes', decoder.Markdown(lines[:_DECODES_SHOWN]))
    logging.info('Decodes of step %d: %s', step, path)
    return decoder.FinalMetrics(means), num_batches

  return Measure


def WithTrainersSettings(logdir: str, model: str, override: str, dataset_name: str,
                         doing: str = 'Evaluating') -> str:
  """`override` after the settings the trainer of logdir ran with (its params.txt) that
  the evaluated data shares (base_runner.TrainersSettings): an evaler evaluates the model the
  trainer trained, on the data source it trained on, unless its own override says otherwise."""
  path = os.path.join(logdir, 'train', 'params.txt')
  try:
    with tf.io.gfile.GFile(path) as f:
      recorded = f.read()
  except tf.errors.NotFoundError:
    return override
  own = set(base_runner.OverrideKeys(override))
  taken, overridden = [], []
  for line in base_runner.TrainersSettings(model, dataset_name, recorded):
    (overridden if line.split(' : ', 1)[0] in own else taken).append(line)
  if taken:
    logging.info("%s with the trainer's settings (%s): %s", doing, path, '; '.join(taken))
  if overridden:
    logging.warning("%s with your own override of settings the trainer set (%s), the trainer's "
                    'being: %s.', doing, path, '; '.join(overridden))
  return '\n'.join(taken + [override])


def _TrainersMaxSteps(train_dir: str, own: int, own_given: bool) -> int:
  """The step an evaler evaluates up to: `own` if given (own_given: by --max_steps), else
  `own` or less if the trainer of train_dir runs to less (its params.txt, e.g. from the
  trainer's own --max_steps), since no checkpoint beyond that will come. An evaler started
  before a trainer resumes with more steps stops at the old end: give it --max_steps.
  """
  if own_given:
    return own
  try:
    with tf.io.gfile.GFile(os.path.join(train_dir, 'params.txt')) as f:
      found = re.search(r'^train\.max_steps : (\d+)$', f.read(), re.M)
  except tf.errors.NotFoundError:
    return own
  return min(own, int(found.group(1))) if found else own


def _NewCheckpoints(checkpointer: checkpointer_lib.Checkpointer, timeout_secs: float | None,
                    poll_secs: float = 1.0) -> Iterator[str]:
  """Yields the newest intact checkpoint each time there is a newer one than the last.

  Found by listing and verifying (Checkpointer.Newest), not by the state file.
  Ends when none arrives for timeout_secs after the last (None: waits forever).
  """
  last, deadline = -1, None
  while True:
    path = checkpointer.Newest(after=last)
    if path:
      last, deadline = checkpoint_files.Step(path), None
      yield path
      continue
    if timeout_secs is not None:
      deadline = deadline or time.time() + timeout_secs
      if time.time() >= deadline:
        return
    time.sleep(poll_secs)


def ExportDecoder(model_params: hyperparams.Params, logdir: str, export_dir: str | None,
                  model: str) -> None:
  """--mode=export_decoder: the latest checkpoint's decoder as a SavedModel in export_dir
  (None: <logdir>/export/decoder-<step>); model: the registry key, for messages."""
  train_dir = os.path.join(logdir, 'train')
  task, global_step, _, checkpointer = jobs.Instantiate(model_params, train_dir)
  CheckDecodes(task, 'mode=export_decoder', model)
  newest = checkpointer.Newest()
  if not newest:
    raise errors.UserError(f'No checkpoint in {train_dir} to export.')
  checkpointer.Restore(newest)
  step = int(global_step.numpy())
  export_dir = export_dir or os.path.join(logdir, 'export', f'decoder-{step}')
  with errors.Writing(export_dir):
    decoder.Export(task, export_dir)
  logging.info('Exported the decoder of %s (step %d) to %s: serve its serving_default '
               'signature with tf.saved_model.load.', newest, step, export_dir)

