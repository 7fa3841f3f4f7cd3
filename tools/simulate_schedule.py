r"""Predicts pipelined steps beyond this machine with the schedule simulator.

Stage costs are uniform (--forward_ms, --backward_ms) or a balance plan's
measured stage costs (--plan, tools/plan_balance.py), optionally scaled to
other hardware (--speedup); --transfer_ms adds a hand-over per stage boundary.
A plan's batch stays the plan's: at another M each micro-batch's layer times
and activations scale by the plan's M / M (Plan.AtMicroBatches, as the planner
scales them; its per-action overhead stays), and
without --micro_batches / --schedules the plan's own M and schedule run.
For each schedule and (K, M) it prints the predicted step time, bubble (and
the unit-cost theory), micro-batches in flight and peak activation memory per
device, and the seconds the orders and the simulation took (numpy; fill-drain at
K=1024, M=8192 in about half a minute, most of it building the orders). ZB-V's
order comes from a greedy run in Python: keep it to K x M of a few tens of
thousands (K=64, M=512 takes seconds). Schedules with two chunks
per device (interleaved_1f1b, zbv) split each stage's costs between its chunks.

  python tools/simulate_schedule.py --stages=1024 --micro_batches=8192
  python tools/simulate_schedule.py --schedules=1f1b,zb_h1,zb_h2,zbv,interleaved_1f1b \
      --stages=4,8 --micro_batches=8,32
  python tools/simulate_schedule.py --plan=/tmp/balance_plan.json --micro_batches=4,16,64 \
      --trace_out=/tmp/sim_trace.json
"""

import sys
import time

from absl import flags
import bench_utils
from lingvo_gpipe.insight import simulator
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import schedule as schedule_lib
from lingvo_gpipe.runners import binaries

FLAGS = flags.FLAGS
bench_utils.DefineCounts('stages', ['4', '64', '1024'], 'K values (ignored with --plan).')
bench_utils.DefineCounts('micro_batches', ['16', '512', '8192'],
                         "M values (with --plan, default: the plan's M).")
flags.DEFINE_list('schedules', ['gpipe', '1f1b'],
                  f'Schedules, of {list(named_schedules.SCHEDULE_NAMES)} (with --plan, default: '
                  "the plan's).")
flags.register_validator('schedules', bool, '--schedules is empty: give at least one schedule.')
flags.DEFINE_float('forward_ms', 1.0, 'Forward time of a micro-batch per stage (not with '
                   '--plan).', lower_bound=0.0)
flags.DEFINE_float('backward_ms', 2.0, 'Backward time (with any recompute) per stage (not '
                   'with --plan).', lower_bound=0.0)
flags.register_multi_flags_validator(
    ['forward_ms', 'backward_ms'], lambda f: f['forward_ms'] + f['backward_ms'] > 0,
    '--forward_ms and --backward_ms are both 0: a step of no work has no bubble to simulate.')
flags.DEFINE_string('plan', None, 'A balance plan whose stage costs replace the uniform ones.')
flags.DEFINE_float('speedup', 1.0, 'Divide the --plan\'s times by this (other hardware).')
flags.register_validator('speedup', lambda x: x > 0, '--speedup must be positive.')
flags.DEFINE_float('transfer_ms', 0.0, 'Hand-over time per stage boundary.', lower_bound=0.0)
flags.DEFINE_float('activation_mb', 1.0,
                   'MiB a stage keeps per micro-batch in flight, split between its chunks '
                   "when it has several (not with --plan: what the plan's remat keeps, the "
                   'stage input or all its activations).', lower_bound=0.0)
bench_utils.DefineOutputPath('trace_out', None, 'Chrome trace of the first prediction.')
flags.DEFINE_integer('trace_max_actions', 200_000,
                     'Refuse a --trace_out of more actions (about 200 bytes each).')
bench_utils.DefineJsonOut()
flags.adopt_module_key_flags(bench_utils)  # Its Define* flags are this tool's.


_NOT_WITH_PLAN = ('stages', 'forward_ms', 'backward_ms', 'activation_mb')


def _CheckFlags():
  """Refuses flags that --plan, given or not, would leave unused."""
  if FLAGS.plan:
    unused = [f'--{name}' for name in _NOT_WITH_PLAN if FLAGS[name].present]
    why = 'with --plan: the plan gives the stages, their costs and memory.'
  else:
    unused = ['--speedup'] if FLAGS['speedup'].present else []
    why = "scales a --plan's times; without one give --forward_ms and --backward_ms."
  if unused:
    sys.exit(f'simulate_schedule: error: {", ".join(unused)} {why}')


def _Plan():
  if not FLAGS.plan:
    return None
  binaries.QuietTensorFlow()  # A balance plan imports TensorFlow, whose start-up logs.
  from lingvo_gpipe.insight import balance_plan  # pylint: disable=g-import-not-at-top
  try:
    return balance_plan.LoadPlan(FLAGS.plan)
  except ValueError as e:
    sys.exit(f'simulate_schedule: error: {e}')


