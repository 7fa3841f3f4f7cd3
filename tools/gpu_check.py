r"""The GPU check: one prepared script that says whether a GPU runs this library as a CPU does.

Each point runs in a fresh process whose GPU is split into K logical GPUs of --split_mb MB
(devices.ConfigureLocal), so K stages share one physical GPU as K logical CPUs do here:

  exact       every schedule at each K of --stages: check_pipeline (pipelined against
              unpipelined training of --exact_model with 8 decoder layers, 3 SGD steps);
              the largest relative difference of the losses and of the weights.
  memory      --model at each K of --stages: the planner's bytes per device (weights,
              gradients, Adam's slots, activations; balance_plan.Plan.StageMemory, its layers
              profiled on this device) against the allocator's peak per device during a
              training step, the model cut by that plan.
  bubble      --model at K=max(--stages), M=--micro_batches, each one-chunk schedule: the
              measured bubble of a step against the simulated one (pipeline_stats).
  throughput  --model's training step (the trainer's Learner: Adam, and loss scaling in
              float16) in examples/s at each K of --throughput_stages, in each of --dtypes.

  python tools/gpu_check.py                              # on one GPU: a few minutes
  python tools/gpu_check.py --quick --device=cpu         # a dry run on logical CPUs

Goals on a GPU (issue 42): every exact row within 1e-5, each device's peak within 20% of
the planner's prediction, each measured bubble within 5 points of the simulated one. On
CPUs the logical devices share one allocator, so the memory rows compare the process's peak
with the sum of the predictions (per_device false).
"""

import json
import os
import sys
import time

from absl import flags
import bench_utils
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.runners import binaries

flags.DEFINE_string('single', None, 'Internal: run one point given as JSON.')
flags.DEFINE_enum('device', 'auto', ['auto', 'gpu', 'cpu'],
                  'Where to run: GPUs when TensorFlow sees one (auto), or logical CPUs.')
flags.DEFINE_integer('split_mb', 16000, 'MB of each logical GPU of a split.')
flags.DEFINE_string('exact_model', 'lm.synthetic.GPipeTransformerLmTiny',
                    'The registered model the exact rows train.')
flags.DEFINE_string('model', 'lm.synthetic.GPipeTransformerLmBig',
                    'The registered model of the memory, bubble and throughput rows.')
bench_utils.DefineCounts('stages', '2,4', 'K of the exact and memory rows.')
bench_utils.DefineCounts('throughput_stages', '1,2,4', 'K of the throughput rows.')
flags.DEFINE_list('schedules', ['gpipe', '1f1b', 'interleaved_1f1b', 'zb_h1', 'zb_h2', 'zbv'],
                  'Schedules of the exact rows (the one-chunk ones also of the bubble rows).')
flags.DEFINE_list('dtypes', ['float32', 'bfloat16', 'float16'], 'fprop_dtype of the '
                  'throughput rows.')
flags.DEFINE_integer('micro_batches', 8, 'M of the bubble rows.')
flags.DEFINE_integer('steps', 10, 'Timed training steps per throughput row.')
flags.DEFINE_float('tolerance', 1e-5, 'Largest relative difference an exact row passes with.')
flags.DEFINE_bool('quick', False, 'A dry run: --model is the exact model, K=2, the first two '
                  '--schedules, throughput in float16 only, 2 steps.')
bench_utils.DefineJsonOut()
bench_utils.CheckChoices('schedules', named_schedules.SCHEDULE_NAMES)
bench_utils.CheckChoices('dtypes', ('float32', 'bfloat16', 'float16'))
FLAGS = flags.FLAGS
flags.adopt_module_key_flags(bench_utils)  # Its Define* flags are this tool's.

_DECODER_LAYERS = 8  # Enough cells for K=4 with two chunks per device.
_MAX_WARMUP_STEPS = 30  # Float16 steps a throughput row's loss scale may skip before timing.


def _SetUp(config):
  """TensorFlow with the point's K devices (a GPU split into K, or K logical CPUs)."""
  binaries.QuietTensorFlow()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.foundation import devices  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.foundation import memory_stats  # pylint: disable=g-import-not-at-top
  memory_stats.EnableStats()
  k = max(1, config['stages'])
  gpu = devices.LocalKind(config['device'], len(tf.config.list_physical_devices('GPU')))
  devices.ConfigureLocal(config['device'], k,
                         gpu_split_mb=config['split_mb'] if gpu == 'GPU' else None)
  return tf


