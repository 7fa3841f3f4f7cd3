"""check_pipeline: does a model train the same pipelined as unpipelined?

Builds the model twice from its params: as configured (K stages, M
micro-batches, schedule, remat and remat policy, R replicas, devices), and unpipelined: every
pipeline one stage on one device, fill-drain, no re-materialization, and the
same micro-batch size (batch norm normalizes per micro-batch, as in GPipe, so
that is part of the model). Both start from the same weights (the checkpoint's,
if given, restored by name into either layout; else the initial ones, which
must already agree bitwise) and train a few steps on the same batches with plain
SGD at the task's learning rate: an adaptive optimizer would blow rounding noise
in gradients that are exactly 0 up to whole steps. A float16 model's backward runs
unscaled here (no loss scale in the FProp context); that the pipeline's scaled backward
equals its unscaled one is tested in tests/learner_test.py. Then the losses, the weights
and the moving statistics are compared, each layer's variables on the scale of
that layer's largest value.

  python -m lingvo_gpipe.trainer --mode=check_pipeline --model=lm.synthetic.GPipeTransformerLmTiny
"""

import dataclasses
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import pipeline_params
from lingvo_gpipe.pipeline import schedule as schedule_lib
from lingvo_gpipe.runners import base_runner
from lingvo_gpipe.training import checkpointer as checkpointer_lib
from lingvo_gpipe.training import learner as learner_lib


def UnpipelinedParams(model_params: hyperparams.Params) -> hyperparams.Params:
  """A copy of model params whose pipelines run as one stage on one device, same micro-batches."""
  plain = model_params.Copy()
  for _, p in pipeline_params.Find(plain.task):
    layer_params, _ = pipeline_params.LayersAndEnds(p)
    p.virtual_stages = 1  # One cell: one chunk on one device.
    pipeline_params.Recut(p, [len(layer_params)])
    if p.micro_batch_size is None:
      p.num_micro_batches *= p.num_replicas  # Replicas split the batch into more micro-batches.
    p.Set(devices=None, num_replicas=1, remat='never', schedule='gpipe', cell_remat_policy='none')
  return plain


def _Describe(model_params: hyperparams.Params) -> str:
  return '; '.join(
      f'{path}: K={pipeline_params.NumStages(p)}, M={p.num_micro_batches}, '
      f'{schedule_lib.Name(p.schedule)}, remat {p.remat}, remat policy {p.cell_remat_policy}, '
      f'R={p.num_replicas}' for path, p in
      pipeline_params.Find(model_params.task, 'task')) or 'no pipeline in the params'


def _LayerDifferences(pairs: list[tuple[tf.Variable, tf.Variable]]) -> dict[str, float]:
  """Layer path -> largest |a - b| over that layer's (a, b) variables / largest |b| there."""
  diffs, scales = {}, {}
  for a, b in pairs:
    layer = a.name.split(':')[0].rsplit('/', 1)[0]
    va, vb = a.numpy().astype(np.float64), b.numpy().astype(np.float64)
    diffs[layer] = max(diffs.get(layer, 0.0), float(np.max(np.abs(va - vb), initial=0.0)))
    scales[layer] = max(scales.get(layer, 0.0), float(np.max(np.abs(vb), initial=0.0)))
  return {layer: diffs[layer] / max(scales[layer], 1e-12) for layer in diffs}


def _Worst(differences: dict[str, float]) -> tuple[float, str]:
  """(value, layer) of the largest difference, or (0.0, '-') if there is none."""
  return max(((v, k) for k, v in differences.items()), default=(0.0, '-'))


