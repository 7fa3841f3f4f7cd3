r"""Peak memory and step time of a pipelined stack against the plain model.

Each configuration runs in its own process so that each allocator peak is its
own. The driver prints one progress line per configuration, then a markdown
table and the JSON of all results.

  # The issue's residual MLP: 16 layers, width 256, hidden 1024, 8192 rows.
  python tools/pipeline_benchmark.py --preset=anchors
  # A quick look (a few minutes):
  python tools/pipeline_benchmark.py --stages=1,4 --micro_batches=1,8,32 --remat=always

Columns: peak_mb is the allocator peak (tf.config.experimental.get_memory_info)
above the live set before the step, step_s the median step time, trace_s the
time to trace and run the first step; x_plain columns divide by the plain run.
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

PRESETS = {
    'anchors': dict(model='mlp', layers=16, width=256, hidden=1024, rows=8192),
    'small': dict(model='mlp', layers=8, width=128, hidden=512, rows=2048),
}

FLAGS = flags.FLAGS
flags.DEFINE_enum('preset', 'small', list(PRESETS), 'Stack size preset; flags below override.')
flags.DEFINE_enum('model', None, ['mlp', 'transformer'], 'Residual MLP or Transformer layers.')
flags.DEFINE_integer('layers', None, 'Number of layers.')
flags.DEFINE_integer('width', None, 'Model width.')
flags.DEFINE_integer('hidden', None, 'Hidden (feed-forward) width.')
flags.DEFINE_integer('rows', None, 'Batch rows (sequences for the Transformer).')
flags.DEFINE_integer('seq_len', 64, 'Sequence length of the Transformer.')
flags.DEFINE_list('stages', ['1', '2', '4'], 'K values.')
flags.DEFINE_list('micro_batches', ['1', '4', '8', '16', '32'], 'M values.')
flags.DEFINE_list('remat', ['always', 'except_last', 'never'], 'Re-materialization modes.')
flags.DEFINE_list('schedules', ['gpipe', '1f1b'], 'Schedules.')
flags.DEFINE_enum('path', 'fprop', ['fprop', 'forward_backward'],
                  'FProp under tf.GradientTape (a model\'s train step) or ForwardBackward. '
                  "'1f1b' always runs ForwardBackward.")
flags.DEFINE_integer('steps', 5, 'Timed steps per configuration (median reported).')
flags.DEFINE_string('json_out', None, 'Also write the results JSON to this file.')
flags.DEFINE_string('single', None, 'Internal: run one configuration (JSON) and print it.')


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
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpus = tf.config.list_physical_devices('CPU')
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * max(1, config['stages']))
  from lingvo_gpipe.core import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.core import layers  # pylint: disable=g-import-not-at-top

  if config['model'] == 'mlp':
    layer = layers.TransformerFeedForwardLayer.Params().Set(
        input_dim=config['width'], hidden_dim=config['hidden'])
    shape = [config['rows'], config['width']]
  else:
    layer = layers.TransformerLayer.Params().Set(
        input_dim=config['width'], hidden_dim=config['hidden'], num_heads=4,
        mask_self_atten=True)
    shape = [config['rows'], config['seq_len'], config['width']]
  layer_params = [layer.Copy() for _ in range(config['layers'])]
  x = tf.random.stateless_normal(shape, [1, 2])

  def Loss(y):
    return tf.reduce_mean(tf.square(y))

  if config['stages'] == 0:
    model = layers.SequentialLayer.Params().Set(name='plain', sub=layer_params).Instantiate()
    use_tape = True
  else:
    cells = gpipe.PartitionSequentialLayers(layer_params, config['stages'], tf.TensorShape(shape))
    model = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=config['micro_batches'],
        remat=config['remat'], schedule=config['schedule']).Instantiate()
    use_tape = config['path'] == 'fprop' and config['schedule'] == 'gpipe'

  @tf.function
  def Step():
    if use_tape:
      with tf.GradientTape() as tape:
        loss = Loss(model(x))
      return loss, tape.gradient(loss, model.trainable_variables)
    return model.ForwardBackward(model.theta, x, Loss)

  def Run():
    tf.nest.map_structure(lambda t: t.numpy(), Step())

  start = time.perf_counter()
  Run()
  trace_s = time.perf_counter() - start
  tf.config.experimental.reset_memory_stats('CPU:0')
  live = tf.config.experimental.get_memory_info('CPU:0')['current']
  times = []
  for _ in range(config['steps']):
    start = time.perf_counter()
    Run()
    times.append(time.perf_counter() - start)
  peak = tf.config.experimental.get_memory_info('CPU:0')['peak'] - live
  params = sum(int(tf.size(v)) for v in model.trainable_variables)
  return dict(config, peak_mb=peak / 2**20, step_s=statistics.median(times), trace_s=trace_s,
              params=params)


def _Table(results):
  plain = results[0]
  head = ('| K | M | remat | schedule | peak MB | x plain | step s | x plain | trace s |\n'
          '|---|---|---|---|---|---|---|---|---|')
  rows = []
  for r in results:
    k = 'plain' if r['stages'] == 0 else r['stages']
    rows.append(f"| {k} | {r['micro_batches']} | {r['remat']} | {r['schedule']} | "
                f"{r['peak_mb']:.1f} | {r['peak_mb'] / plain['peak_mb']:.3f} | "
                f"{r['step_s']:.3f} | {r['step_s'] / plain['step_s']:.3f} | {r['trace_s']:.1f} |")
  return '\n'.join([head] + rows)


def main(argv):
  del argv
  if FLAGS.single:
    print(json.dumps(_RunOne(json.loads(FLAGS.single))))
    return
  grid = _Grid()
  results = []
  for i, config in enumerate(grid, 1):
    proc = subprocess.run([sys.executable, __file__, f'--single={json.dumps(config)}'],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
      sys.exit(f'Configuration {config} failed:\n{proc.stderr[-3000:]}')
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    results.append(result)
    print(f"[{i}/{len(grid)}] K={result['stages']} M={result['micro_batches']} "
          f"remat={result['remat']} schedule={result['schedule']}: "
          f"peak {result['peak_mb']:.1f} MB, step {result['step_s']:.3f} s", file=sys.stderr)
  print(_Table(results))
  print(json.dumps(results, indent=1))
  if FLAGS.json_out:
    with open(FLAGS.json_out, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  app.run(main)
