"""A training pass of a PipeliningLayer: what ForwardBackward and a differentiable FProp run.

gpipe.py holds the model (cells, devices, params, the schedule it picks); this module runs
one pass of it: the `before` layers under their own tape, the executor's replicas over the
schedule's actions, each loss L and the gradient it hands the last chunk
(loss_contract.py), and the merged loss and gradients. Like the executor, it is Python run
once at trace time: it emits ops in the schedule's order, then only the graph runs.
"""

import tensorflow as tf

from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import executor
from lingvo_gpipe.pipeline import loss_contract
from lingvo_gpipe.pipeline import metrics as metrics_lib
from lingvo_gpipe.pipeline import microbatch
from lingvo_gpipe.pipeline import replicas
from lingvo_gpipe.pipeline import schedule as schedule_lib
from lingvo_gpipe.pipeline import schedule_actions


def ForwardBackward(layer, theta, inputs, loss_fn, labels, with_outputs, loss_reduction):
  """PipeliningLayer.ForwardBackward (its doc): the schedule's actions run by the
  executor's replicas, each micro-batch's loss and its gradient computed as L reaches it."""
  loss_contract.CheckReduction(loss_reduction)
  args, before_tape = _BeforeWithTape(layer, theta, executor.AsArgs(inputs))
  rows, num = layer.MicroBatching(args)
  microbatch.CheckLabels(labels, rows, layer.params.batch_dim)
  prog = layer.ProgramFor(num)
  sched = prog.schedule
  # Only `before` layers take the gradients of the cells' arguments.
  run = replicas.Replicas(layer, layer.ChunkThetas(theta), args, num, layer.params.remat,
                          layer.PassStep(), split=prog.SplitBackwards(), tracer=layer.Tracer(),
                          need_input_grads=before_tape is not None,
                          keep_outputs=with_outputs or sched.whole_batch_loss)
  loss_scale = py_utils.CurrentContext().loss_scale
  micro_loss_fn = None if sched.whole_batch_loss else loss_contract.MicroBatchLoss(
      loss_fn, loss_reduction, num * layer.num_replicas, rows, layer.params.batch_dim,
      schedule_lib.Name(layer.params.schedule))

  label_parts = None  # Per replica, its labels and their micro-batches (set below).

  def OnLoss(one, m):
    if one is None:  # L(*): the whole batch's loss, once over every replica.
      outputs, acts = run.MergedOutputs()
      batch_metrics, d_outputs, d_acts = _LossGradients(layer, loss_fn, loss_scale, outputs,
                                                        acts, labels)
      run.SetOutputGradients(d_outputs, d_acts)
    else:
      outputs, acts = one.MicroBatchOutputs(m)
      rows = None if labels is None else one.MicroBatchRows(*label_parts[one.replica], m)
      batch_metrics, d_outputs, d_acts = _LossGradients(layer, micro_loss_fn, loss_scale,
                                                        outputs, acts, rows)
      one.SetMicroBatchOutputGradients(m, d_outputs, d_acts)
    # (NestedMap of (value, weight), whether loss_fn returned a NestedMap)
    return batch_metrics

  with tf.device(layer.ReplicaDevices(0)[-1]):
    label_parts = None if labels is None or sched.whole_batch_loss else _SplitLabels(
        layer, labels, num)
    run.Execute(prog.instructions, OnLoss)
  base_layer.ApplyRecordedUpdates(run.updates)
  losses = run.losses  # Per L: (its metrics, whether loss_fn returned a NestedMap).
  merged = metrics_lib.MergeMetrics([metrics for metrics, _ in losses])
  # The backward differentiated value * weight (* loss_scale) of each call: divide by the
  # total weight (and the scale).
  weight = merged.loss[1]
  scale = 1.0 / (weight if loss_scale is None else weight * tf.cast(loss_scale, weight.dtype))
  grads = py_utils.NestedMap(
      before=theta.before if before_tape is None else _BeforeGradients(
          layer, theta, before_tape, args, run.MergedInputGradients()),
      cell=run.gradient_sums).Transform(lambda g: g * tf.cast(scale, g.dtype))
  loss = merged if losses[0][1] else merged.loss[0]
  return (loss, grads, layer.Result(*run.MergedOutputs())) if with_outputs else (loss, grads)


def _BeforeWithTape(layer, theta, args):
  if not layer.before:
    return args, None
  tape = tf.GradientTape(watch_accessed_variables=False)
  with tape:
    tape.watch([x for x in tf.nest.flatten(theta.before) if py_utils.IsFloatTensor(x)])
    args = layer.BeforeFProp(theta, args)
  return args, tape