def _Params(config, model):
  """Train params of `model` cut into the point's K stages (v chunks each), M, schedule."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.runners import base_runner  # pylint: disable=g-import-not-at-top
  params = base_runner.LoadModelParams(model, 'Train')
  stack = params.task.stack
  v = bench_utils.VIRTUAL_STAGES.get(config['schedule'], 1)
  stack.Set(splits=config['stages'] * v, virtual_stages=v, schedule=config['schedule'],
            num_micro_batches=config['micro_batches'],
            fprop_dtype=tf.as_dtype(config.get('dtype', 'float32')))
  if model == config['exact_model']:
    stack.num_decoder_layers = _DECODER_LAYERS
  return params


def _Training(tf, params):
  """(run(n): n training steps in one call, the task): the trainer's Learner and step."""
  from lingvo_gpipe.runners import base_runner  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.training import learner as learner_lib  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.pipeline import cell_functions  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.pipeline import gpipe  # pylint: disable=g-import-not-at-top
  task = params.task.Instantiate()
  step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
  learner = learner_lib.Learner(task.train_params, task.trainable_variables, step)
  for pipe in (m for m in task.submodules if isinstance(m, gpipe.PipeliningLayer)):
    cell_functions.CreateGradientSums(pipe)

  def ForwardBackward(batch):
    metrics, grads = task.ForwardBackward(task.theta, batch)
    return metrics, learner_lib.GradientsAndVariables(task.theta, grads)

  dataset = base_runner.InputDataset(params.input).repeat()
  loop = learner.BuildLoop(dataset.element_spec, ForwardBackward)
  iterator = iter(dataset)

  def Run(n):
    """(the last step's loss, the float16 steps skipped so far)."""
    out = loop(iterator, tf.constant(n, tf.int64))
    return float(out.loss), int(out.get('skipped_steps', 0))

  return Run, task


def _Exact(config):
  from lingvo_gpipe.runners import pipeline_check  # pylint: disable=g-import-not-at-top
  report = pipeline_check.CheckPipeline(_Params(config, config['exact_model']),
                                        tolerance=config['tolerance'])
  return dict(loss_difference=report.loss_difference, weights_difference=report.weights[0],
              worst_layer=report.weights[1], ok=report.ok)


