r"""Plans a model's pipeline split from measured layer costs, under a memory cap per device.

Profiles each layer once at the micro-batch size (forward and backward time,
parameter, input and activation bytes; lingvo_gpipe.insight.planner), finds the
contiguous split into K stages minimising the slowest stage among those whose
every device fits --memory_cap_mb, saves it as a JSON plan and compares it,
through the simulator, with the model's own split (FLOP-balanced). Given several
--remat_policy values (cell_remat_policy, lingvo_gpipe/layers/remat.py), it plans with each and
keeps the fastest plan that fits: under a tight cap, checkpoints inside deeper
stages can beat a coarser policy that only fits with more micro-batches or
stages.

  python tools/plan_balance.py --model=lm.synthetic.GPipeTransformerLmBig \
      --out=/tmp/big.plan.json
  python -m lingvo_gpipe.trainer --model=lm.synthetic.GPipeTransformerLmBig \
      --balance_file=/tmp/big.plan.json --logdir=/tmp/big
  python tools/plan_balance.py --model=mlp --stages=2 --memory_cap_mb=64
  python tools/plan_balance.py --model=mlp --stages=1 --rows=4096 --micro_batches=2 \
      --memory_cap_mb=200 --remat_policy=none,every_layer,every_2
  python tools/plan_balance.py --model=lm.synthetic.GPipeTransformerLmTiny --choose \
      --memory_cap_mb=64          # also picks M, the schedule and remat

With --choose the planner also tries every M dividing the batch (up to 64),
the schedules gpipe, 1f1b, zb_h1 and zb_h2 and every remat mode, with layer
costs scaled from the profiled micro-batch to each M's, and keeps the best
predicted step that fits the cap; it prints the top candidates and why.
"""

import dataclasses
import os
import sys
import tempfile

from absl import flags
import bench_utils
from lingvo_gpipe.foundation import errors
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import schedule as schedule_lib
from lingvo_gpipe.runners import binaries

FLAGS = flags.FLAGS
flags.DEFINE_string('model', 'lm.synthetic.GPipeTransformerLmBig',
                    "A registry key (its task's pipeline), or 'mlp' / 'transformer'.")
flags.DEFINE_string('model_params_override', '',
                    "Params text 'a.b : value; ...' applied to the registered model, as the "
                    'trainer applies it.')
flags.DEFINE_integer('stages', None, 'K; default the model\'s.', lower_bound=1)
flags.DEFINE_integer('micro_batches', None, 'M; default the model\'s. With --choose, the M '
                     'whose micro-batch the layers are profiled at (the choice tries every M).',
                     lower_bound=1)
flags.DEFINE_enum('schedule', None, list(named_schedules.ONE_CHUNK_SCHEDULES),
                  "Schedule; default the model's. Plans run one chunk per device, so "
                  'interleaved_1f1b and zbv are not among them.')
flags.DEFINE_enum('remat', None, ['always', 'except_last', 'never'],
                  'Re-materialization; default the model\'s.')
flags.DEFINE_list('remat_policy', None,
                  "cell_remat_policy values to choose from (the fastest plan that fits), e.g. "
                  "none,every_layer,every_2; default the model's.")
flags.DEFINE_float('memory_cap_mb', None,
                   "Per-device memory cap in MiB; default the profiling GPU's memory (the "
                   'devices a plan runs on are taken to be like it), none on CPUs.')
flags.DEFINE_enum('run_locally', 'auto', ['auto', 'cpu', 'gpu'],
                  'Where layers are profiled, as the trainer\'s flag: auto takes a GPU when '
                  'TensorFlow sees one.')
flags.DEFINE_boolean('choose', False, 'Also choose M, the schedule and remat (see above).')
flags.DEFINE_integer('top', 8, 'With --choose: candidates printed.', lower_bound=1)
flags.register_multi_flags_validator(
    ['choose', 'schedule', 'remat'],
    lambda f: not f['choose'] or (f['schedule'] is None and f['remat'] is None),
    '--choose picks the schedule and remat itself: drop --schedule and --remat, or leave out '
    '--choose to plan with them.')
flags.register_validator('memory_cap_mb', lambda cap: cap is None or cap > 0,
                         '--memory_cap_mb must be a positive number of MiB.')
flags.DEFINE_float('action_overhead_ms', 0.5,
                   'Cost of each pipeline action besides its layers (dispatch, hand-over): '
                   'about 0.6 ms per action on this 2-core CPU (the tiny LM at M=32 ran 192 '
                   'actions in 0.125 s a step); it keeps --choose from many tiny micro-batches.',
                   lower_bound=0.0)
flags.DEFINE_integer('optimizer_slots', 2, 'Optimizer tensors per weight (Adam 2, SGD 0).',
                     lower_bound=0)
flags.DEFINE_integer('repeats', 3, 'Timed runs per layer (median).', lower_bound=1)
flags.DEFINE_integer('layers', 8, 'Built-in stacks: layers.', lower_bound=1)
flags.DEFINE_integer('width', 256, 'Built-in stacks: width.', lower_bound=1)
flags.DEFINE_integer('hidden', 1024, 'Built-in stacks: feed-forward hidden width.',
                     lower_bound=1)
