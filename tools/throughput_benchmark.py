r"""GPipe Table 2 on this machine: training throughput vs K and M, with the measured bubble.

Each (K, M) point runs in its own process on K logical CPU devices. By default
every op is single-threaded (--intra_op_threads=1) and --inter_op_threads is
the number of cores, so a stage behaves like one device of one core: with K no
larger than the cores, stages do not share a core. Beside each point's
throughput (examples per second; x plain divides by the unpipelined model's)
it prints the bubble of a step (run behind an unmeasured one, as in a
training loop: bench_utils.MeasuredStep) three ways (pipeline_stats):

  measured   idle share of K devices x the step window, from the steps' timestamps;
  simulated  the schedule simulated with this run's median forward and backward
             time per stage and hand-over time per boundary (what the schedule
             implies for these costs);
  theory     unit-cost (K-1)/(M+K-1).

  python tools/throughput_benchmark.py                       # a few minutes
  python tools/throughput_benchmark.py --stages=2,4 --micro_batches=1,4,32 \
      --model=lm.synthetic.GPipeTransformerLmBig --trace_dir=/tmp/traces

--trace_dir writes each point's Chrome trace (open in ui.perfetto.dev).
The 2-process cluster points come from tools/cluster_benchmark.py (another tool).
"""

import json
import os

from absl import flags
import bench_utils
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.runners import binaries

FLAGS = flags.FLAGS
flags.DEFINE_string('model', 'transformer', "'mlp', 'transformer' or a registry key (e.g. "
                    'lm.synthetic.GPipeTransformerLmBig; its stack is cut into K stages).')
flags.DEFINE_integer('layers', 8, 'Layers of the built-in model.')
flags.DEFINE_integer('width', 128, 'Width of the built-in model.')
flags.DEFINE_integer('hidden', 512, 'Feed-forward hidden width of the built-in model.')
flags.DEFINE_integer('rows', 16, 'Batch rows (sequences) of the built-in model.')
flags.DEFINE_integer('seq_len', 64, 'Sequence length of the built-in Transformer.')
bench_utils.DefineCounts('stages', ['2', '4'], 'K values.')
bench_utils.DefineCounts('micro_batches', ['1', '8'], 'M values.')
flags.DEFINE_enum('schedule', 'gpipe', list(named_schedules.SCHEDULE_NAMES), 'Pipeline schedule.')
flags.DEFINE_enum('remat', 'always', ['always', 'except_last', 'never'], 'Re-materialization.')
flags.DEFINE_integer('steps', 3, 'Timed steps per point (median).', lower_bound=1)
flags.DEFINE_integer('bubble_steps', 3, 'Measured steps per point (the median bubble is kept).',
                     lower_bound=0)
flags.DEFINE_integer('intra_op_threads', 1, 'Threads of one op (0: TensorFlow default).')
flags.DEFINE_integer('inter_op_threads', os.cpu_count() or 2,
                     'Ops run at once (0: TensorFlow default).')
flags.DEFINE_string('trace_dir', None, 'Write each point\'s Chrome trace JSON here.')
bench_utils.DefineJsonOut()
flags.DEFINE_string('single', None, 'Internal: run one configuration (JSON) and print it.')
bench_utils.RefuseBuiltInSizes()
flags.adopt_module_key_flags(bench_utils)  # Its Define* flags are this tool's.


def _RunOne(config):
  tf = bench_utils.SetUpDevices(config['stages'], config['intra_op_threads'],
                                config['inter_op_threads'])
  step = bench_utils.BuildStep(tf, config)
  trace_s = bench_utils.Seconds(step.run)
  step_s = bench_utils.MedianSeconds(step.run, config['steps'])
  result = dict(config, params=step.params, trace_s=trace_s, step_s=step_s,
                examples_per_s=step.rows / step_s)
  if step.measured is not None:
    summary = bench_utils.MeasureBubble(step.measured, config['bubble_steps'])
    result.update(bubble=summary['bubble_fraction'],
                  bubble_simulated=summary['simulated_bubble'],
                  bubble_theory=summary['theoretical_bubble'],
                  measured_step_s=summary['step_time'], devices=summary['devices'])
    if config['trace_dir']:
      from lingvo_gpipe.insight import pipeline_stats  # pylint: disable=g-import-not-at-top
      pipeline_stats.WriteChromeTrace(
          os.path.join(config['trace_dir'],
                       f"trace_K{config['stages']}_M{config['micro_batches']}.json"),
          step.measured())
  return result


def _Points():
  base = dict(bench_utils.FlagsConfig(FLAGS), schedule=FLAGS.schedule, remat=FLAGS.remat,
              path='forward_backward', steps=FLAGS.steps,
              bubble_steps=FLAGS.bubble_steps, intra_op_threads=FLAGS.intra_op_threads,
              inter_op_threads=FLAGS.inter_op_threads, trace_dir=FLAGS.trace_dir)
  points = [dict(base, stages=0, micro_batches=1)]
  points += [dict(base, stages=int(k), micro_batches=int(m))
             for k in FLAGS.stages for m in FLAGS.micro_batches]
  return points


def _Table(results):
  plain = results[0]['examples_per_s']

  def Bubble(key):
    return lambda r: f'{r[key]:.3f}' if key in r else '-'

  return bench_utils.MarkdownTable(results, [
      ('K', lambda r: r['stages'] or 'plain'), ('M', lambda r: r['micro_batches']),
      ('examples/s', lambda r: f"{r['examples_per_s']:.1f}"),
      ('x plain', lambda r: f"{r['examples_per_s'] / plain:.2f}"),
      ('step s', lambda r: f"{r['step_s']:.3f}"),
      ('bubble measured', Bubble('bubble')), ('simulated', Bubble('bubble_simulated')),
      ('theory', Bubble('bubble_theory')),
      ('measured - simulated', lambda r: (f"{r['bubble'] - r['bubble_simulated']:+.3f}"
                                          if 'bubble' in r else '-'))])


def main(argv):
  del argv
  if FLAGS.single:
    print(json.dumps(_RunOne(json.loads(FLAGS.single))))
    return
  if FLAGS.trace_dir:
    os.makedirs(FLAGS.trace_dir, exist_ok=True)
  points = _Points()
  load_before = bench_utils.Load()
  results = []
  for i, config in enumerate(points, 1):
    result = bench_utils.RunIsolated(__file__, config)
    results.append(result)
    bubble = (f", bubble {result['bubble']:.3f} (simulated {result['bubble_simulated']:.3f})"
              if 'bubble' in result else '')
    bench_utils.Progress(i, len(points), f"K={result['stages']} M={result['micro_batches']}: "
                         f"{result['examples_per_s']:.1f} examples/s{bubble}")
  notes = [f'{FLAGS.model} ({results[0]["params"]} parameters), {FLAGS.schedule}, remat '
           f'{FLAGS.remat}; intra-op threads {FLAGS.intra_op_threads}, inter-op threads '
           f'{FLAGS.inter_op_threads}, {os.cpu_count()} cores; load average (1, 5, 15 min) '
           f'before {load_before}, after {bench_utils.Load()}']
  bench_utils.Emit(_Table(results), results, FLAGS.json_out, notes)


if __name__ == '__main__':
  binaries.Run(main)
