"""What the benchmark tools share: one configuration per process, models, timing, memory, tables.

A configuration is a JSON-able dict. A driver runs each in a fresh process
(RunIsolated: `python <tool> --single=<json>`), so every allocator peak and
thread setting is its own, and prints one progress line per configuration.
In the child, SetUpDevices configures TensorFlow before its first op and
BuildStep makes the training step of the configuration:

  model: 'mlp' (residual feed-forward layers) or 'transformer' (Transformer
    layers), built from layers/width/hidden/rows/seq_len; or a registry key
    (e.g. lm.synthetic.GPipeTransformerLmBig) whose task runs on a batch of its
    input, its stack cut into `stages` with `micro_batches`;
  stages: K, 0 for the plain (unpipelined) model; micro_batches: M;
  remat, schedule: the PipeliningLayer's; remat_policy (optional, default
    'none'): its cell_remat_policy; path: 'fprop' (FProp under a
    GradientTape) or 'forward_backward' (ForwardBackward; 1F1B always).
"""

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

from absl import flags
from lingvo_gpipe.runners import binaries


def DefineOutputPath(name, default, help_text):
  """A string flag naming a file to write, whose directory must exist when the flags are
  parsed: a missing one is said at once, not when the results are ready."""
  flags.DEFINE_string(name, default, help_text)
  flags.register_validator(
      name, lambda path: not path or os.path.isdir(os.path.dirname(os.path.abspath(path))),
      'its directory does not exist.')


class _CountsParser(flags.ListParser):
  """Comma-separated positive integers; an error quotes the text as typed."""

  def __init__(self, allow_empty):
    super().__init__()
    self._allow_empty = allow_empty

  def parse(self, argument):
    values = super().parse(argument)
    if not (values or self._allow_empty) or not all(v.isdigit() and int(v) > 0 for v in values):
      raise ValueError('expected positive integers, e.g. 4,8.')
    return values


def DefineCounts(name, default, help_text):
  """A list flag of positive integers (K or M values), checked when the flags are parsed; it
  may be empty only if its default is."""
  flags.DEFINE(_CountsParser(allow_empty=not default), name, default, help_text,
               serializer=flags.CsvListSerializer(','))


def CheckChoices(name, choices):
  """Refuses, when the flags are parsed, a list flag `name` that is empty or holds a value not
  in `choices` (before a tool spends minutes on the values before it)."""

  def Check(values):
    if values is None:
      return True
    if not values:
      raise flags.ValidationError('is empty: give at least one value.')
    unknown = [v for v in values if v not in choices]
    if unknown:
      raise flags.ValidationError(f'unknown {unknown}; expected some of {list(choices)}.')
    return True

  flags.register_validator(name, Check)


BUILT_IN_SIZES = ('layers', 'width', 'hidden', 'rows', 'seq_len')


def RefuseBuiltInSizes(names=BUILT_IN_SIZES):
  """Refuses, when the flags are parsed, flags sizing a built-in stack (`names`) given beside
  a registered --model, whose params set its sizes: they would be silently ignored."""

  def Check(values):
    if values['model'] in (None, 'mlp', 'transformer'):
      return True
    given = [f'--{name}' for name in names if flags.FLAGS[name].present]
    if given:
      raise flags.ValidationError(
          f"{', '.join(given)} size a built-in stack ('mlp' or 'transformer'), not the "
          "registered model: set its params with --model_params_override.")
    return True

  flags.register_multi_flags_validator(['model', *names], Check)


def DefineJsonOut():
  DefineOutputPath('json_out', None, 'Also write the results JSON to this file.')


def Progress(i, n, text):
  """One progress line on stderr."""
  print(f'[{i}/{n}] {text}', file=sys.stderr, flush=True)


def Load():
  """The 1, 5 and 15 minute load averages (this machine's cores are shared)."""
  return [round(x, 2) for x in os.getloadavg()]


