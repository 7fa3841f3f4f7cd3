r"""Peak memory vs M and K against GPipe's O(N + L/K x N/M), on this machine's allocator.

GPipe's bound is per device: a stage keeps its input for the batch (N) and,
while it re-materializes one micro-batch, the activations of its L/K layers
for N/M rows. Logical CPU devices share one allocator, so the tool runs one op
at a time (--inter_op_threads=1): then one stage computes at a time and the
step's peak over all devices is what the K stages keep plus one re-materialized
cell, alpha + beta x K + gamma / (K x M) (beta: a stage's boundary activations
for the batch, gamma / (K x M): L/K layers' activations of N/M rows, alpha:
the rest). It measures the peak (allocator peak above the live set before the
step) along an M sweep at fixed K and a K sweep at fixed M, fits that form by
least squares and prints each point against the fit, with the plain model for
scale.

With --remat_every, it also sweeps N of cell_remat_policy='every_N' (a
checkpoint every N layers inside each cell; lingvo_gpipe/layers/remat.py) at the K values of
--remat_stages and M=--fixed_micro_batches: the peak and the step time against
the same K and M without a policy. Those points are not in the fit.

  python tools/memory_curves.py                 # a few minutes
  python tools/memory_curves.py --layers=16 --width=256 --hidden=1024 --rows=8192
  python tools/memory_curves.py --layers=16 --remat_every=1,2,4,8

With --schedules it compares schedules instead, at K=--fixed_stages over
--micro_batches: each run's peak next to what its schedule holds (summed over
devices: micro-batch chunks between forward and input gradient, and pending
weight gradients), so a schedule whose count is flat in M should measure flat:

  python tools/memory_curves.py --schedules=gpipe,1f1b,zb_h1,zb_h2,zbv --remat=never \
      --fixed_stages=4 --micro_batches=8,16,32 --micro_batch_rows=128

(--micro_batch_rows fixes the micro-batch, so the batch grows with M: what a schedule
holds per device is then micro-batches of one size.) With --per_device each stage runs in a
worker process of its own, one device per allocator, and the table shows each device's peak
next to what the schedule holds there at once. The batch is made on the client, as a host
would hold it, so that the first device's peak is what the pipeline holds there (the
micro-batches reach it one or two at a time):

  python tools/memory_curves.py --schedules=1f1b,zb_h1 --remat=never --fixed_stages=4 \
      --micro_batches=8,16,32 --micro_batch_rows=256 --per_device
"""

import json
import time

from absl import flags
import bench_utils
from lingvo_gpipe.insight import simulator
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import schedule as schedule_lib
from lingvo_gpipe.runners import binaries
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_string('model', 'mlp', "'mlp' (activation-heavy residual MLP), 'transformer', or a "
                    'registry key.')
flags.DEFINE_integer('layers', 8, 'Layers L of the built-in model.')
flags.DEFINE_integer('width', 128, 'Width of the built-in model.')
flags.DEFINE_integer('hidden', 512, 'Feed-forward hidden width of the built-in model.')
flags.DEFINE_integer('rows', 4096, 'Batch rows N (sequences for the Transformer).')
flags.DEFINE_integer('seq_len', 64, 'Sequence length of the built-in Transformer.')
flags.DEFINE_integer('fixed_stages', 2, 'K of the M sweep.')
bench_utils.DefineCounts('micro_batches', ['1', '4', '16', '32'], 'M values of the M sweep.')
flags.DEFINE_integer('fixed_micro_batches', 16, 'M of the K sweep.')
bench_utils.DefineCounts('stages', ['1', '2', '4'], 'K values of the K sweep.')
flags.DEFINE_enum('schedule', 'gpipe', list(named_schedules.SCHEDULE_NAMES), 'Pipeline schedule.')
flags.DEFINE_list('schedules', None, 'Compare these schedules over --micro_batches at '
                  '--fixed_stages instead of the K and M sweeps.')
flags.DEFINE_integer('micro_batch_rows', None, 'With --schedules: rows per micro-batch (the '
                     'batch is M times this) instead of --rows.')
flags.DEFINE_enum('remat', 'always', ['always', 'except_last', 'never'], 'Re-materialization.')
bench_utils.DefineCounts('remat_every', [], "N values of a sweep of cell_remat_policy='every_N'; "
                  'empty: no such sweep.')
