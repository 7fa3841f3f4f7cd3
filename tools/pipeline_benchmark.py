r"""Peak memory and step time of a pipelined stack against the plain model.

Each configuration runs in its own process so that each allocator peak is its
own. The driver prints one progress line per configuration, then a markdown
table and the JSON of all results.

  # The README's table: a residual MLP of 16 layers, width 256, hidden 1024, 8192 rows.
  python tools/pipeline_benchmark.py --preset=anchors
  # A quick look (a few minutes):
  python tools/pipeline_benchmark.py --stages=1,4 --micro_batches=1,8,32 --remat=always

Columns: peak_mb is the allocator peak (tf.config.experimental.get_memory_info)
above the live set before the step, step_s the median step time, trace_s the
time to trace and run the first step; x_plain columns divide by the plain run
(the plain model has stages 0 in the JSON).
"""

import json
import statistics

from absl import flags
import bench_utils
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.runners import binaries

PRESETS = {
    'anchors': dict(model='mlp', layers=16, width=256, hidden=1024, rows=8192),
    'small': dict(model='mlp', layers=8, width=128, hidden=512, rows=2048),
}

FLAGS = flags.FLAGS
flags.DEFINE_enum('preset', 'small', list(PRESETS), 'Stack size preset; flags below override.')
flags.DEFINE_string('model', None, "'mlp' (residual MLP), 'transformer', or a registry key "
                    '(e.g. lm.synthetic.GPipeTransformerLmBig): its task on a batch of its input, '
                    'its stack cut into K stages.')
flags.DEFINE_integer('layers', None, 'Number of layers.')
flags.DEFINE_integer('width', None, 'Model width.')
flags.DEFINE_integer('hidden', None, 'Hidden (feed-forward) width.')
flags.DEFINE_integer('rows', None, 'Batch rows (sequences for the Transformer).')
flags.DEFINE_integer('seq_len', 64, 'Sequence length of the Transformer.')
bench_utils.DefineCounts('stages', ['1', '2', '4'], 'K values.')
bench_utils.DefineCounts('micro_batches', ['1', '4', '8', '16', '32'], 'M values.')
flags.DEFINE_list('remat', ['always', 'except_last', 'never'], 'Re-materialization modes.')
flags.DEFINE_list('schedules', ['gpipe', '1f1b'],
                  'Schedules (PipeliningLayer.Params().schedule: gpipe, 1f1b, interleaved_1f1b, '
                  'zb_h1, zb_h2, zbv).')
flags.DEFINE_enum('path', 'fprop', ['fprop', 'forward_backward'],
                  'FProp under tf.GradientTape (a model\'s train step) or ForwardBackward. '
                  "Every schedule but 'gpipe' runs ForwardBackward.")
flags.DEFINE_integer('steps', 5, 'Timed steps per configuration (median reported).',
                     lower_bound=1)
bench_utils.CheckChoices('schedules', named_schedules.SCHEDULE_NAMES)
bench_utils.CheckChoices('remat', ('always', 'except_last', 'never'))
bench_utils.DefineJsonOut()
flags.DEFINE_string('single', None, 'Internal: run one configuration (JSON) and print it.')
flags.adopt_module_key_flags(bench_utils)  # Its Define* flags are this tool's.


def _Config(**overrides):
  config = dict(PRESETS[FLAGS.preset], seq_len=FLAGS.seq_len, steps=FLAGS.steps, path=FLAGS.path)
  for name in ('model', 'layers', 'width', 'hidden', 'rows'):
    if getattr(FLAGS, name) is not None:
      config[name] = getattr(FLAGS, name)
  config.update(overrides)
  return config


def _Grid():
  """Plain first, then every (K, M, remat, schedule) that makes sense."""
  grid = [_Config(stages=0, micro_batches=1, remat='-', schedule='-')]
  for k in map(int, FLAGS.stages):
    for m in map(int, FLAGS.micro_batches):
      for remat in FLAGS.remat:
        for sched in FLAGS.schedules:
          grid.append(_Config(stages=k, micro_batches=m, remat=remat, schedule=sched))
  return grid


def _RunOne(config):
  """Builds the stack and times it; runs in a fresh process."""
  tf = bench_utils.SetUpDevices(config['stages'])
  from lingvo_gpipe.foundation import memory_stats  # pylint: disable=g-import-not-at-top
  step = bench_utils.BuildStep(tf, config)
  trace_s = bench_utils.Seconds(step.run)
  times = []
  _, peak = memory_stats.PeakBytes(
      lambda: times.extend(bench_utils.Seconds(step.run) for _ in range(config['steps'])))
  return dict(config, peak_mb=peak / 2**20, step_s=statistics.median(times), trace_s=trace_s,
              params=step.params)


def _Name(result):
  """'plain model' (stages 0 in the JSON), else K, M, remat and schedule."""
  if result['stages'] == 0:
    return 'plain model'
  return (f"K={result['stages']} M={result['micro_batches']} remat={result['remat']} "
          f"schedule={result['schedule']}")


def _Table(results):
  plain = results[0]

  def Ratio(key):
    return lambda r: f'{r[key] / plain[key]:.3f}' if plain[key] else '-'

  return bench_utils.MarkdownTable(results, [
      ('K', lambda r: 'plain' if r['stages'] == 0 else r['stages']),
      ('M', lambda r: r['micro_batches']), ('remat', lambda r: r['remat']),
      ('schedule', lambda r: r['schedule']), ('peak MB', lambda r: f"{r['peak_mb']:.1f}"),
      ('x plain', Ratio('peak_mb')),
      ('step s', lambda r: f"{r['step_s']:.3f}"),
      ('x plain', Ratio('step_s')),
      ('trace s', lambda r: f"{r['trace_s']:.1f}")])


def main(argv):
  del argv
  if FLAGS.single:
    print(json.dumps(_RunOne(json.loads(FLAGS.single))))
    return
  grid = _Grid()
  results = []
  for i, config in enumerate(grid, 1):
    result = bench_utils.RunIsolated(__file__, config)
    results.append(result)
    bench_utils.Progress(i, len(grid), f"{_Name(result)}: peak {result['peak_mb']:.1f} MB, "
                         f"step {result['step_s']:.3f} s")
  bench_utils.Emit(_Table(results), results, FLAGS.json_out,
                   [f'Load average (1, 5, 15 min): {bench_utils.Load()}'])


if __name__ == '__main__':
  binaries.Run(main)
