r"""Pipeline speed-up across two worker processes, each on one core, against one core.

  python tools/cluster_benchmark.py                         # M in 1,2,4,8,16
  python tools/cluster_benchmark.py --micro_batches=8 --layers=4 --rows=1024
  python tools/cluster_benchmark.py --schedules=1f1b,zb_h1,zbv --micro_batches=4,8

Baseline: one process pinned to core 0 (taskset, one intra-op thread) trains
the whole model, a plain stack, on the global batch. Pipeline: two worker
processes (tools/local_cluster.py) pinned to cores 0 and 1, one intra-op
thread each, run the model's two stages as a PipeliningLayer; a client process
connects to them and only dispatches. Both make each step's batch where the
model starts (the pipeline: on worker 0) and train with plain SGD: forward,
backward and the update of every weight where it lives (the pipeline's loss
and last stage on worker 1). The client runs --steps_per_call steps per call
in a device-side loop, so it does not take part in every step.

The baseline runs before the first M and after each M, each run in its own
process, and each M is compared with the faster of the two baselines around it:
this machine's speed drifts by about 10% over minutes, and a baseline taken
far from the pipeline it is compared with moved the ratio by as much.

Schedules with two chunks per device (interleaved_1f1b, zbv) cut the model into
four cells. Reported per schedule and M: seconds per step (the best call: the machine is shared, and
other load only slows a run down; the median is in the JSON), examples per
second, its baseline, the speed-up over it, GPipe's ideal 2M/(M+1) for two
stages, and the speed-up's ratio to it; then the bubble of --bubble_steps
forward-backward steps with the pipeline's statistics on (the median), each
run right behind an unmeasured step as the timed steps are
(bench_utils.MeasuredStep), next to its simulation with the measured stage and
hand-over costs and the schedule's unit-cost bubble (F, B and W one unit each; fill-drain's is
1/(M+1)), and the costs the simulation took: each chunk's median F, B, W or BW
milliseconds and each boundary's median hand-over. Prints a markdown table,
then the JSON.
"""

import json
import os
import statistics
import time

from absl import flags
import bench_utils
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.runners import binaries
import local_cluster

FLAGS = flags.FLAGS
flags.DEFINE_integer('layers', 8, 'Residual feed-forward layers (Transformer FFN blocks).')
flags.DEFINE_integer('width', 256, 'Model width.')
flags.DEFINE_integer('hidden', 1024, 'Hidden width of each block.')
flags.DEFINE_integer('rows', 4096, 'Global batch (rows).')
bench_utils.DefineCounts('micro_batches', ['1', '2', '4', '8', '16'], 'M values.')
flags.DEFINE_list('schedules', ['gpipe'], 'Pipeline schedules (PipeliningLayer.Params().schedule).')
flags.DEFINE_enum('remat', 'never', ['always', 'except_last', 'never'],
                  "Re-materialization of the pipeline; 'never' does the baseline's work.")
flags.DEFINE_integer('worker_inter_op_threads', 2,
                     'Inter-op threads of the workers and the baseline process.')
flags.DEFINE_boolean('pin_workers', True,
                     'Pin worker i to core i (taskset). With --nopin_workers the workers keep '
                     'one intra-op thread each but the OS may run any of their threads on any '
                     'core.')
flags.DEFINE_integer('steps_per_call', 4, 'Training steps per client call.', lower_bound=1)
flags.DEFINE_integer('calls', 3, 'Timed calls per configuration.', lower_bound=1)
flags.DEFINE_integer('bubble_steps', 3,
                     'Measured steps per M (the median bubble is kept); 0: none.', lower_bound=0)
bench_utils.CheckChoices('schedules', named_schedules.SCHEDULE_NAMES)
bench_utils.DefineJsonOut()
flags.DEFINE_string('single', None, 'Internal: one measuring process (JSON config).')
flags.adopt_module_key_flags(bench_utils)  # Its Define* flags are this tool's.


def _Layers(config):
  return bench_utils.LayerParams(dict(config, model='mlp'))[0]


def _Loss(y):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.reduce_mean(tf.square(y))


