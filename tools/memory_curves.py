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

  python tools/memory_curves.py                 # a few minutes
  python tools/memory_curves.py --layers=16 --width=256 --hidden=1024 --rows=8192
"""

import json

from absl import flags
import bench_utils
from lingvo_gpipe import binaries
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
flags.DEFINE_list('micro_batches', ['1', '4', '16', '32'], 'M values of the M sweep.')
flags.DEFINE_integer('fixed_micro_batches', 16, 'M of the K sweep.')
flags.DEFINE_list('stages', ['1', '2', '4'], 'K values of the K sweep.')
flags.DEFINE_enum('schedule', 'gpipe', ['gpipe', '1f1b'], 'Pipeline schedule.')
flags.DEFINE_enum('remat', 'always', ['always', 'except_last', 'never'], 'Re-materialization.')
flags.DEFINE_integer('steps', 2, 'Steps measured per point (the largest peak is kept).')
flags.DEFINE_integer('inter_op_threads', 1, 'Ops run at once; 1 makes the fit\'s premise hold.')
flags.DEFINE_string('json_out', None, 'Also write the results JSON to this file.')
flags.DEFINE_string('single', None, 'Internal: run one configuration (JSON) and print it.')


def _RunOne(config):
  tf = bench_utils.SetUpDevices(config['stages'], inter_op_threads=config['inter_op_threads'])
  from lingvo_gpipe.core import memory_stats  # pylint: disable=g-import-not-at-top
  step = bench_utils.BuildStep(tf, config)
  step.run()  # Trace and warm up.
  peak = max(memory_stats.PeakBytes(step.run)[1] for _ in range(config['steps']))
  return dict(config, peak_mb=peak / 2**20, params=step.params)


def _Points():
  base = dict(bench_utils.FlagsConfig(FLAGS), schedule=FLAGS.schedule, remat=FLAGS.remat,
              path='forward_backward', steps=FLAGS.steps,
              inter_op_threads=FLAGS.inter_op_threads)
  sizes = [(FLAGS.fixed_stages, int(m)) for m in FLAGS.micro_batches]
  sizes += [(int(k), FLAGS.fixed_micro_batches) for k in FLAGS.stages
            if (int(k), FLAGS.fixed_micro_batches) not in sizes]
  return [dict(base, stages=0, micro_batches=1, sweep='plain')] + [
      dict(base, stages=k, micro_batches=m,
           sweep='M' if k == FLAGS.fixed_stages else 'K') for k, m in sizes]


def Fit(results):
  """Least-squares (alpha, beta, gamma) of peak_mb = alpha + beta K + gamma / (K M)."""
  a = np.array([[1.0, r['stages'], 1.0 / (r['stages'] * r['micro_batches'])] for r in results])
  b = np.array([r['peak_mb'] for r in results])
  coefficients, *_ = np.linalg.lstsq(a, b, rcond=None)
  return coefficients, a @ coefficients


def main(argv):
  del argv
  if FLAGS.single:
    print(json.dumps(_RunOne(json.loads(FLAGS.single))))
    return
  points = _Points()
  load_before = bench_utils.Load()
  results = []
  for i, config in enumerate(points, 1):
    results.append(bench_utils.RunIsolated(__file__, config))
    bench_utils.Progress(i, len(points), f"K={config['stages']} M={config['micro_batches']}: "
                         f"peak {results[-1]['peak_mb']:.1f} MB")
  plain, pipelined = results[0], results[1:]
  (alpha, beta, gamma), fitted = Fit(pipelined)
  for r, f in zip(pipelined, fitted):
    r['fit_mb'] = float(f)
  residual = max(abs(r['peak_mb'] - r['fit_mb']) / r['peak_mb'] for r in pipelined)
  table = bench_utils.MarkdownTable(results, [
      ('sweep', lambda r: r['sweep']), ('K', lambda r: r['stages'] or 'plain'),
      ('M', lambda r: r['micro_batches']), ('peak MB', lambda r: f"{r['peak_mb']:.1f}"),
      ('x plain', lambda r: f"{r['peak_mb'] / plain['peak_mb']:.3f}"),
      ('fit MB', lambda r: f"{r['fit_mb']:.1f}" if 'fit_mb' in r else '-'),
      ('fit error', lambda r: (f"{(r['fit_mb'] - r['peak_mb']) / r['peak_mb']:+.1%}"
                               if 'fit_mb' in r else '-'))])
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