def RunIsolated(script, config, timeout=None):
  """Runs `script --single=<config JSON>` in a fresh process; returns its JSON result line."""
  proc = subprocess.run([sys.executable, script, f'--single={json.dumps(config)}'],
                        capture_output=True, text=True, check=False, timeout=timeout)
  if proc.returncode:
    last = (proc.stderr.strip().splitlines() or [''])[-1]
    if last.startswith('ValueError: '):  # Most likely the configuration's own error.
      raise SystemExit(f'{os.path.basename(script)}: error: {_Point(config) or "a point"}: '
                       f'{last[len("ValueError: "):]} (its traceback: python {script} '
                       f"--single='{json.dumps(config)}')")
    raise RuntimeError(f'Configuration {config} failed:\n{proc.stderr[-3000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def RunPoints(script, points, describe):
  """Runs each point in a fresh process (RunIsolated) with a progress line
  describe(config, result) after it; returns the results."""
  results = []
  for i, config in enumerate(points, 1):
    results.append(RunIsolated(script, config))
    Progress(i, len(points), describe(config, results[-1]))
  return results


def _Point(config):
  """The point's settings a reader tells apart, e.g. 'K=2 M=8'."""
  keys = ('schedule', 'stages', 'micro_batches', 'remat')
  names = dict(stages='K', micro_batches='M')
  return ' '.join(f'{names.get(k, k)}={config[k]}' for k in keys if k in config)


def SetUpDevices(num_devices, intra_op_threads=0, inter_op_threads=0, run_locally='cpu'):
  """num_devices logical CPU devices (or, run_locally 'gpu' or 'auto' on a GPU machine, its
  GPUs) and thread pools (0: TensorFlow's default); returns tf."""
  binaries.QuietTensorFlow()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.foundation import devices  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.foundation import memory_stats  # pylint: disable=g-import-not-at-top
  memory_stats.EnableStats()
  devices.ConfigureLocal(run_locally, max(1, num_devices))
  tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
  tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
  return tf


class Step:
  """A configuration's training step: run() (eager call of the tf.function) and its sizes.

  measured(): the same step with the pipeline's step timing on; returns a
    pipeline_stats.Timeline (None for the plain model).
  params: trainable parameter count; rows: examples per step.
  """

  def __init__(self, run, measured, params, rows):
    self.run = run
    self.measured = measured
    self.params = params
    self.rows = rows


# Chunks per device the tools run for each schedule (cells = stages x this).
VIRTUAL_STAGES = {'interleaved_1f1b': 2, 'zbv': 2}


def FlagsConfig(flag_values):
  """The built-in stack's config from a tool's flags of the same names."""
  return {name: getattr(flag_values, name)
          for name in ('model', 'layers', 'width', 'hidden', 'rows', 'seq_len')}


def LayerParams(config):
  """(layer params, input shape) of a built-in stack: config has model ('mlp' or 'transformer'),
  layers, width, hidden, rows, seq_len (a Transformer's only) and optionally heads (default
  width / 64)."""
  from lingvo_gpipe import layers  # pylint: disable=g-import-not-at-top
  if config['model'] == 'mlp':
    layer = layers.TransformerFeedForwardLayer.Params().Set(
        input_dim=config['width'], hidden_dim=config['hidden'])
    shape = [config['rows'], config['width']]
  else:
    layer = layers.TransformerLayer.Params().Set(
        input_dim=config['width'], hidden_dim=config['hidden'],
        num_heads=config.get('heads') or max(1, config['width'] // 64), mask_self_atten=True)
    shape = [config['rows'], config['seq_len'], config['width']]
  return [layer.Copy() for _ in range(config['layers'])], shape


def _Fetch(tf, structure):
  tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, 'numpy') else t, structure)


def MeasuredStep(tf, body):
  """A function that runs body() with the pipelines' step statistics on; returns the Timeline.

  body is traced into a tf.function that runs it twice, the second once the
  first's outputs exist, and times the second: as the timed loops run several
  steps per call, the measured step starts right after the step before it, not
  when the client has dispatched the call (on this 2-core machine, where the
  client shares the workers' cores, a step dispatched alone began with 2-15 ms
  more idle time on the last stage and slower first actions). A call returns
  once the measured step's outputs exist, without fetching them: a timed step's
  gradients stay on their devices too.
  """
  from lingvo_gpipe.insight import pipeline_stats  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.foundation import py_utils  # pylint: disable=g-import-not-at-top
  records = []

  def Outputs():
    return [t for t in tf.nest.flatten(body()) if isinstance(t, tf.Tensor)]

  @tf.function(autograph=False)
  def Measured():
    before = Outputs()
    records.clear()
    with tf.control_dependencies(before), py_utils.Context(step_stats=records):
      out = Outputs()
    with tf.control_dependencies(out):  # Done where they are, not fetched (as timed steps).
      done = tf.constant(True)
    return done, pipeline_stats.StackTimes(records)

  def Timeline():
    done, times = Measured()
    done.numpy()
    return pipeline_stats.Timeline.FromRecords(records, times.numpy())

  return Timeline


def _Run(tf, body):
  """body() as a traced tf.function whose outputs each call fetches."""
  step = tf.function(body, autograph=False)
  return lambda: _Fetch(tf, step())


def _BuiltInStep(tf, config, devices=None, input_device=None):
  # pylint: disable-next=g-import-not-at-top
  from lingvo_gpipe.distribution import cluster as cluster_lib
  from lingvo_gpipe.pipeline import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe import layers  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.pipeline import microbatch  # pylint: disable=g-import-not-at-top
  layer_params, shape = LayerParams(config)
  if config['stages']:  # A configured batch that leaves micro-batches empty measures nothing.
    microbatch.NumMicroBatches(shape[0], config['micro_batches'])
  where = input_device or (devices[0] if devices else None)
  with tf.device(where) if where else contextlib.nullcontext():
    x = tf.random.stateless_normal(shape, [1, 2])

  def Loss(y):
    return tf.reduce_mean(tf.square(y))

  if config['stages'] == 0:
    model = layers.SequentialLayer.Params().Set(name='plain', sub=layer_params).Instantiate()
    use_tape = True
  else:
    v = VIRTUAL_STAGES.get(config['schedule'], 1)
    cells = gpipe.PartitionSequentialLayers(layer_params, config['stages'] * v,
                                            tf.TensorShape(shape))
    model = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells, num_micro_batches=config['micro_batches'],
        remat=config['remat'], schedule=config['schedule'], virtual_stages=v,
        cell_remat_policy=config.get('remat_policy', 'none'), devices=devices).Instantiate()
    use_tape = config['path'] == 'fprop' and config['schedule'] == 'gpipe'

  def Body():
    if use_tape:
      with tf.GradientTape() as tape:
        loss = Loss(model(x))
      return loss, tape.gradient(loss, model.trainable_variables)
    # On a cluster, glue ops go where their inputs are, not to this client.
    with cluster_lib.ColocatedWithInputs() if devices else contextlib.nullcontext():
      return model.ForwardBackward(model.theta, x, Loss, loss_reduction='mean')

  params = sum(int(tf.size(v)) for v in model.trainable_variables)
  return Step(_Run(tf, Body), MeasuredStep(tf, Body) if config['stages'] else None, params,
              shape[0])


