r"""Inspects a model: its params as text, its pipeline stages, their layers, sizes and FLOPs.

For every PipeliningLayer of the model it prints the layers (class, parameters,
forward FLOPs of a replica's step from FPropMeta, output bytes of the largest
micro-batch) and the stages they form, with each stage's parameters, FLOPs and estimated memory per
device: weights, gradients and optimizer slots, plus the activations kept by the
schedule, estimated from the layers' output sizes (the balance planner's memory
model, with outputs standing in for the activations it measures, and the
pipeline's cell_remat_policy: segment inputs kept instead). The bubble
is the simulator's with stage costs proportional to FLOPs.

  python tools/print_model.py --model=lm.synthetic.GPipeTransformerLmBig
  python tools/print_model.py --model=mlp --stages=4 --noshow_params
  python tools/print_model.py --model=mlp --stages=1 --remat_policy=every_2
  python tools/print_model.py --model=lm.synthetic.GPipeTransformerLmBig \
      --balance_file=/tmp/plan.json
"""

import json
import sys

from absl import flags
import bench_utils
from lingvo_gpipe.foundation import errors
from lingvo_gpipe.runners import binaries

FLAGS = flags.FLAGS
flags.DEFINE_string('model', 'lm.synthetic.GPipeTransformerLmBig',
                    "A registry key, or 'mlp' / 'transformer' for a built-in stack.")
flags.DEFINE_string('model_params_override', '', "Params text 'a.b : value; ...' to apply.")
flags.DEFINE_string('balance_file', '', 'A balance plan to cut the pipelines by.')
flags.DEFINE_boolean('show_params', True, 'Print the model params as text.')
flags.DEFINE_integer('optimizer_slots', 2, 'Optimizer tensors per weight (Adam 2, SGD 0).')
flags.DEFINE_integer('stages', 4, 'Built-in stacks: K.')
flags.DEFINE_integer('micro_batches', 8, 'Built-in stacks: M.')
flags.DEFINE_integer('layers', 8, 'Built-in stacks: layers.')
flags.DEFINE_integer('width', 256, 'Built-in stacks: width.')
flags.DEFINE_integer('hidden', 1024, 'Built-in stacks: feed-forward hidden width.')
flags.DEFINE_integer('rows', 64, 'Built-in stacks: batch rows (sequences for the Transformer).')
flags.DEFINE_integer('seq_len', 64, 'Built-in Transformer: sequence length.')
flags.DEFINE_string('remat_policy', 'none',
                    'Built-in stacks: cell_remat_policy (lingvo_gpipe/layers/remat.py).')
flags.DEFINE_boolean('json', False, 'Also print the layers and stages as JSON, after the tables.')
bench_utils.DefineOutputPath('json_out', None, 'Also write that JSON to this file.')
bench_utils.RefuseBuiltInSizes(
    ('stages', 'micro_batches', 'remat_policy') + bench_utils.BUILT_IN_SIZES)
flags.adopt_module_key_flags(bench_utils)  # Its Define* flags are this tool's.


def _BuiltIn(tf):
  """(params text, pipeline params, batch spec) of a built-in stack."""
  from lingvo_gpipe.pipeline import gpipe  # pylint: disable=g-import-not-at-top
  layer_params, shape = bench_utils.LayerParams(bench_utils.FlagsConfig(FLAGS))
  cells = gpipe.PartitionSequentialLayers(layer_params, FLAGS.stages, tf.TensorShape(shape))
  pipe = gpipe.PipeliningLayer.Params().Set(name=FLAGS.model, cell_tpl=cells,
                                            num_micro_batches=FLAGS.micro_batches,
                                            cell_remat_policy=FLAGS.remat_policy)
  return pipe, tf.TensorSpec(shape)


def _Registered():
  """(model params, their pipelines) of a registry key with overrides and a balance plan."""
  from lingvo_gpipe.runners import base_runner  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.pipeline import pipeline_params  # pylint: disable=g-import-not-at-top
  try:
    params = base_runner.LoadModelParams(FLAGS.model, 'Train', FLAGS.model_params_override)
    if FLAGS.balance_file:
      base_runner.ApplyBalanceFile(params, FLAGS.balance_file, FLAGS.model_params_override,
                                   base_runner.InputBatchSize(params))
  except errors.UserError as e:
    sys.exit(f'print_model: error: {e}')
  return params, [p for _, p in pipeline_params.Find(params.task)]