@dataclasses.dataclass
class Report:
  """What check_pipeline found; Text() is what the trainer prints."""
  pipelined: str
  start: str  # Where the weights came from.
  losses: list[tuple[float, float]]  # (pipelined, unpipelined) per step.
  same_start: bool
  weights: tuple[float, str]  # (largest relative difference, layer).
  statistics: tuple[float, str]
  tolerance: float

  @property
  def loss_difference(self) -> float:
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in self.losses), default=0.0)

  @property
  def ok(self) -> bool:
    return self.same_start and max(self.loss_difference, self.weights[0],
                                   self.statistics[0]) <= self.tolerance

  def Text(self) -> str:
    lines = [f'pipelined: {self.pipelined}',
             'unpipelined: every pipeline one stage on one device, gpipe, remat never, remat '
             'policy none, the same micro-batches',
             f'start: {self.start}; the same weights in both: '
             f'{"yes" if self.same_start else "NO"}',
             'step  loss pipelined  loss unpipelined  relative difference']
    lines += [f'{i:>4}  {a:>14.7g}  {b:>16.7g}  {abs(a - b) / max(abs(b), 1e-12):>19.2e}'
              for i, (a, b) in enumerate(self.losses)]
    lines += [f'largest relative difference: loss {self.loss_difference:.2e}, weights '
              f'{self.weights[0]:.2e} ({self.weights[1]}), moving statistics '
              f'{self.statistics[0]:.2e} ({self.statistics[1]})',
              f'{"PASS" if self.ok else "FAIL"} (tolerance {self.tolerance:g})']
    return '\n'.join(lines)


def _Build(model_params: hyperparams.Params,
           checkpoint_dir: str | None) -> tuple[tf.Module, Callable, str | None]:
  """(task, its SGD training step, the checkpoint restored or None) of model params."""
  task = model_params.Instantiate().task
  restored = None
  if checkpoint_dir:
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
    restored = checkpointer_lib.Checkpointer(checkpoint_dir, task.variables, step).Restore()
  learning_rate = task.params.train.learning_rate

  @tf.function(autograph=False)
  def Step(batch, step):
    with py_utils.Context(step=step):
      metrics, grads = task.ForwardBackward(task.theta, batch)
    for grad, var in learner_lib.GradientsAndVariables(task.theta, grads):
      var.assign_sub(tf.cast(learning_rate, var.dtype) * grad)
    return metrics.loss[0]

  return task, Step, restored


def CheckPipeline(model_params: hyperparams.Params, num_steps: int = 3, tolerance: float = 1e-4,
                  checkpoint_dir: Optional[str] = None) -> 'Report':
  """Trains model_params pipelined and unpipelined num_steps steps; returns the Report."""
  if num_steps < 1 or not tolerance > 0:
    raise errors.UserError(f'check_pipeline needs num_steps >= 1 and tolerance > 0; got '
                                f'{num_steps} and {tolerance}.')
  base_runner.CheckPipelineBatches(model_params)
  batches = list(base_runner.InputDataset(model_params.input).take(num_steps))
  if len(batches) < num_steps:
    raise errors.UserError(f'The input has {len(batches)} batches; check_pipeline needs '
                                f'{num_steps}.')
  try:
    piped, piped_step, restored = _Build(model_params, checkpoint_dir)
    plain, plain_step, _ = _Build(UnpipelinedParams(model_params), checkpoint_dir)
  except ValueError as e:
    raise errors.UserError(f'Cannot build the task: {e}') from None
  names = [v.name for v in piped.variables]
  if names != [v.name for v in plain.variables]:
    raise errors.UserError('The pipelined and unpipelined models have other variables: '
                                f'{sorted(set(names) ^ {v.name for v in plain.variables})}.')
  start = restored or 'the initial weights'
  same_start = all(np.array_equal(a.numpy(), b.numpy())
                   for a, b in zip(piped.variables, plain.variables))
  losses = []
  for i, batch in enumerate(batches):
    step = tf.constant(i, tf.int64)
    losses.append((float(piped_step(batch, step)), float(plain_step(batch, step))))
  pairs = list(zip(piped.variables, plain.variables))
  return Report(
      pipelined=_Describe(model_params), start=start, losses=losses, same_start=same_start,
      weights=_Worst(_LayerDifferences([(a, b) for a, b in pairs if a.trainable])),
      statistics=_Worst(_LayerDifferences([(a, b) for a, b in pairs if not a.trainable])),
      tolerance=tolerance)