def _RegisteredStep(tf, config):
  from lingvo_gpipe.runners import base_runner  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.models import model_registry  # pylint: disable=g-import-not-at-top
  params = model_registry.GetParams(config['model'], 'Train')
  stack = params.task.stack
  plain = config['stages'] == 0
  v = 1 if plain else VIRTUAL_STAGES.get(config['schedule'], 1)
  stack.Set(splits=max(1, config['stages']) * v, num_micro_batches=1 if plain else
            config['micro_batches'], remat='never' if plain else config['remat'],
            schedule='gpipe' if plain else config['schedule'], virtual_stages=v,
            cell_remat_policy='none' if plain else config.get('remat_policy', 'none'))
  base_runner.CheckPipelineBatches(params)
  task = params.task.Instantiate()
  batch = next(iter(params.input.Instantiate().GetDataset()))

  def Body():
    return task.ForwardBackward(task.theta, batch)

  count = sum(int(tf.size(v)) for v in task.trainable_variables)
  return Step(_Run(tf, Body), None if plain else MeasuredStep(tf, Body), count,
              params.input.batch_size)


def BuildStep(tf, config, devices=None, input_device=None):
  """The Step of a configuration (see the module docstring); a built-in model's pipeline on
  `devices` (e.g. a cluster's) if given, its batch on `input_device` (default: the first
  stage's)."""
  if config['model'] in ('mlp', 'transformer'):
    return _BuiltInStep(tf, config, devices, input_device)
  if devices or input_device:
    raise ValueError(f"devices are for the built-in models, not {config['model']!r}.")
  return _RegisteredStep(tf, config)


def Seconds(fn):
  """Wall seconds of one call of fn()."""
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def MedianSeconds(fn, repeats):
  return statistics.median(Seconds(fn) for _ in range(repeats))


def MeasureBubble(measured, repeats):
  """The pipeline_stats.Summary (as a dict) with the median bubble of repeats measured() steps."""
  from lingvo_gpipe.insight import pipeline_stats  # pylint: disable=g-import-not-at-top
  measured()  # Trace and warm up.
  summaries = sorted((pipeline_stats.Summarize(measured()) for _ in range(repeats)),
                     key=lambda s: s.bubble_fraction)
  return summaries[len(summaries) // 2].AsDict()


def MarkdownTable(rows, columns):
  """A markdown table; columns are (header, function of a row -> text)."""
  lines = ['| ' + ' | '.join(h for h, _ in columns) + ' |',
           '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(str(fn(r)) for _, fn in columns) + ' |' for r in rows]
  return '\n'.join(lines)


def Emit(table, results, json_out=None, notes=()):
  """Prints the notes, the markdown table and the JSON of the results; writes the JSON file."""
  for note in notes:
    print(note)
  print(table)
  print(json.dumps(results, indent=1))
  if json_out:
    with open(json_out, 'w') as f:
      json.dump(results, f, indent=1)
