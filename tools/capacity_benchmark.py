r"""GPipe Table 1 on this machine: the largest Transformer that trains one step in a memory budget.

Two ways to train on one device, as the paper's Naive-1 and Pipeline-1:
  naive     the plain layer stack on the whole batch, no re-materialization;
  pipeline  one pipeline stage (K=1) with M micro-batches and re-materialization,
            once per --remat_policies (cell_remat_policy, lingvo_gpipe/layers/remat.py: 'none'
            re-materializes the cell as a whole, 'every_layer' also keeps only
            each layer's output while the cell's backward runs).
A step is forward, backward and an SGD update of every weight. Its memory is the
allocator's peak during the step, weights included, and it fits when that is
at most --budget_mb. For each width, the peak is measured at two depths, the
largest depth under the budget follows from the straight line through them
(memory grows linearly with depth), and that depth is run to check it fits.

  python tools/capacity_benchmark.py                     # 256 MiB: a few minutes
  # The README's Table 1: 2 GiB, about 45 minutes on its 2-core machine (wider
  # layers keep the depth, and the tracing time that grows with it, down):
  python tools/capacity_benchmark.py --budget_mb=2048 --widths=512 --rows=128 \
      --micro_batches=64

The batch is large next to the width on purpose: the paper's gain comes from
activations, which grow with the batch, outweighing weights and gradients,
which do not (a pipeline keeps the weights, their gradient sum, added to in
place, and about one layer's fresh gradients).
"""

import json
import math

from absl import flags
import bench_utils
from lingvo_gpipe.runners import binaries

FLAGS = flags.FLAGS
flags.DEFINE_float('budget_mb', 256.0, 'Allocator budget of one training step, in MiB.')
bench_utils.DefineCounts('widths', ['256'], 'Model widths d (hidden 4d, d/64 heads) to search.')
flags.DEFINE_integer('rows', 64, 'Batch sequences N.')
flags.DEFINE_integer('seq_len', 64, 'Sequence length.')
flags.DEFINE_integer('micro_batches', 32, 'M of the pipeline.')
flags.DEFINE_list('remat_policies', ['none'], 'cell_remat_policy values of the pipeline runs.')
bench_utils.DefineCounts('probe_layers', ['2', '4'], 'The two depths the line is fitted through.')
flags.DEFINE_integer('max_layers', 1000, 'Deepest model tried (caps a quick run).')
bench_utils.DefineJsonOut()
flags.DEFINE_string('single', None, 'Internal: run one configuration (JSON) and print it.')
flags.adopt_module_key_flags(bench_utils)  # Its Define* flags are this tool's.



def _Name(config):
  """'naive', 'pipeline', or 'pipeline every_layer' for a pipeline with a remat policy."""
  policy = config['remat_policy']
  return config['mode'] if policy == 'none' else f"{config['mode']} {policy}"


def _RunOne(config):
  """Peak allocator MiB (weights included) of the first training step of a configuration."""
  tf = bench_utils.SetUpDevices(1)
  from lingvo_gpipe.pipeline import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe import layers  # pylint: disable=g-import-not-at-top
  layer_params, shape = bench_utils.LayerParams(
      dict(config, model='transformer', hidden=4 * config['width']))
  if config['mode'] == 'naive':
    model = layers.SequentialLayer.Params().Set(name='naive', sub=layer_params).Instantiate()
  else:
    model = gpipe.PipeliningLayer.Params().Set(
        name='pipeline', cell_tpl=gpipe.CellsFromEnds(layer_params, [len(layer_params)]),
        num_micro_batches=config['micro_batches'], remat='always',
        cell_remat_policy=config['remat_policy']).Instantiate()
  x = tf.random.stateless_normal(shape, [1, 2])
  weights = model.trainable_variables

  def Loss(y):
    return tf.reduce_mean(tf.square(y))

  @tf.function(autograph=False)
  def TrainStep():
    if config['mode'] == 'naive':
      with tf.GradientTape() as tape:
        loss = Loss(model(x))
      grads = tape.gradient(loss, weights)
    else:
      loss, grads = model.ForwardBackward(model.theta, x, Loss, loss_reduction='mean')
      by_ref = {g_var.ref(): g for g_var, g in zip(tf.nest.flatten(model.theta),
                                                    tf.nest.flatten(grads))}
      grads = [by_ref[v.ref()] for v in weights]
    for v, g in zip(weights, grads):
      v.assign_sub(0.01 * g)
    return loss

  tf.config.experimental.reset_memory_stats('CPU:0')
  seconds = bench_utils.Seconds(lambda: TrainStep().numpy())
  peak = tf.config.experimental.get_memory_info('CPU:0')['peak']
  params = sum(int(tf.size(v)) for v in weights)
  return dict(config, peak_mb=peak / 2**20, params=params, weights_mb=4 * params / 2**20,
              step_s=seconds)