def _BeforeGradients(layer, theta, tape, args, d_args):
  pairs = [(a, g) for a, g in zip(tf.nest.flatten(args), tf.nest.flatten(d_args))
           if g is not None]
  with tf.device(layer.devices[0]):
    grads = tape.gradient([a for a, _ in pairs], tf.nest.flatten(theta.before),
                          output_gradients=[g for _, g in pairs],
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
  return tf.nest.pack_sequence_as(theta.before, grads)


def _SplitLabels(layer, labels, num):
  """Per replica, (its rows of `labels`, their micro-batches): split as executor.Replicas
  splits the inputs (replicas first, then micro-batches)."""
  batch_dim = layer.params.batch_dim
  parts = microbatch.Split(labels, layer.num_replicas, batch_dim) if (
      layer.num_replicas > 1) else [labels]
  return [(part, microbatch.Split(part, num, batch_dim)) for part in parts]


def _LossGradients(layer, loss_fn, loss_scale, outputs, acts, labels=None):
  """loss_fn's metrics and the gradients of value * weight (* loss_scale, unless None) of
  their loss: 0 for a weight of 0, also where the value is NaN (a mean over no items: an
  empty micro-batch, or one whose rows all weigh 0), as a whole batch holding them would
  have it."""
  floats = [x for x in tf.nest.flatten((outputs, acts)) if py_utils.IsFloatTensor(x)]
  with tf.GradientTape() as tape:
    tape.watch(floats)
    result = layer.Result(outputs, acts)
    args = result if acts else (result,)
    value = loss_fn(*args) if labels is None else loss_fn(*args, labels)
    metrics = metrics_lib.AsMetrics(value)
    loss, weight = metrics.loss
    weighted = loss * tf.stop_gradient(weight)
    if loss_scale is not None:
      weighted *= tf.cast(loss_scale, weighted.dtype)
  loss_contract.RefuseWeightsRead(layer, tape.watched_variables())
  grads = tape.gradient(weighted, floats, unconnected_gradients=tf.UnconnectedGradients.ZERO)
  weighs = tf.not_equal(weight, 0)
  grads = iter(tf.where(weighs, g, tf.zeros_like(g)) for g in map(tf.convert_to_tensor, grads))
  d_outputs, d_acts = tf.nest.map_structure(
      lambda x: next(grads) if py_utils.IsFloatTensor(x) else None, (outputs, acts))
  return (metrics, isinstance(value, dict)), d_outputs, d_acts


def DifferentiableForward(layer, thetas, args, num):
  """The training forward, with the pipelined backward as its custom gradient: the
  schedule's actions before its whole-batch loss L(*), then, in the gradient, after it."""
  prog = layer.ProgramFor(num)
  if not prog.schedule.whole_batch_loss:
    raise ValueError(f"FProp in training (the context's training=True, the default) runs "
                     f"fill-drain ('gpipe'); schedule="
                     f"{schedule_lib.Name(layer.params.schedule)!r} trains through "
                     "ForwardBackward, and runs FProp's forwards in py_utils.EvalMode().")
  instructions = prog.instructions
  loss_at = next(i for i, a in enumerate(instructions) if a.kind == schedule_actions.LOSS)
  step = layer.PassStep()
  tracer = layer.Tracer()
  flat_theta, flat_args = tf.nest.flatten(thetas), tf.nest.flatten(args)
  arg_pos = [i for i, x in enumerate(flat_args) if isinstance(x, tf.Tensor)]
  box = {}

  @tf.custom_gradient
  def Pipeline(*tensors):
    # stop_gradient: the caller's tape must not record (and keep) cell internals.
    stopped = [tf.stop_gradient(x) for x in tensors]
    run_args = py_utils.Replaced(flat_args, arg_pos, stopped[len(flat_theta):])
    run = replicas.Replicas(layer, tf.nest.pack_sequence_as(thetas, stopped[:len(flat_theta)]),
                            tf.nest.pack_sequence_as(args, run_args), num, layer.params.remat,
                            step, split=prog.SplitBackwards(), tracer=tracer)
    run.Execute(instructions[:loss_at])
    structure = run.MergedOutputs()
    flat_out = tf.nest.flatten(structure)
    out_pos = [i for i, x in enumerate(flat_out) if isinstance(x, tf.Tensor)]
    box.update(run=run, structure=structure, flat_out=flat_out, out_pos=out_pos)

    def Grad(*d_tensors):
      d_out = tf.nest.pack_sequence_as(
          structure, py_utils.Replaced([None] * len(flat_out), out_pos, d_tensors))
      run.SetOutputGradients(*d_out)
      run.Execute(instructions[loss_at + 1:])
      d_args = tf.nest.flatten(run.MergedInputGradients())
      return tf.nest.flatten(run.gradient_sums) + [d_args[i] for i in arg_pos]

    return [flat_out[i] for i in out_pos], Grad

  out_tensors = Pipeline(*flat_theta, *[flat_args[i] for i in arg_pos])
  base_layer.ApplyRecordedUpdates(box['run'].updates)
  flat_out = py_utils.Replaced(box['flat_out'], box['out_pos'], out_tensors)
  return tf.nest.pack_sequence_as(box['structure'], flat_out)