bench_utils.DefineCounts('remat_stages', ['1', '2'], 'K values of the every_N sweep.')
flags.DEFINE_integer('steps', 2, 'Steps measured per point (the largest peak and the median '
                     'time are kept); with --schedules, those of the largest M, and a smaller '
                     'M runs as many micro-batches.', lower_bound=1)
bench_utils.CheckChoices('schedules', named_schedules.SCHEDULE_NAMES)
flags.DEFINE_integer('inter_op_threads', 1, 'Ops run at once; 1 makes the fit\'s premise hold.')
flags.DEFINE_bool('per_device', False, 'With --schedules: run each point on K worker '
                  'processes (tools/local_cluster.py), each one device with its own allocator, '
                  'and report the fullest device\'s peak (and each device\'s) instead of the '
                  'peak of K logical devices sharing one.')
flags.register_validator(
    'schedules', lambda names: not names or set(names) <= set(named_schedules.SCHEDULE_NAMES),
    f'--schedules takes names of {list(named_schedules.SCHEDULE_NAMES)}.')
flags.register_multi_flags_validator(
    ['per_device', 'schedules', 'model'],
    lambda f: not f['per_device'] or (f['schedules'] and f['model'] in ('mlp', 'transformer')),
    "--per_device needs --schedules and a built-in model (--model=mlp or transformer): it "
    "places the built-in pipeline's stages on worker processes.")
bench_utils.DefineJsonOut()
flags.DEFINE_string('single', None, 'Internal: run one configuration (JSON) and print it.')
flags.adopt_module_key_flags(bench_utils)  # Its Define* flags are this tool's.


def _RunOnWorkers(config):
  """The point's step on K worker processes, one op at a time each, the batch on this client;
  each worker logs its allocator (trainer --worker_memory_log_secs): per device, its peak
  over the steps after the first above what it holds after them (weights, gradient sums)."""
  import local_cluster  # pylint: disable=g-import-not-at-top
  tf = bench_utils.SetUpDevices(1)
  # pylint: disable-next=g-import-not-at-top
  from lingvo_gpipe.distribution import cluster as cluster_lib
  from lingvo_gpipe.foundation import memory_stats  # pylint: disable=g-import-not-at-top
  k, interval = config['stages'], 0.05
  with local_cluster.LocalCluster(k, intra_op_threads=1,
                                  inter_op_threads=config['inter_op_threads'],
                                  worker_args=[f'--worker_memory_log_secs={interval}']) as workers:
    cluster_lib.Connect(workers.spec, timeout_secs=120)
    step = bench_utils.BuildStep(tf, config, cluster_lib.PipelineDevices(k),
                                 input_device='/job:localhost/replica:0/task:0/device:CPU:0')
    step.run()  # Traced: it allocates once what later steps do not (up to 2x on the last device).
    time.sleep(3 * interval)  # Lines logged from `start` on cover the measured steps only.
    start = time.time()
    for _ in range(config['steps']):
      step.run()
    time.sleep(10 * interval)  # Each worker logs what it holds now.
    logged = [memory_stats.LoggedSince(workers.Log(t), start) for t in range(k)]
  device_peaks = [(peak - current) / 2**20 for current, peak in logged]
  return dict(config, peak_mb=max(device_peaks), device_peaks_mb=device_peaks,
              params=step.params)


def _RunOne(config):
  if config.get('per_device'):
    return _RunOnWorkers(config)
  tf = bench_utils.SetUpDevices(config['stages'], inter_op_threads=config['inter_op_threads'])
  from lingvo_gpipe.foundation import memory_stats  # pylint: disable=g-import-not-at-top
  step = bench_utils.BuildStep(tf, config)
  step.run()  # Trace and warm up.
  peaks, seconds = [], []
  for _ in range(config['steps']):
    peaks.append(memory_stats.PeakBytes(step.run)[1])
    seconds.append(bench_utils.Seconds(step.run))
  return dict(config, peak_mb=max(peaks) / 2**20, step_s=float(np.median(seconds)),
              params=step.params)