class _Search:
  """Runs configurations in fresh processes, numbering them for the progress lines."""

  def __init__(self):
    self.count = 0

  def Run(self, **config):
    self.count += 1
    result = bench_utils.RunIsolated(__file__, config)
    bench_utils.Progress(self.count, '?', f"{_Name(config)} d={config['width']} "
                         f"L={config['layers']}: peak {result['peak_mb']:.0f} MB, "
                         f"{result['params'] / 1e6:.1f}M parameters, {result['step_s']:.1f} s")
    return result

  def Largest(self, mode, width, remat_policy):
    """(the deepest run that fits, the fitted MiB per layer).

    The line through the probes predicts the depth. Then, until the deepest
    fitting depth and the shallowest failing one are neighbours (or the
    deepest fitting one is --max_layers), the next depth is where the line
    through the two nearest runs meets the budget: memory grows linearly with
    depth, so that is one or two more runs, each a whole training step.
    """
    base = dict(mode=mode, width=width, rows=FLAGS.rows, seq_len=FLAGS.seq_len,
                micro_batches=FLAGS.micro_batches, remat_policy=remat_policy)
    runs = {}

    def Peak(depth):
      if depth not in runs:
        runs[depth] = self.Run(layers=depth, **base)
      return runs[depth]['peak_mb']

    def Crossing(a, b):
      """Depth where the line through the runs at depths a < b meets the budget."""
      slope = (Peak(b) - Peak(a)) / (b - a)
      return a + math.floor((FLAGS.budget_mb - Peak(a)) / slope)

    l0, l1 = map(int, FLAGS.probe_layers)
    per_layer = (Peak(l1) - Peak(l0)) / (l1 - l0)
    if per_layer <= 0:
      raise SystemExit(f'capacity_benchmark: error: {_Name(base)} d={width}: the peak did not '
                       f'grow from {l0} to {l1} layers ({Peak(l0):.2f} -> {Peak(l1):.2f} MB); the '
                       'model is too small for the allocator statistics: raise --rows or --widths.')
    depth = Crossing(l0, l1)
    while True:
      depth = min(max(1, depth), FLAGS.max_layers)
      Peak(depth)
      fitting = [d for d in runs if runs[d]['peak_mb'] <= FLAGS.budget_mb]
      failing = [d for d in runs if runs[d]['peak_mb'] > FLAGS.budget_mb]
      low, high = max(fitting, default=0), min(failing, default=None)
      if low >= FLAGS.max_layers or (high is not None and high - low <= 1) or high == 1:
        return runs[low or high], per_layer
      if high is None:  # Line through the two deepest runs, at least one layer deeper.
        below = max(d for d in runs if d < low)
        depth = max(low + 1, Crossing(below, low))
      elif low == 0:
        depth = high // 2
      else:
        depth = min(max(low + 1, Crossing(low, high)), high - 1)


def main(argv):
  del argv
  if FLAGS.single:
    print(json.dumps(_RunOne(json.loads(FLAGS.single))))
    return
  load_before = bench_utils.Load()
  search = _Search()
  runs = [('naive', 'none')] + [('pipeline', policy) for policy in FLAGS.remat_policies]
  results = []
  for width in map(int, FLAGS.widths):
    for mode, policy in runs:
      result, per_layer = search.Largest(mode, width, policy)
      results.append(dict(result, mb_per_layer=per_layer,
                          fits=result['peak_mb'] <= FLAGS.budget_mb,
                          capped=result['layers'] >= FLAGS.max_layers))
  best = {name: max((r for r in results if _Name(r) == name and r['fits']),
                    key=lambda r: r['params'], default=None)
          for name in (_Name(dict(mode=m, remat_policy=p)) for m, p in runs)}
  table = bench_utils.MarkdownTable(results, [
      ('mode', _Name), ('width', lambda r: r['width']),
      ('layers', lambda r: r['layers']),
      ('parameters', lambda r: f"{r['params'] / 1e6:.1f}M"),
      ('peak MB', lambda r: f"{r['peak_mb']:.0f}"),
      ('weights MB', lambda r: f"{r['weights_mb']:.0f}"),
      ('MB per layer', lambda r: f"{r['mb_per_layer']:.1f}"),
      ('fits', lambda r: ('yes, at --max_layers' if r['capped'] else 'yes') if r['fits']
       else 'no'),
      ('first step s (with tracing)', lambda r: f"{r['step_s']:.1f}")])
  notes = [f'Budget {FLAGS.budget_mb:.0f} MiB; batch {FLAGS.rows} x {FLAGS.seq_len} tokens; '
           f'pipeline: K=1, M={FLAGS.micro_batches}, re-materialization; load average '
           f'(1, 5, 15 min) before {load_before}, after {bench_utils.Load()}']
  naive = best.pop('naive')
  for name, pipeline in best.items():
    if naive and pipeline:
      notes.append(f"Largest that fits: naive {naive['params'] / 1e6:.1f}M, {name} "
                   f"{pipeline['params'] / 1e6:.1f}M parameters: "
                   f"{pipeline['params'] / naive['params']:.1f}x (GPipe's Table 1: 82M -> 318M, "
                   '3.9x).')
  bench_utils.Emit(table, dict(budget_mb=FLAGS.budget_mb, results=results), FLAGS.json_out,
                   notes)


if __name__ == '__main__':
  binaries.Run(main)