def _StepsPerSecond(config, device, forward_backward, variables):
  """Times calls of steps_per_call SGD steps; returns (first call s, [s per step])."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from lingvo_gpipe.distribution import cluster as cluster_lib
  rows, width, n = config['rows'], config['width'], config['steps_per_call']
  with tf.device(device):
    counter = tf.Variable(0, dtype=tf.int64, trainable=False, name='counter')

  def Step(i, unused_loss):
    with tf.device(device):
      x = tf.random.stateless_normal([rows, width], tf.stack([counter.assign_add(1), i]))
    with cluster_lib.ColocatedWithInputs():
      loss, grads = forward_backward(x, _Loss)
      for grad, var in zip(grads, variables):
        with tf.device(var.device):
          var.assign_sub(1e-3 * grad)
    return i + 1, loss

  @tf.function(autograph=False)
  def Call():
    return tf.while_loop(lambda i, _: i < n, Step,
                         (tf.constant(0, tf.int64), tf.constant(0.0)))[1]

  start = time.perf_counter()
  Call().numpy()
  first = time.perf_counter() - start
  times = []
  for _ in range(config['calls']):
    start = time.perf_counter()
    Call().numpy()
    times.append((time.perf_counter() - start) / n)
  return first, times


def _Result(config, first, times, **extra):
  return dict(config, first_call_s=first, step_s=min(times), median_step_s=statistics.median(times),
              examples_per_s=config['rows'] / min(times), **extra)


def _Baseline(config):
  """The whole model, unpipelined, in this process on core 0 (as taskset -c 0 would)."""
  os.sched_setaffinity(0, {0})
  tf = bench_utils.SetUpDevices(1, intra_op_threads=1,
                                inter_op_threads=config['inter_op_threads'])
  from lingvo_gpipe import layers  # pylint: disable=g-import-not-at-top
  model = layers.SequentialLayer.Params().Set(name='model', sub=_Layers(config)).Instantiate()
  variables = model.trainable_variables

  def ForwardBackward(x, loss_fn):
    with tf.GradientTape() as tape:
      loss = loss_fn(model.FProp(model.theta, x))
    return loss, tape.gradient(loss, variables)

  return [_Result(config, *_StepsPerSecond(config, '/device:CPU:0', ForwardBackward, variables))]


def _Pipeline(config):
  """Two stages on the cluster's two workers with M micro-batches; this process only
  dispatches."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from lingvo_gpipe.distribution import cluster as cluster_lib
  from lingvo_gpipe.pipeline import gpipe  # pylint: disable=g-import-not-at-top
  cluster_lib.Connect(config['spec'], timeout_secs=120)
  devices = cluster_lib.PipelineDevices(2)
  v = bench_utils.VIRTUAL_STAGES.get(config['schedule'], 1)
  cells = gpipe.PartitionSequentialLayers(_Layers(config), 2 * v,
                                          tf.TensorShape([config['rows'], config['width']]))
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=config['micro_batches'],
      remat=config['remat'], devices=devices, schedule=config['schedule'],
      virtual_stages=v).Instantiate()

  def ForwardBackward(x, loss_fn):
    loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, loss_reduction='mean')
    return loss, tf.nest.flatten(grads)

  result = _Result(config, *_StepsPerSecond(config, devices[0], ForwardBackward,
                                            tf.nest.flatten(pipe.theta)))
  if config['bubble_steps']:
    result.update(_Bubble(config, devices[0], pipe))
  return [result]