def _Points():
  base = dict(bench_utils.FlagsConfig(FLAGS), schedule=FLAGS.schedule, remat=FLAGS.remat,
              path='forward_backward', steps=FLAGS.steps,
              inter_op_threads=FLAGS.inter_op_threads, remat_policy='none')
  sizes = [(FLAGS.fixed_stages, int(m)) for m in FLAGS.micro_batches]
  sizes += [(int(k), FLAGS.fixed_micro_batches) for k in FLAGS.stages
            if (int(k), FLAGS.fixed_micro_batches) not in sizes]
  points = [dict(base, stages=0, micro_batches=1, sweep='plain')] + [
      dict(base, stages=k, micro_batches=m,
           sweep='M' if k == FLAGS.fixed_stages else 'K') for k, m in sizes]
  for k in map(int, FLAGS.remat_stages if FLAGS.remat_every else []):
    if (k, FLAGS.fixed_micro_batches) not in sizes:
      points.append(dict(base, stages=k, micro_batches=FLAGS.fixed_micro_batches, sweep='N'))
    points += [dict(base, stages=k, micro_batches=FLAGS.fixed_micro_batches, sweep='N',
                    remat_policy=f'every_{n}') for n in FLAGS.remat_every]
  return points


def _AgainstNone(results):
  """Sets each policy point's peak and time over the same K and M without a policy."""
  none = {(r['stages'], r['micro_batches']): r for r in results
          if r['remat_policy'] == 'none'}
  for r in results:
    if r['remat_policy'] != 'none':
      ref = none[(r['stages'], r['micro_batches'])]
      r['peak_x_none'] = r['peak_mb'] / ref['peak_mb']
      r['time_x_none'] = r['step_s'] / ref['step_s']


def Fit(results):
  """Least-squares (alpha, beta, gamma) of peak_mb = alpha + beta K + gamma / (K M)."""
  a = np.array([[1.0, r['stages'], 1.0 / (r['stages'] * r['micro_batches'])] for r in results])
  b = np.array([r['peak_mb'] for r in results])
  coefficients, *_ = np.linalg.lstsq(a, b, rcond=None)
  return coefficients, a @ coefficients


def _Held(sched, k, m):
  """(micro-batch chunks held between F and B, pending Ws, both at once), each a device's
  most, summed over the K devices. The devices share this machine's allocator: their
  peaks need not coincide, so the step's peak may stay below the sum. Then each device's
  most at once."""
  v = bench_utils.VIRTUAL_STAGES.get(sched, 1)
  s = schedule_lib.Schedule(sched, k, m, v)
  at_once = simulator.Simulate(simulator.Orders(sched, k, m, v), activation_bytes=1,
                               weight_grad_bytes=1).peak_activation_bytes
  return (sum(s.MaxInFlight(d) for d in range(k)),
          sum(s.MaxPendingWeightGrads(d) for d in range(k)), int(at_once.sum()),
          [int(x) for x in at_once])