flags.DEFINE_integer('rows', 64, 'Built-in stacks: batch rows (sequences for the Transformer).',
                     lower_bound=1)
flags.DEFINE_integer('seq_len', 64, 'Built-in Transformer: sequence length.', lower_bound=1)
bench_utils.DefineOutputPath('out', os.path.join(tempfile.gettempdir(), 'balance_plan.json'),
                            'Where the plan goes.')
bench_utils.RefuseBuiltInSizes()
flags.adopt_module_key_flags(bench_utils)  # Its Define* flags are this tool's.


def _Measured(profile):
  """Whether the profile's backward time was measured (planner.ProfileLayers clamps the
  difference of two timings at 0 when the noise outweighs it)."""
  return profile.backward_s > 0


def _Profile(tf):
  """(profiles, glued layers, the model's own ends, K, M, schedule, remat, remat policy,
  batch rows)."""
  from lingvo_gpipe.runners import base_runner  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.pipeline import gpipe  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.pipeline import pipeline_params  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.insight import planner  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.layers import profiler  # pylint: disable=g-import-not-at-top

  def Progress(i, n, profile):
    backward = (f'backward {profile.backward_s * 1e3:.3g} ms' if _Measured(profile) else
                'backward not measured (below the timing noise)')
    bench_utils.Progress(i + 1, n, f'{profile.name}: forward {profile.forward_s * 1e3:.3g} ms, '
                         f'{backward}, {profile.activation_bytes / 2**20:.1f} MB activations')

  if FLAGS.model in ('mlp', 'transformer'):
    layer_params, shape = bench_utils.LayerParams(bench_utils.FlagsConfig(FLAGS))
    k, m = FLAGS.stages or 4, FLAGS.micro_batches or 8
    _MicroBatches(shape[0], m)
    try:
      cells = gpipe.PartitionSequentialLayers(layer_params, k, tf.TensorShape(shape), 'flops')
    except ValueError as e:
      sys.exit(f'plan_balance: error: {e}')
    pipe = gpipe.PipeliningLayer.Params().Set(name=FLAGS.model, cell_tpl=cells)
    layer_params, own = pipeline_params.LayersAndEnds(pipe)
    profiles = profiler.ProfileLayers(layer_params, tf.TensorSpec(shape), shape[0] // m,
                                      FLAGS.repeats, progress=Progress)
    return (profiles, [], own, k, m, FLAGS.schedule or 'gpipe', FLAGS.remat or 'always',
            'none', shape[0])
  try:
    params = base_runner.LoadModelParams(FLAGS.model, 'Train', FLAGS.model_params_override)
  except errors.UserError as e:
    sys.exit(f'plan_balance: error: {e}')
  pipelines = list(pipeline_params.Find(params.task, 'task'))
  if len(pipelines) != 1:
    sys.exit(f'plan_balance: error: {FLAGS.model} has {len(pipelines)} pipelines; expected one.')
  _, pipe = pipelines[0]
  k = FLAGS.stages or pipeline_params.NumStages(pipe)
  m = _MicroBatches(params.input.batch_size, FLAGS.micro_batches or pipe.num_micro_batches,
                    None if FLAGS.micro_batches else pipe.micro_batch_size, pipe.num_replicas)
  rows = -(-params.input.batch_size // pipe.num_replicas)  # One replica's: what it plans.
  schedule = FLAGS.schedule or pipe.schedule
  if not FLAGS.choose and schedule not in named_schedules.ONE_CHUNK_SCHEDULES:
    sys.exit(f'plan_balance: error: {FLAGS.model} runs schedule {schedule_lib.Name(schedule)} '
             f'(virtual_stages={pipe.virtual_stages}); a plan runs one chunk per device: give '
             f'--schedule (one of {", ".join(named_schedules.ONE_CHUNK_SCHEDULES)}) or --choose.')
  _, own = pipeline_params.LayersAndEnds(pipe)
  profiles, glued = planner.PipelineProfiles(pipe, rows // m, FLAGS.repeats, progress=Progress)
  return (profiles, glued, own, k, m, schedule, FLAGS.remat or pipe.remat,
          pipe.cell_remat_policy, rows)


def _MicroBatches(rows, m, micro_batch_size=None, replicas=1):
  """M per replica of a `rows` batch, as the pipeline computes it; exits with the pipeline's
  own message for fewer rows than micro-batches."""
  from lingvo_gpipe.pipeline import microbatch  # pylint: disable=g-import-not-at-top
  try:
    return microbatch.NumMicroBatches(rows, m, micro_batch_size, replicas)
  except ValueError as e:
    sys.exit(f'plan_balance: error: {e}')


def main(argv):
  del argv
  tf = bench_utils.SetUpDevices(1, run_locally=FLAGS.run_locally)
  from lingvo_gpipe.foundation import devices  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.insight import planner  # pylint: disable=g-import-not-at-top
  load_before = bench_utils.Load()
  profiles, glued, own_ends, k, m, schedule, remat, own_policy, rows = _Profile(tf)
  cap, cap_text = devices.DefaultMemoryCap(devices.GpuMemoryBytes())
  if FLAGS.memory_cap_mb is not None:
    cap, cap_text = FLAGS.memory_cap_mb * 2**20, f'{FLAGS.memory_cap_mb:g} MiB'
  try:
    choices = dict(remat_policies=FLAGS.remat_policy or [own_policy], memory_cap_bytes=cap,
                   optimizer_slots=FLAGS.optimizer_slots, glued=glued, source=FLAGS.model,
                   action_overhead_s=FLAGS.action_overhead_ms / 1e3)
    if not FLAGS.choose:  # Only the remat policy is chosen, for the model's M, schedule, remat.
      choices.update(micro_batches=[m], schedules=[schedule], remats=[remat])
    plan, candidates = planner.ChoosePlan(profiles, k, rows, rows // m, **choices)
    m, schedule, remat = plan.num_micro_batches, plan.schedule, plan.remat
  except ValueError as e:
    sys.exit(f'plan_balance: error: {e}')
  plan.Save(FLAGS.out)
  # The model's own split (and remat policy) is compared when it has the plan's K stages.
  own = [("the model's split", dataclasses.replace(plan, ends=list(own_ends),
                                                   remat_policy=own_policy))] if (
      len(own_ends) == k) else []
  unmeasured = {p.name for p in profiles if not _Measured(p)}
  rows = []
  for name, p in own + [('planned', plan)]:
    prediction = p.Predict()
    for k_, stage in enumerate(p.Stages()):
      rows.append(dict(split=name, policy=p.remat_policy, stage=k_,
                       layers=', '.join(stage['layers']),
                       forward_ms=stage['forward_s'] * 1e3, backward_ms=stage['backward_s'] * 1e3,
                       unmeasured=bool(unmeasured.intersection(stage['layers'])),
                       memory_mb=stage['memory_bytes'] / 2**20,
                       step_ms=prediction.step_time * 1e3, bubble=prediction.bubble_fraction))
  table = bench_utils.MarkdownTable(rows, [
      ('split', lambda r: r['split']), ('remat policy', lambda r: r['policy']),
      ('stage', lambda r: r['stage']),
      ('layers', lambda r: r['layers']), ('forward ms', lambda r: f"{r['forward_ms']:.3g}"),
      ('backward ms (with recompute)',
       lambda r: f"{r['backward_ms']:.3g}{' *' if r['unmeasured'] else ''}"),
      ('memory MB', lambda r: f"{r['memory_mb']:.1f}"),
      ('predicted step ms', lambda r: f"{r['step_ms']:.3g}"),
      ('predicted bubble', lambda r: f"{r['bubble']:.3f}")])
  notes = [f'{FLAGS.model}: K={k}, M={m}, {schedule}, remat {remat}, remat policy '
           f'{plan.remat_policy} (of {FLAGS.remat_policy or [own_policy]}), cap '
           f'{cap_text}; plan ends '
           f'{plan.ends} (the model\'s, K={len(own_ends)}: {list(own_ends)}); saved to '
           f'{FLAGS.out}; load average '
           f'(1, 5, 15 min) before {load_before}, after {bench_utils.Load()}']
  if unmeasured:
    notes.append(f"* at least this: the backward of {', '.join(sorted(unmeasured))} was not "
                 'measured (forward and backward together ran no longer than the forward '
                 'alone) and counts as 0 ms.')
  if FLAGS.choose:
    print(_CandidateTable(candidates[:FLAGS.top], cap))
  bench_utils.Emit(table, plan.ToJson(), None, notes)


def _CandidateTable(candidates, cap):
  """The best candidates of --choose, with why each lost to the first."""
  from lingvo_gpipe.insight import planner  # pylint: disable=g-import-not-at-top
  best = candidates[0]
  tie = min(c['step_time_s'] for c in candidates) * (1 + planner.TIE_FRACTION)

  def Why(c):
    if c is best:
      return ('chosen: the fastest predicted step that fits (of those within '
              f'{planner.TIE_FRACTION:.1%} of it, the least memory)')
    if 'why' in c:
      return 'does not fit the cap'
    slower = f"{c['step_time_s'] / best['step_time_s'] - 1:+.1%} step time"
    if c['step_time_s'] > tie:
      return slower
    more = c['memory_bytes'] - best['memory_bytes']
    return f'{slower}, a tie: {more / 2**20:+.2f} MB' if more else f'{slower}, a tie, same memory'

  return bench_utils.MarkdownTable(candidates, [
      ('M', lambda c: c['num_micro_batches']), ('schedule', lambda c: c['schedule']),
      ('remat', lambda c: c['remat']), ('remat policy', lambda c: c['remat_policy']),
      ('predicted step ms', lambda c: f"{c['step_time_s'] * 1e3:.3g}"),
      ('bubble', lambda c: f"{c['bubble']:.3f}" if 'bubble' in c else '-'),
      ('fullest device MB', lambda c: (f"{c['memory_bytes'] / 2**20:.1f}" if 'memory_bytes' in c
                                       else f'over {cap / 2**20:.0f}')),
      ('why', Why)])


if __name__ == '__main__':
  binaries.Run(main)