def _Bubble(config, device, pipe):
  """Measured, simulated and theoretical bubble of forward-backward steps of `pipe`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from lingvo_gpipe.distribution import cluster as cluster_lib

  def Body():
    with tf.device(device):
      x = tf.random.stateless_normal([config['rows'], config['width']], [7, 8])
    with cluster_lib.ColocatedWithInputs():
      return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')

  summary = bench_utils.MeasureBubble(bench_utils.MeasuredStep(tf, Body), config['bubble_steps'])
  return dict(bubble=summary['bubble_fraction'], bubble_simulated=summary['simulated_bubble'],
              bubble_theory=summary['theoretical_bubble'], chunk_costs=summary['chunk_costs'],
              hand_over_times=summary['hand_over_times'])


def _Config(**extra):
  return dict(layers=FLAGS.layers, width=FLAGS.width, hidden=FLAGS.hidden, rows=FLAGS.rows,
              remat=FLAGS.remat, inter_op_threads=FLAGS.worker_inter_op_threads,
              steps_per_call=FLAGS.steps_per_call, calls=FLAGS.calls,
              bubble_steps=FLAGS.bubble_steps, **extra)


def _Table(pipelines):
  def Speedup(p):
    return p['baseline_s'] / p['step_s']

  def Ideal(p):
    return 2 * p['micro_batches'] / (p['micro_batches'] + 1)

  def Bubble(key):
    return lambda p: f'{p[key]:.3f}' if key in p else '-'

  def Costs(p):
    """Median ms of each action kind that ran, per chunk, and of the hand-overs."""
    if 'chunk_costs' not in p:
      return '-'
    kinds = [k for k, costs in p['chunk_costs'].items() if any(costs)]
    chunks = ' / '.join(' '.join(f'{k} {p["chunk_costs"][k][c] * 1e3:.0f}' for k in kinds)
                        for c in range(len(p['chunk_costs']['F'])))
    return chunks + ' / hand-over ' + ' '.join(f'{t * 1e3:.1f}' for t in p['hand_over_times'])

  return bench_utils.MarkdownTable(pipelines, [
      ('schedule', lambda p: p['schedule']),
      ('M', lambda p: p['micro_batches']),
      ('pipeline s/step', lambda p: f"{p['step_s']:.3f}"),
      ('baseline s/step', lambda p: f"{p['baseline_s']:.3f}"),
      ('pipeline ex/s', lambda p: f"{p['examples_per_s']:.0f}"),
      ('baseline ex/s', lambda p: f"{p['rows'] / p['baseline_s']:.0f}"),
      ('speed-up', lambda p: f'{Speedup(p):.2f}'),
      ('ideal 2M/(M+1)', lambda p: f'{Ideal(p):.2f}'),
      ('speed-up / ideal', lambda p: f'{Speedup(p) / Ideal(p):.2f}'),
      ('bubble measured', Bubble('bubble')), ('simulated', Bubble('bubble_simulated')),
      ('unit-cost', Bubble('bubble_theory')),
      ('ms per chunk (median action)', Costs)])


def _Interleaved(spec, cases):
  """(baselines, pipelines): a baseline, then each (schedule, M) followed by a baseline, each
  in its own process (the idle workers wait meanwhile); each gets the faster baseline around
  it."""
  script = os.path.abspath(__file__)
  total = 1 + 2 * len(cases)
  baselines = bench_utils.RunIsolated(script, _Config(role='baseline'))
  bench_utils.Progress(1, total, f"baseline: {baselines[-1]['step_s']:.3f} s/step")
  pipelines = []
  for i, (sched, m) in enumerate(cases):
    (pipeline,) = bench_utils.RunIsolated(script, _Config(role='client', spec=spec,
                                                          schedule=sched, micro_batches=m))
    bench_utils.Progress(2 * i + 2, total,
                         f"pipeline {sched} M={m}: {pipeline['step_s']:.3f} s/step")
    baselines += bench_utils.RunIsolated(script, _Config(role='baseline'))
    bench_utils.Progress(2 * i + 3, total, f"baseline: {baselines[-1]['step_s']:.3f} s/step")
    pipeline['baseline_s'] = min(baselines[-2]['step_s'], baselines[-1]['step_s'])
    pipelines.append(pipeline)
  return baselines, pipelines


def main(argv):
  del argv
  if FLAGS.single:
    config = json.loads(FLAGS.single)
    results = _Baseline(config) if config['role'] == 'baseline' else _Pipeline(config)
    print(json.dumps(results))
    return
  load_before = bench_utils.Load()
  cpus = [0, 1] if FLAGS.pin_workers else None
  with local_cluster.LocalCluster(2, cpus=cpus, intra_op_threads=1,
                                  inter_op_threads=FLAGS.worker_inter_op_threads) as cluster:
    baselines, pipelines = _Interleaved(cluster.spec, [
        (sched, int(m)) for sched in FLAGS.schedules for m in FLAGS.micro_batches])
  results = dict(baselines=baselines, pipelines=pipelines, pinned_workers=FLAGS.pin_workers,
                 load_before=load_before, load_after=bench_utils.Load())
  bench_utils.Emit(_Table(pipelines), results, FLAGS.json_out, notes=[
      f'Workers pinned to cores 0 and 1: {FLAGS.pin_workers}.',
      f'Load average (1, 5, 15 min) before {load_before}, after {results["load_after"]}.'])


if __name__ == '__main__':
  binaries.Run(main)