def _Cases(plan):
  """(schedule, K, M, ms per stage of forward, backward, input gradient and weight gradient
  (None: half the backward each), MiB kept per micro-batch)."""
  if plan is None:
    return [(name, k, int(m), FLAGS.forward_ms, FLAGS.backward_ms, None, None,
             FLAGS.activation_mb)
            for name in FLAGS.schedules for k in map(int, FLAGS.stages)
            for m in FLAGS.micro_batches]
  ms = ([int(m) for m in FLAGS.micro_batches] if FLAGS['micro_batches'].present
        else [plan.num_micro_batches])
  names = FLAGS.schedules if FLAGS['schedules'].present else [plan.schedule]
  cases = []
  for m in ms:
    at_m = plan.AtMicroBatches(m)
    per_micro = [[t * 1e3 / FLAGS.speedup for t in stages]
                 for stages in at_m.StageCosts() + at_m.SplitBackwardCosts()]
    kept = [b / 2**20 for b in at_m.HeldBytes()]
    cases += [(name, plan.num_stages, m, *per_micro, kept) for name in names]
  return cases


def _Chunks(cost, v):
  """A stage's cost (uniform, or per stage with v = 1) as each of its v chunks' cost."""
  return cost if isinstance(cost, list) else cost / v


def main(argv):
  del argv
  _CheckFlags()
  cases = _Cases(_Plan())
  if FLAGS.trace_out:
    _, k, m = cases[0][:3]
    actions = 3 * k * m * bench_utils.VIRTUAL_STAGES.get(cases[0][0], 1)
    if actions > FLAGS.trace_max_actions:
      sys.exit(f'simulate_schedule: error: the trace of {cases[0][0]} K={k} M={m} would hold up '
               f'to {actions} actions (over --trace_max_actions={FLAGS.trace_max_actions}, '
               f'about {actions * 200 / 2**20:.0f} MB); trace a smaller case first.')
  results = []
  for i, (name, k, m, forward, backward, input_grad, weight_grad, kept) in enumerate(cases, 1):
    v = bench_utils.VIRTUAL_STAGES.get(name, 1)
    if v > 1 and FLAGS.plan:
      sys.exit(f'simulate_schedule: error: {name} runs {v} chunks per device; a balance plan '
               'has one per stage.')
    start = time.perf_counter()
    try:
      prediction = simulator.Simulate(simulator.Orders(name, k, m, v), _Chunks(forward, v),
                                      _Chunks(backward, v), transfer_cost=FLAGS.transfer_ms,
                                      activation_bytes=_Chunks(kept, v),
                                      input_grad_cost=input_grad, weight_grad_cost=weight_grad)
    except ValueError as e:  # An unknown schedule, or an M it cannot run.
      sys.exit(f'simulate_schedule: error: {e}')
    seconds = time.perf_counter() - start
    results.append(dict(schedule=name, stages=k, micro_batches=m,
                        step_ms=prediction.step_time, bubble=prediction.bubble_fraction,
                        fill_drain_theory=schedule_lib.TheoreticalBubble(k, m),
                        max_in_flight=int(prediction.max_in_flight.max()),
                        peak_activation_mb=float(prediction.peak_activation_bytes.max()),
                        simulate_s=seconds))
    bench_utils.Progress(i, len(cases), f'{name} K={k} M={m}: bubble '
                         f'{prediction.bubble_fraction:.4f} in {seconds:.2f} s')
    if FLAGS.trace_out and i == 1:
      binaries.QuietTensorFlow()  # As a balance plan, pipeline_stats imports TensorFlow.
      from lingvo_gpipe.insight import pipeline_stats  # pylint: disable=g-import-not-at-top
      pipeline_stats.WriteChromeTrace(FLAGS.trace_out,
                                      pipeline_stats.Timeline.FromPrediction(prediction))
  table = bench_utils.MarkdownTable(results, [
      ('schedule', lambda r: r['schedule']), ('K', lambda r: r['stages']),
      ('M', lambda r: r['micro_batches']), ('step ms', lambda r: f"{r['step_ms']:.1f}"),
      ('bubble', lambda r: f"{r['bubble']:.4f}"),
      ('fill-drain (K-1)/(M+K-1)', lambda r: f"{r['fill_drain_theory']:.4f}"),
      ('max in flight', lambda r: r['max_in_flight']),
      ('peak activation MB/device', lambda r: f"{r['peak_activation_mb']:.1f}"),
      ('orders + simulation s', lambda r: f"{r['simulate_s']:.2f}")])
  notes = [f'Load average (1, 5, 15 min): {bench_utils.Load()}']
  bench_utils.Emit(table, results, FLAGS.json_out, notes)


if __name__ == '__main__':
  binaries.Run(main)