def _WithBatch(tf, spec, batch):
  if isinstance(spec, dict):
    return type(spec)({k: _WithBatch(tf, v, batch) for k, v in spec.items()})
  return tf.TensorSpec([batch] + list(spec.shape)[1:], spec.dtype)


def _Bytes(tf, specs):
  """Bytes of TensorSpecs, or of TensorShapes (float32), in a structure."""
  leaves = tf.nest.flatten(specs, expand_composites=False)
  return int(sum(tf.TensorShape(getattr(s, 'shape', s)).num_elements() *
                 (s.dtype.size if hasattr(s, 'dtype') else 4) for s in leaves))


def Inspect(tf, pipe, spec, batch_size, source):
  """Layer rows, stage rows and the balance_plan.Plan of one pipeline (see the module docstring)."""
  from lingvo_gpipe.pipeline import pipeline_params  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.insight import balance_plan  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.insight import stage_model  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.layers import profiler  # pylint: disable=g-import-not-at-top
  layer_params, ends = pipeline_params.LayersAndEnds(pipe)
  from lingvo_gpipe.pipeline import microbatch  # pylint: disable=g-import-not-at-top
  num_micro = microbatch.NumMicroBatches(batch_size, pipe.num_micro_batches,
                                         pipe.micro_batch_size, pipe.num_replicas)
  replica_rows = -(-batch_size // pipe.num_replicas)  # The largest replica's part.
  micro = -(-replica_rows // num_micro)  # Its largest micro-batch: what memory holds.
  params = profiler.LayerCosts(layer_params, None, cost='params')
  shapes = (_WithBatch(tf, spec, micro),)
  rows, profiles = [], []
  for p, count in zip(layer_params, params):
    meta = p.cls.FPropMeta(p, *shapes) if p.cls.HasFPropMeta() else None
    flops = meta.flops * replica_rows / micro if meta else None  # A step of one replica.
    out = tuple(meta.out_shapes) if meta else shapes
    rows.append(dict(name=p.name, cls=p.cls.__name__, params=int(count), gflops=(
        flops / 1e9 if flops is not None else None), output_bytes=_Bytes(tf, out)))
    profiles.append(profiler.LayerProfile(
        name=p.name, forward_s=float(flops or 0), backward_s=2.0 * float(flops or 0),
        param_bytes=tf.as_dtype(pipe.dtype).size * int(count), input_bytes=_Bytes(tf, shapes),
        activation_bytes=_Bytes(tf, out)))
    shapes = out
  # The planner plans one cell per device: with v cells per device it gives each cell's costs
  # (as a fill-drain plan of the cells), and _Bubble places the cells as the schedule does.
  plan = balance_plan.Plan(source=source, layers=profiles, ends=list(ends),
                           num_micro_batches=num_micro,
                           schedule=pipe.schedule if pipe.virtual_stages == 1 else 'gpipe',
                           remat=stage_model.ModeledRemat(pipe.schedule, pipe.remat),
                           optimizer_slots=FLAGS.optimizer_slots,
                           remat_policy=pipe.cell_remat_policy)
  return rows, plan


def _Placement(pipe, plan):
  """The device of each cell, as the pipeline's schedule places them."""
  from lingvo_gpipe.pipeline import named_schedules  # pylint: disable=g-import-not-at-top
  v = pipe.virtual_stages
  return list(named_schedules.Orders(pipe.schedule, plan.num_stages // v,
                                     plan.num_micro_batches, v)[1])


def _Bubble(pipe, plan):
  """The simulator's bubble of the pipeline's schedule with the plan's cell costs."""
  from lingvo_gpipe.insight import simulator  # pylint: disable=g-import-not-at-top
  if pipe.virtual_stages == 1:
    return plan.Predict().bubble_fraction
  forward, backward = plan.StageCosts()
  input_grad, weight_grad = plan.SplitBackwardCosts()
  v = pipe.virtual_stages
  orders = simulator.Orders(pipe.schedule, plan.num_stages // v, plan.num_micro_batches, v)
  return simulator.Simulate(orders, forward, backward, input_grad_cost=input_grad,
                            weight_grad_cost=weight_grad).bubble_fraction


def _StageRows(pipe, plan, layer_rows):
  """A row per cell; with v > 1 cells per device, its device and no memory estimate (the
  planner's memory model holds one cell per device)."""
  stages = []
  devices = _Placement(pipe, plan)
  for k, (stage, (j, i)) in enumerate(zip(plan.Stages(), zip([0] + plan.ends[:-1], plan.ends))):
    flops = [r['gflops'] for r in layer_rows[j:i]]
    stages.append(dict(stage=k, device=int(devices[k]), layers=stage['layers'],
                       params=sum(r['params'] for r in layer_rows[j:i]),
                       gflops=None if None in flops else sum(flops),
                       memory_mb=stage['memory_bytes'] / 2**20
                       if pipe.virtual_stages == 1 else None))
  return stages


def _Print(pipe, plan, layer_rows, stage_rows):
  v = pipe.virtual_stages
  cells = f'{plan.num_stages} cells on K={plan.num_stages // v} (v={v})' if v > 1 else (
      f'K={plan.num_stages}')
  print(f'\n## {pipe.name}: {cells}, M={plan.num_micro_batches}, {pipe.schedule}, remat '
        f'{plan.remat}, remat policy {plan.remat_policy}\n')
  print(bench_utils.MarkdownTable(layer_rows, [
      ('layer', lambda r: r['name']), ('class', lambda r: r['cls']),
      ('parameters', lambda r: f"{r['params']:,}"),
      ('forward GFLOPs/step', lambda r: '-' if r['gflops'] is None else f"{r['gflops']:.3f}"),
      ('output KB/micro-batch', lambda r: f"{r['output_bytes'] / 1024:.1f}")]))
  print()
  print(bench_utils.MarkdownTable(stage_rows, [
      ('stage' if v == 1 else 'cell', lambda r: r['stage']),
      *([('device', lambda r: r['device'])] if v > 1 else []),
      ('layers', lambda r: ', '.join(r['layers'])),
      ('parameters', lambda r: f"{r['params']:,}"),
      ('forward GFLOPs/step', lambda r: '-' if r['gflops'] is None else f"{r['gflops']:.3f}"),
      ('memory MB est. from output sizes',
       lambda r: '-' if r['memory_mb'] is None else f"{r['memory_mb']:.1f}")]))
  if v > 1:
    print(f'\nNo memory estimate: the planner models one cell per device, not {v}.')
  if all(r['gflops'] is not None for r in stage_rows):
    print(f'\nBubble with FLOP-proportional stage costs: {_Bubble(pipe, plan):.3f}')


def main(argv):
  del argv
  tf = bench_utils.SetUpDevices(1)
  if FLAGS.model in ('mlp', 'transformer'):
    pipe, spec = _BuiltIn(tf)
    pipelines, batch_size, text = [pipe], spec.shape[0], pipe.ToText()
    specs = [spec]
  else:
    params, pipelines = _Registered()
    batch_size, text = params.input.batch_size, params.ToText()
    specs = [p.cls.InputSpec(p) for p in pipelines]
  if FLAGS.show_params:
    print(text)
  summary = []
  for pipe, spec in zip(pipelines, specs):
    if spec is None:
      print(f'\n## {pipe.name}: no per-layer view (its params do not say what its input is).')
      continue
    try:
      layer_rows, plan = Inspect(tf, pipe, spec, batch_size, FLAGS.model)
      stage_rows = _StageRows(pipe, plan, layer_rows)
    except ValueError as e:
      sys.exit(f'print_model: error: {pipe.name}: {e}')
    _Print(pipe, plan, layer_rows, stage_rows)
    summary.append(dict(pipeline=pipe.name, num_micro_batches=plan.num_micro_batches,
                        layers=layer_rows, stages=stage_rows))
  if FLAGS.json:
    print(json.dumps(summary, indent=1))
  if FLAGS.json_out:
    with open(FLAGS.json_out, 'w') as f:
      json.dump(summary, f, indent=1)


if __name__ == '__main__':
  binaries.Run(main)