def _Memory(tf, config):
  from lingvo_gpipe.foundation import devices  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.insight import balance_plan  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.insight import planner  # pylint: disable=g-import-not-at-top
  params = _Params(config, config['model'])
  pipe = params.task.stack
  rows = params.input.batch_size
  profiles, glued = planner.PipelineProfiles(pipe, rows // pipe.num_micro_batches, repeats=1)
  plan = planner.MakePlan(profiles, config['stages'], pipe.num_micro_batches, pipe.schedule,
                          pipe.remat, optimizer_slots=2, glued=glued,
                          remat_policy=pipe.cell_remat_policy)
  balance_plan.ApplyPlan(params, plan)
  run, _ = _Training(tf, params)
  run(1)  # Trace; the slots and gradient sums exist from here on.
  topology = devices.Current()
  per_device = topology.kind == 'GPU'
  names = list(topology.devices[:config['stages']]) if per_device else ['CPU:0']
  for name in names:
    tf.config.experimental.reset_memory_stats(name)
  run(1)
  measured = [tf.config.experimental.get_memory_info(n)['peak'] for n in names]
  predicted = plan.StageMemory() if per_device else [sum(plan.StageMemory())]
  return dict(per_device=per_device, devices=[devices.ShortName(n) for n in names],
              predicted_bytes=predicted, measured_bytes=measured,
              ratio=[m / p for m, p in zip(measured, predicted)], ends=plan.ends)


def _Bubble(tf, config):
  step = bench_utils.BuildStep(tf, dict(config, model=config['model'], remat='always'))
  summary = bench_utils.MeasureBubble(step.measured, 3)
  return dict(bubble=summary['bubble_fraction'], simulated=summary['simulated_bubble'],
              difference=summary['bubble_fraction'] - summary['simulated_bubble'])


def _Throughput(tf, config):
  params = _Params(config, config['model'])
  run, _ = _Training(tf, params)
  _, warmup_skipped = run(2)  # Trace and warm up,
  for _ in range(_MAX_WARMUP_STEPS):  # and in float16 past the steps the loss scale skips.
    _, now = run(1)
    if now == warmup_skipped:
      break
    warmup_skipped = now
  start = time.perf_counter()
  loss, skipped = run(config['steps'])
  seconds = time.perf_counter() - start
  return dict(examples_per_s=params.input.batch_size * config['steps'] / seconds,
              step_s=seconds / config['steps'], loss=loss, warmup_skipped_steps=warmup_skipped,
              skipped_steps=skipped - warmup_skipped)


def _RunOne(config):
  tf = _SetUp(config)
  from lingvo_gpipe.foundation import devices  # pylint: disable=g-import-not-at-top
  section = config['section']
  result = (_Exact(config) if section == 'exact' else
            _Memory(tf, config) if section == 'memory' else
            _Bubble(tf, config) if section == 'bubble' else _Throughput(tf, config))
  topology = devices.Current()
  return dict(config, **result, device_kind=topology.kind)


def _Points():
  quick = FLAGS.quick
  model = FLAGS.exact_model if quick else FLAGS.model
  stages = [2] if quick else [int(k) for k in FLAGS.stages]
  schedules = FLAGS.schedules[:2] if quick else FLAGS.schedules
  base = dict(device=FLAGS.device, split_mb=FLAGS.split_mb, exact_model=FLAGS.exact_model,
              model=model, tolerance=FLAGS.tolerance, steps=2 if quick else FLAGS.steps)
  points = [dict(base, section='exact', stages=k, schedule=s, micro_batches=4)
            for k in stages for s in schedules]
  points += [dict(base, section='memory', stages=k, schedule='1f1b', micro_batches=4)
             for k in stages]
  one_chunk = [s for s in schedules if s not in bench_utils.VIRTUAL_STAGES]
  points += [dict(base, section='bubble', stages=max(stages), schedule=s,
                  micro_batches=FLAGS.micro_batches) for s in one_chunk]
  points += [dict(base, section='throughput', stages=k, schedule='1f1b', micro_batches=4,
                  dtype=d) for k in ([2] if quick else map(int, FLAGS.throughput_stages))
             for d in (['float16'] if quick else FLAGS.dtypes)]
  return points


def _Tables(results):
  def Of(section):
    return [r for r in results if r['section'] == section]

  def Mb(values):
    return ' / '.join(f'{v / 2**20:.0f}' for v in values)

  return '\n\n'.join([
      bench_utils.MarkdownTable(Of('exact'), [
          ('K', lambda r: r['stages']), ('schedule', lambda r: r['schedule']),
          ('loss rel. diff', lambda r: f"{r['loss_difference']:.1e}"),
          ('weights rel. diff', lambda r: f"{r['weights_difference']:.1e}"),
          ('ok', lambda r: 'yes' if r['ok'] else 'NO')]),
      bench_utils.MarkdownTable(Of('memory'), [
          ('K', lambda r: r['stages']), ('devices', lambda r: ', '.join(r['devices'])),
          ('predicted MB', lambda r: Mb(r['predicted_bytes'])),
          ('measured peak MB', lambda r: Mb(r['measured_bytes'])),
          ('measured / predicted', lambda r: ' / '.join(f'{x:.2f}' for x in r['ratio']))]),
      bench_utils.MarkdownTable(Of('bubble'), [
          ('K', lambda r: r['stages']), ('M', lambda r: r['micro_batches']),
          ('schedule', lambda r: r['schedule']), ('measured', lambda r: f"{r['bubble']:.3f}"),
          ('simulated', lambda r: f"{r['simulated']:.3f}"),
          ('difference', lambda r: f"{r['difference']:+.3f}")]),
      bench_utils.MarkdownTable(Of('throughput'), [
          ('K', lambda r: r['stages']), ('dtype', lambda r: r['dtype']),
          ('examples/s', lambda r: f"{r['examples_per_s']:.1f}"),
          ('step s', lambda r: f"{r['step_s']:.3f}"), ('loss', lambda r: f"{r['loss']:.4f}"),
          ('float16 skips: warm-up / timed',
           lambda r: f"{r['warmup_skipped_steps']} / {r['skipped_steps']}")]),
  ])


def main(argv):
  del argv
  if FLAGS.single:
    print(json.dumps(_RunOne(json.loads(FLAGS.single))))
    return
  points = _Points()
  start = time.time()
  results = bench_utils.RunPoints(__file__, points, lambda c, _: (
      f"{c['section']} K={c['stages']} {c.get('dtype') or c['schedule']}: done after "
      f'{time.time() - start:.0f} s'))
  kinds = sorted({r['device_kind'] for r in results})
  where = 'a split GPU' if kinds == ['GPU'] else 'logical CPU devices sharing one allocator'
  notes = [f'gpu_check on {", ".join(kinds)} ({where}), {len(points)} points in '
           f'{time.time() - start:.0f} s; {os.cpu_count()} cores; python {sys.version.split()[0]}']
  bench_utils.Emit(_Tables(results), results, FLAGS.json_out, notes)


if __name__ == '__main__':
  binaries.Run(main)
