r"""How long a pipelined step takes to start: first call, steady step, graph size.

Each configuration runs in its own process: a residual MLP (`--layers` layers of
width `--width`, 2·M rows) cut into K·v cells, `PipeliningLayer.ForwardBackward`
in one tf.function. first_call_s is its first call (trace, graph optimization,
first run), step_s the median of the next calls, nodes the traced step's graph
nodes (the per-chunk functions' bodies not counted: they are traced once per
chunk, whatever M), traces how often the step was traced (1 is right).

With --trainer_models it also runs the trainer on each registered model, at its
own M and at each --trainer_micro_batches, for one step, and reports the seconds
from its "Pipeline" line to the end of the step (first_step_s: tracing, graph
optimization, the step, its checkpoint) and the process's peak host memory.

  python tools/startup_benchmark.py --stages=2,4,8 --micro_batches=8,64 \
      --schedules=1f1b,zb_h1 --remat=always,never
  python tools/startup_benchmark.py --stages= --trainer_models=lm.synthetic.GPipeTransformerLmBig
"""

import datetime
import json
import re
import resource
import subprocess
import sys
import tempfile
import time

from absl import flags
import bench_utils
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.runners import binaries

FLAGS = flags.FLAGS
bench_utils.DefineCounts('stages', ['2', '4', '8'], 'K values (empty: no step configurations).')
bench_utils.DefineCounts('micro_batches', ['8', '32', '64', '256'], 'M values.')
flags.DEFINE_list('schedules', list(named_schedules.SCHEDULE_NAMES), 'Schedules.')
flags.DEFINE_list('remat', ['always'], "Re-materialization modes ('always', 'except_last', "
                  "'never').")
flags.DEFINE_list('loop_steady_state', ['false', 'true'],
                  "PipeliningLayer.loop_steady_state values ('true': the steady state as one "
                  "tf.while_loop; 'false': every action unrolled; 'auto', the layer's "
                  'default: a loop where the steady state is long).')
flags.DEFINE_integer('layers', 32, 'Layers of the residual MLP.', lower_bound=1)
flags.DEFINE_integer('width', 32, 'Its width.', lower_bound=1)
flags.DEFINE_integer('hidden', 64, 'Its hidden width.', lower_bound=1)
flags.DEFINE_integer('steps', 5, 'Timed steps after the first call (median).', lower_bound=1)
flags.DEFINE_list('trainer_models', [], 'Registered models whose trainer start to time.')
bench_utils.DefineCounts('trainer_micro_batches', ['64'],
                         "M values the trainer models also run at (besides their own).")
flags.DEFINE_integer('timeout', 900, 'Seconds one configuration may take.', lower_bound=1)
bench_utils.CheckChoices('schedules', named_schedules.SCHEDULE_NAMES)
bench_utils.CheckChoices('remat', ('always', 'except_last', 'never'))
bench_utils.CheckChoices('loop_steady_state', ('true', 'false', 'auto'))
bench_utils.DefineJsonOut()
flags.DEFINE_string('single', None, 'Internal: run one configuration (JSON) and print it.')
flags.adopt_module_key_flags(bench_utils)

def _RunOne(config):
  """First call, steady step and graph nodes of one configuration; runs in its own process."""
  k, m, sched = config['stages'], config['micro_batches'], config['schedule']
  v = bench_utils.VIRTUAL_STAGES.get(sched, 1)
  tf = bench_utils.SetUpDevices(k)
  from lingvo_gpipe.pipeline import cell_functions  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.pipeline import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.foundation import py_utils  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.pipeline import steady_state  # pylint: disable=g-import-not-at-top
  layer_params, shape = bench_utils.LayerParams(dict(config, model='mlp', rows=2 * m))
  cells = gpipe.PartitionSequentialLayers(layer_params, k * v, tf.TensorShape(shape))
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=m, remat=config['remat'], schedule=sched,
      virtual_stages=v, loop_steady_state=config['loop_steady_state']).Instantiate()
  cell_functions.CreateGradientSums(pipe)  # As the trainer does before it traces.
  x = tf.random.stateless_normal(shape, [1, 2])

  @tf.function(autograph=False)
  def Step(x):
    return pipe.ForwardBackward(pipe.theta, x, lambda y: tf.reduce_mean(tf.square(y)),
                                loss_reduction='mean')

  def Run():  # With a step, as the trainer gives one (else the pipeline counts its calls).
    with py_utils.Context(step=tf.constant(0, tf.int64)):
      tf.nest.map_structure(lambda t: t.numpy(), Step(x))

  first = bench_utils.Seconds(Run)
  step = bench_utils.MedianSeconds(Run, config['steps'])
  traces = Step.experimental_get_tracing_count()
  graph = Step.get_concrete_function(x).graph
  nodes = len(graph.as_graph_def().node)
  actions = len(pipe.GetSchedule(shape[0]).steps)
  return dict(config, first_call_s=round(first, 2), step_s=round(step, 4), nodes=nodes,
              actions=actions, nodes_per_action=round(nodes / actions, 1), traces=traces,
              loops=steady_state.LoopsIn(graph))