def _ScheduleSweep(base):
  """Each schedule over --micro_batches at K=--fixed_stages, against what it holds."""
  k = FLAGS.fixed_stages

  def Rows(m):
    return FLAGS.micro_batch_rows * int(m) if FLAGS.micro_batch_rows else base['rows']

  # Every point runs the micro-batches of --steps steps at the largest M: how the devices'
  # peaks line up varies from step to step, and each micro-batch is another chance of the
  # worst line-up, so fewer steps would understate a smaller M's peak.
  most = max(map(int, FLAGS.micro_batches))

  def Steps(m):
    return -(-base['steps'] * most // int(m))

  # The plain model on the first point's batch.
  points = [dict(base, stages=0, micro_batches=1, schedule='gpipe', sweep='plain',
                 rows=Rows(FLAGS.micro_batches[0]))] + [
      dict(base, stages=k, micro_batches=int(m), schedule=sched, sweep='schedule', rows=Rows(m),
           per_device=FLAGS.per_device, steps=Steps(m))
      for sched in FLAGS.schedules for m in FLAGS.micro_batches]
  results = []
  for i, config in enumerate(points, 1):
    results.append(bench_utils.RunIsolated(__file__, config))
    bench_utils.Progress(i, len(points), f"{config['schedule']} M={config['micro_batches']}: "
                         f"peak {results[-1]['peak_mb']:.2f} MB")
  plain = results[0]
  for r in results[1:]:
    r['held'], r['pending_w'], r['at_once'], r['device_at_once'] = _Held(
        r['schedule'], k, r['micro_batches'])
    first = next(q for q in results[1:] if q['schedule'] == r['schedule'])
    r['vs_first_m'] = r['peak_mb'] / first['peak_mb']
  columns = [('schedule', lambda r: r['schedule']), ('M', lambda r: r['micro_batches']),
             ('fullest device peak MB' if FLAGS.per_device else 'peak MB',
              lambda r: f"{r['peak_mb']:.2f}"),
             ('rows', lambda r: r['rows']), ('steps', lambda r: r['steps']),
             (f'x M={FLAGS.micro_batches[0]}', lambda r: f"{r['vs_first_m']:.2f}")]
  if FLAGS.per_device:
    columns += [('each device MB', lambda r: ' / '.join(f'{x:.2f}' for x in r['device_peaks_mb'])),
                ('held + pending at once, each device',
                 lambda r: ' / '.join(map(str, r['device_at_once'])))]
  else:
    columns += [('chunks held (sum over devices)', lambda r: r['held']),
                ('pending W', lambda r: r['pending_w']),
                ('held + pending at once', lambda r: r['at_once'])]
  table = bench_utils.MarkdownTable(results[1:], columns)
  rows = f'{FLAGS.micro_batch_rows} x M' if FLAGS.micro_batch_rows else FLAGS.rows
  notes = [f"{FLAGS.model}: L={FLAGS.layers}, N={rows}, K={k}, remat {FLAGS.remat}; "
           f"plain model on {plain['rows']} rows {plain['peak_mb']:.1f} MB; load average before "
           f"{base['load']}, after {bench_utils.Load()}"]
  bench_utils.Emit(table, dict(points=results), FLAGS.json_out, notes)


def main(argv):
  del argv
  if FLAGS.single:
    print(json.dumps(_RunOne(json.loads(FLAGS.single))))
    return
  if FLAGS.schedules:
    _ScheduleSweep(dict(bench_utils.FlagsConfig(FLAGS), remat=FLAGS.remat,
                        path='forward_backward', steps=FLAGS.steps,
                        inter_op_threads=FLAGS.inter_op_threads, load=bench_utils.Load()))
    return
  points = _Points()
  load_before = bench_utils.Load()
  results = bench_utils.RunPoints(__file__, points, lambda c, r: (
      f"K={c['stages']} M={c['micro_batches']} {c['remat_policy']}: peak {r['peak_mb']:.1f} MB, "
      f"{r['step_s']:.3g} s"))
  plain = results[0]
  pipelined = [r for r in results[1:] if r['sweep'] != 'N']
  (alpha, beta, gamma), fitted = Fit(pipelined)
  for r, f in zip(pipelined, fitted):
    r['fit_mb'] = float(f)
  residual = max(abs(r['peak_mb'] - r['fit_mb']) / r['peak_mb'] for r in pipelined)
  _AgainstNone(results[1:])
  table = bench_utils.MarkdownTable(results, [
      ('sweep', lambda r: r['sweep']), ('K', lambda r: r['stages'] or 'plain'),
      ('M', lambda r: r['micro_batches']), ('policy', lambda r: r['remat_policy']),
      ('peak MB', lambda r: f"{r['peak_mb']:.1f}"),
      ('x plain', lambda r: f"{r['peak_mb'] / plain['peak_mb']:.3f}"),
      ('fit MB', lambda r: f"{r['fit_mb']:.1f}" if 'fit_mb' in r else '-'),
      ('fit error', lambda r: (f"{(r['fit_mb'] - r['peak_mb']) / r['peak_mb']:+.1%}"
                               if 'fit_mb' in r else '-')),
      ('step s', lambda r: f"{r['step_s']:.3g}"),
      ('peak, time x none', lambda r: (f"{r['peak_x_none']:.2f}, {r['time_x_none']:.2f}"
                                       if 'peak_x_none' in r else '-'))])
  notes = [f"{FLAGS.model}: L={FLAGS.layers}, N={FLAGS.rows}, {FLAGS.schedule}, remat "
           f"{FLAGS.remat}; load average (1, 5, 15 min) before {load_before}, after "
           f'{bench_utils.Load()}',
           f'Fit over all K devices: peak MB = {alpha:.1f} + {beta:.1f} x K + {gamma:.1f} / '
           f'(K x M) (largest error {residual:.1%}): per device O(N + L/K x N/M), with '
           f'{beta:.1f} MB of boundary activations per stage and {gamma:.1f} / (K x M) MB '
           'of re-materialized activations.']
  summary = dict(points=results, fit=dict(alpha_mb=alpha, beta_mb=beta, gamma_mb=gamma,
                                          max_relative_error=residual))
  bench_utils.Emit(table, summary, FLAGS.json_out, notes)


if __name__ == '__main__':
  binaries.Run(main)