_STAMP = re.compile(r'^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+)')


def _Stamp(line):
  """The seconds of an absl log line's time of day, or None."""
  match = _STAMP.match(line)
  if not match:
    return None
  t = datetime.datetime.strptime(match.group(2), '%H:%M:%S.%f')
  return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6


def _LineTime(lines, text):
  for line in lines:
    if text in line:
      return _Stamp(line)
  raise RuntimeError(f'The trainer logged no line with {text!r}:\n' + '\n'.join(lines[-30:]))


def _TrainerStart(model, micro_batches):
  """The trainer's seconds from its "Pipeline" line to the end of one step, and its peak
  host memory."""
  overrides = [] if micro_batches is None else [
      f'--model_params_override=task.stack.num_micro_batches : {micro_batches}']
  with tempfile.TemporaryDirectory() as logdir:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, '-m', 'lingvo_gpipe.runners.trainer', f'--model={model}',
         f'--logdir={logdir}', '--max_steps=1', '--logtostderr', *overrides],
        capture_output=True, text=True, timeout=FLAGS.timeout, check=False)
    wall = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  lines = proc.stderr.splitlines()
  if proc.returncode:
    raise RuntimeError(f'The trainer on {model} failed:\n' + '\n'.join(lines[-30:]))
  pipeline = _LineTime(lines, 'Pipeline ')
  traced = _LineTime(lines, 'Traced the training step')
  done = _LineTime(lines, 'Trained to step')
  return dict(model=model, micro_batches=micro_batches or 'own',
              trace_s=round(traced - pipeline, 1), first_step_s=round(done - pipeline, 1),
              wall_s=round(wall, 1),
              # ru_maxrss of the largest child so far: the trainer's own when it is the largest.
              peak_host_mb=round(peak / 1024) if peak > before else None)


_LOOP_SETTINGS = {'true': True, 'false': False, 'auto': 'auto'}


def _Grid():
  for k in map(int, FLAGS.stages):
    for m in map(int, FLAGS.micro_batches):
      for sched in FLAGS.schedules:
        for remat in FLAGS.remat:
          for loop in FLAGS.loop_steady_state:
            yield dict(stages=k, micro_batches=m, schedule=sched, remat=remat,
                       loop_steady_state=_LOOP_SETTINGS[loop], layers=FLAGS.layers,
                       width=FLAGS.width, hidden=FLAGS.hidden, steps=FLAGS.steps)


def main(argv):
  del argv
  if FLAGS.single:
    print(json.dumps(_RunOne(json.loads(FLAGS.single))))
    return
  grid = [c for c in _Grid() if c['layers'] >= c['stages'] * bench_utils.VIRTUAL_STAGES.get(
      c['schedule'], 1)]
  runs = [(model, m) for model in FLAGS.trainer_models
          for m in [None] + [int(x) for x in FLAGS.trainer_micro_batches]]
  results, trainer = [], []
  total = len(grid) + len(runs)
  for i, config in enumerate(grid):
    bench_utils.Progress(i + 1, total, f"K={config['stages']} M={config['micro_batches']} "
                         f"{config['schedule']} remat={config['remat']} "
                         f"loop={config['loop_steady_state']}")
    results.append(bench_utils.RunIsolated(__file__, config, timeout=FLAGS.timeout))
  for i, (model, m) in enumerate(runs):
    bench_utils.Progress(len(grid) + i + 1, total, f'trainer {model} M={m or "own"}')
    trainer.append(_TrainerStart(model, m))
  tables = []
  if results:
    tables.append(bench_utils.MarkdownTable(results, [
        ('K', lambda r: r['stages']), ('M', lambda r: r['micro_batches']),
        ('schedule', lambda r: r['schedule']), ('remat', lambda r: r['remat']),
        ('loop_steady_state', lambda r: r['loop_steady_state']),
        ('first call s', lambda r: r['first_call_s']), ('step s', lambda r: r['step_s']),
        ('nodes', lambda r: r['nodes']), ('actions', lambda r: r['actions']),
        ('nodes/action', lambda r: r['nodes_per_action']), ('loops', lambda r: r['loops']),
        ('traces', lambda r: r['traces'])]))
  if trainer:
    tables.append(bench_utils.MarkdownTable(trainer, [
        ('model', lambda r: r['model']), ('M', lambda r: r['micro_batches']),
        ('trace s', lambda r: r['trace_s']), ('first step s', lambda r: r['first_step_s']),
        ('peak host MB', lambda r: r['peak_host_mb'])]))
  bench_utils.Emit('\n\n'.join(tables), dict(steps=results, trainer=trainer), FLAGS.json_out,
                   notes=[f'Load average (1, 5, 15 min): {bench_utils.Load()}'])


if __name__ == '__main__':
  binaries.Run(main)
