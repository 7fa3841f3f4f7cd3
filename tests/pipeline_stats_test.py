"""Tests of lingvo_gpipe.insight.pipeline_stats: hand-made timelines and real pipelines."""

import collections
import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.insight import pipeline_stats
from lingvo_gpipe.insight import simulator
from lingvo_gpipe.pipeline import cell_functions
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import schedule

T0 = 100.0


def _Record(stage, kind, m, start, end, recompute_end=None, replica=0):
  return py_utils.NestedMap(replica=replica, stage=stage, kind=kind, micro_batch=m,
                            start=T0 + start, end=T0 + end,
                            recompute_end=None if recompute_end is None else T0 + recompute_end)


def _HandRecords():
  """K=2, M=2 fill-drain, F=1, BW=2 and a hand-over of 0.5 (simulator_test's timeline);
  stage 0 re-materializes (its backward recomputes for 1), stage 1 does not."""
  return [
      _Record(0, 'F', 0, 0, 1), _Record(0, 'F', 1, 1, 2),
      _Record(1, 'F', 0, 1.5, 2.5), _Record(1, 'F', 1, 2.5, 3.5),
      _Record(1, 'BW', 1, 3.5, 5.5), _Record(1, 'BW', 0, 5.5, 7.5),
      _Record(0, 'BW', 1, 6, 8, recompute_end=7), _Record(0, 'BW', 0, 8, 10, recompute_end=9),
  ]


def testSummaryOfAHandMadeTimeline():
  summary = pipeline_stats.Summarize(pipeline_stats.Timeline.FromRecords(_HandRecords()))
  assert (summary.num_stages, summary.num_micro_batches, summary.num_replicas) == (2, 2, 1)
  assert summary.step_time == pytest.approx(10.0)
  # Each stage busy 6 of 10: a 0.4 bubble, above the 1/3 of unit costs because of hand-overs.
  assert summary.bubble_fraction == pytest.approx(0.4)
  assert summary.theoretical_bubble == pytest.approx(schedule.TheoreticalBubble(2, 2))
  # Median stage costs F=1, B=2 and the 0.5 hand-over reproduce the timeline: same bubble.
  assert summary.simulated_bubble == pytest.approx(0.4)
  assert summary.chunk_costs == {'F': [1, 1], 'B': [0, 0], 'W': [0, 0], 'BW': [2, 2]}
  assert summary.hand_over_times == pytest.approx([0.5])
  stage0, stage1 = summary.devices
  assert (stage0.forward, stage0.recompute, stage0.backward) == pytest.approx((2, 2, 2))
  assert (stage1.forward, stage1.recompute, stage1.backward) == pytest.approx((2, 0, 4))
  assert (stage0.busy, stage0.idle, stage1.busy, stage1.idle) == pytest.approx((6, 4, 6, 4))
  scalars = summary.Scalars()
  assert scalars['pipeline/bubble_fraction'] == pytest.approx(0.4)
  assert scalars['pipeline/stage0/recompute'] == pytest.approx(2.0)
  assert '| 0 | 0 | 2000.0 | 2000.0 | 2000.0 | 6000.0 | 4000.0 |' in summary.MarkdownTable()


def testOverlappingStepsCountOnceAsBusy():
  records = [_Record(0, 'F', 0, 0, 2), _Record(0, 'F', 1, 1, 3), _Record(0, 'BW', 1, 5, 6),
             _Record(0, 'BW', 0, 6, 8)]
  (device,) = pipeline_stats.Summarize(pipeline_stats.Timeline.FromRecords(records)).devices
  assert device.forward == pytest.approx(4.0)  # The sum of the steps ...
  assert device.busy == pytest.approx(6.0)  # ... but [0, 3] + [5, 8] of wall time.
  assert device.idle == pytest.approx(2.0)


def testChromeTrace():
  timeline = pipeline_stats.Timeline.FromRecords(_HandRecords())
  trace = json.loads(json.dumps(pipeline_stats.ChromeTrace(
      timeline, device_names={(0, 0): '/device:CPU:0', (0, 1): '/device:CPU:1'})))
  tracks = {e['tid']: e['args']['name'] for e in trace['traceEvents']
            if e['ph'] == 'M' and e['name'] == 'thread_name'}
  assert tracks == {0: '/device:CPU:0', 1: '/device:CPU:1'}
  spans = {(e['tid'], e['name']): (e['ts'], e['dur'], e['cat']) for e in trace['traceEvents']
           if e['ph'] == 'X'}
  # 8 actions, two of which split into a recompute and a backward span.
  assert len(spans) == 10
  assert spans[(0, 'R1')] == pytest.approx((6e6, 1e6, 'recompute'))
  assert spans[(0, 'BW1')][:2] == pytest.approx((7e6, 1e6))
  assert spans[(1, 'F1')] == pytest.approx((2.5e6, 1e6, 'forward'))
  assert spans[(1, 'BW0')] == pytest.approx((5.5e6, 2e6, 'backward'))


NAMED = [('gpipe', 1), ('1f1b', 1), ('interleaved_1f1b', 2), ('zb_h1', 1), ('zb_h2', 1),
         ('zbv', 2)]


@pytest.mark.parametrize('name,v', NAMED)
def testSimulatedTimelineSummarizesToItsPrediction(name, v):
  rng = np.random.default_rng(3)
  m = 3 if name == 'interleaved_1f1b' else 5
  prediction = simulator.Simulate(simulator.Orders(name, 3, m, v), rng.uniform(1, 2, (3 * v, m)),
                                  rng.uniform(2, 4, (3 * v, m)), transfer_cost=0.25)
  timeline = pipeline_stats.Timeline.FromPrediction(prediction)
  summary = pipeline_stats.Summarize(timeline, name)
  assert summary.step_time == pytest.approx(prediction.step_time)
  assert summary.bubble_fraction == pytest.approx(prediction.bubble_fraction)
  np.testing.assert_allclose([d.busy for d in summary.devices], prediction.busy)


@pytest.mark.parametrize('name,v', NAMED)
def testHandOverTimesRecoverTheSimulatedOnes(name, v):
  """Per-boundary hand-overs put into the simulator come back out of its timeline, and the
  summary's simulation with unit costs then reproduces the simulated bubble exactly."""
  transfers = [0.25, 0.75, 0.5, 0.5, 0.125][:3 * v - 1]
  prediction = simulator.Simulate(simulator.Orders(name, 3, 6, v), 1.0, 2.0,
                                  transfer_cost=transfers)
  timeline = pipeline_stats.Timeline.FromPrediction(prediction)
  placement = np.asarray(prediction.placement)
  crossing = placement[1:] != placement[:-1]  # Boundaries inside a device cost nothing.
  np.testing.assert_allclose(timeline.HandOverTimes(), np.where(crossing, transfers, 0.0))
  summary = pipeline_stats.Summarize(timeline, name)
  assert summary.simulated_bubble == pytest.approx(prediction.bubble_fraction)


def testHandOverTimesCountOnlyStepsThatWaited():
  records = [
      _Record(0, 'F', 0, 0, 1), _Record(0, 'F', 1, 1, 2),
      # Stage 1 waits 0.5 for micro-batch 0; micro-batch 1 arrives while it is busy.
      _Record(1, 'F', 0, 1.5, 4), _Record(1, 'F', 1, 4, 5),
      # Overlapping timestamps (stage 0 recorded its start before stage 1's end): clipped to 0.
      _Record(1, 'BW', 1, 5, 6), _Record(1, 'BW', 0, 6, 7), _Record(0, 'BW', 1, 5.9, 8),
      _Record(0, 'BW', 0, 8, 9),
  ]
  timeline = pipeline_stats.Timeline.FromRecords(records)
  # Samples: F(0,1) waited 0.5, B(1,0) waited max(5.9 - 6, 0) = 0; the median of the two.
  np.testing.assert_allclose(timeline.HandOverTimes(), [0.25])
  one_stage = pipeline_stats.Timeline.FromRecords(records[:2] + records[7:])
  assert one_stage.HandOverTimes().shape == (0,)


def testBadRecords():
  with pytest.raises(ValueError, match='No step records'):
    pipeline_stats.Timeline.FromRecords([])
  with pytest.raises(ValueError, match=r"Unknown action kinds \['X'\]"):
    pipeline_stats.Timeline.FromRecords([_Record(0, 'X', 0, 0, 1)])
  with pytest.raises(ValueError, match='Got 2 rows of times for 1 records'):
    pipeline_stats.Timeline.FromRecords([_Record(0, 'F', 0, 0, 1)], np.zeros((2, 3)))


def testAUsersOwnOrderIsSummarizedAsItRan():
  """Backwards in forward order, a custom order: its unit-cost bubble is that of the orders
  that ran, as schedule.Schedule clocks them."""
  records = [
      _Record(0, 'F', 0, 0, 1), _Record(0, 'F', 1, 1, 2),
      _Record(1, 'F', 0, 1.5, 2.5), _Record(1, 'F', 1, 2.5, 3.5),
      _Record(1, 'BW', 0, 3.5, 5.5), _Record(1, 'BW', 1, 5.5, 7.5),
      _Record(0, 'BW', 0, 6, 8), _Record(0, 'BW', 1, 8, 10),
  ]
  summary = pipeline_stats.Summarize(pipeline_stats.Timeline.FromRecords(records))
  assert summary.schedule == 'custom'
  text = ('schedule custom K=2 M=2 v=1\n'
          'device0: F0@0 F1@0 BW0@0 BW1@0\n'
          'device1: F0@1 F1@1 L*@1 BW0@1 BW1@1\n')
  assert summary.theoretical_bubble == pytest.approx(
      schedule.Schedule.FromText(text).BubbleFraction())
  assert summary.bubble_fraction == pytest.approx(0.4)
  assert summary.simulated_bubble == pytest.approx(0.4)  # F=1, BW=2, hand-over 0.5.


# -- real pipelines ---------------------------------------------------------------------

BATCH, DIM = 16, 8


def _Pipe(num_stages, num_micro_batches, remat, sched='gpipe'):
  v = dict(NAMED)[sched]
  layer = layers.TransformerFeedForwardLayer.Params().Set(input_dim=DIM, hidden_dim=16)
  cells = gpipe.PartitionSequentialLayers([layer.Copy() for _ in range(4)], num_stages * v,
                                          tf.TensorShape([BATCH, DIM]))
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=num_micro_batches, remat=remat,
      schedule=sched, virtual_stages=v).Instantiate()


def _Loss(y):
  return tf.reduce_mean(tf.square(y - 0.5))


def _CheckTimeline(timeline, num_stages, num_micro_batches, remat, sched='gpipe'):
  sched_obj = schedule.Schedule(sched, num_stages, num_micro_batches, dict(NAMED)[sched])
  steps = sorted(zip(timeline.chunk.tolist(), timeline.kind.tolist(),
                     timeline.micro_batch.tolist()))
  kinds = {'F': 0, 'B': 1, 'W': 2, 'BW': 3}
  assert steps == sorted((a.chunk, kinds[a.kind], a.micro_batch) for order in sched_obj.orders
                         for a in order if a.kind != 'L')
  assert np.all(timeline.start <= timeline.end)
  recomputed = ~np.isnan(timeline.recompute_end)
  # A BW recomputes as remat says; a B always does (W takes what it hands over).
  expected = (timeline.kind == 1) | ((timeline.kind == 3) & {
      'always': True, 'never': False,
      'except_last': timeline.micro_batch < num_micro_batches - 1}[remat])
  np.testing.assert_array_equal(recomputed, expected)
  assert np.all(timeline.start[recomputed] <= timeline.recompute_end[recomputed])
  assert np.all(timeline.recompute_end[recomputed] <= timeline.end[recomputed])
  summary = pipeline_stats.Summarize(timeline)
  assert summary.schedule == sched
  assert 0.0 <= summary.bubble_fraction <= 1.0
  assert all(0 <= d.busy <= summary.step_time * (1 + 1e-9) for d in summary.devices)


@pytest.mark.parametrize('k,m,remat,sched', [(2, 4, 'except_last', 'gpipe'),
                                             (4, 2, 'always', '1f1b'),
                                             (2, 4, 'always', 'zb_h1'),
                                             (2, 2, 'never', 'zbv')])
def testMeasuringChangesNoResultEagerAndInTfFunction(k, m, remat, sched):
  pipe = _Pipe(k, m, remat, sched)
  x = tf.random.stateless_normal([BATCH, DIM], [1, 2])

  def Step(records):
    with py_utils.Context(step_stats=records):
      return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')

  def AssertSame(measured, plain):
    # Measuring runs the same math; a step function traced with stamps may
    # round differently, so equal to the tolerance of the exactness tests.
    for a, b in zip(tf.nest.flatten(measured), tf.nest.flatten(plain)):
      np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)

  plain = Step(None)
  records = []
  AssertSame(Step(records), plain)
  _CheckTimeline(pipeline_stats.Timeline.FromRecords(records), k, m, remat, sched)

  @tf.function
  def Measured():
    records = []
    return Step(records), records

  measured, fn_records = Measured()
  AssertSame(measured, plain)
  _CheckTimeline(pipeline_stats.Timeline.FromRecords(fn_records), k, m, remat, sched)


def testAMeasuredStepIsTracedOnce():
  """The clocks' variables are made with the pipeline: made by the step's trace, they made
  tf.function trace the step again (as would the gradient sums, made here first)."""
  pipe = _Pipe(2, 2, 'always', '1f1b')
  cell_functions.CreateGradientSums(pipe)
  x = tf.random.stateless_normal([BATCH, DIM], [1, 2])
  traces = []

  @tf.function
  def Measured():
    traces.append(True)
    records = []
    with py_utils.Context(step_stats=records, step=tf.constant(0, tf.int64)):
      loss, _ = pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
    return loss, [r.end for r in records]

  _, ends = Measured()
  assert len(traces) == 1 and len(ends) == 2 * 2 * 2  # F and BW of 2 chunks x 2 micro-batches.


def testStackTimesOfATracedFunctionAndTapeBackward():
  """A function traced once keeps its records as metadata and returns only the times."""
  pipe = _Pipe(2, 2, 'always')
  x = tf.random.stateless_normal([BATCH, DIM], [3, 4])
  traced = []

  @tf.function
  def Step():
    traced.clear()
    with py_utils.Context(step_stats=traced):
      with tf.GradientTape() as tape:
        loss = _Loss(pipe(x))
      grads = tape.gradient(loss, pipe.trainable_variables)  # Appends the backward records.
    return grads, pipeline_stats.StackTimes(traced)

  for _ in range(2):
    _, times = Step()
    timeline = pipeline_stats.Timeline.FromRecords(traced, times.numpy())
    _CheckTimeline(timeline, 2, 2, 'always')
    np.testing.assert_array_equal(timeline.end, times.numpy()[:, 1])


def _StepOf(op_name):
  """(chunk, kind, micro_batch) of an op in a pipeline action's name scope, else None."""
  match = re.match(r'(?:gradient_tape/)?chunk(\d+)_([FBW]+)(\d+)/', op_name)
  return (int(match[1]), match[2], int(match[3])) if match else None


def _MeasuredGraph(pipe):
  """The graph of a traced forward-backward step with the step statistics on."""
  x = tf.random.stateless_normal([BATCH, DIM], [1, 2])

  @tf.function
  def Step():
    records = []
    with py_utils.Context(step_stats=records):
      return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean'), records

  return Step.get_concrete_function().graph


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testMeasuringAddsNoWaitBetweenStages(sched):
  """In the measured graph an action waits only for its device and its schedule
  dependencies."""
  pipe = _Pipe(2, 2, 'always', sched)
  for op in _MeasuredGraph(pipe).get_operations():
    step = _StepOf(op.name)
    if step is None:
      continue
    c, kind, m = step
    allowed = {(c - 1, 'F', m)} | ({(c + 1, 'B', m), (c + 1, 'BW', m)} if 'B' in kind else set())
    for other in [t.op for t in op.inputs] + list(op.control_inputs):
      waits_on = _StepOf(other.name)
      assert (waits_on is None or pipe.placement[waits_on[0]] == pipe.placement[c] or
              waits_on in allowed), f'{op.name} waits for {other.name}'


def testEveryStampNamesItsDeviceInsideItsCall():
  """A stamp's timestamp op carries its stage's device inside the call: inlined without one,
  it ran on the first worker process for every stage, and a later stage's actions waited for
  round trips to it."""
  pipe = _Pipe(2, 2, 'never', '1f1b')
  graph = _MeasuredGraph(pipe)
  library = {f.signature.name: f for f in graph.as_graph_def().library.function}
  stamped = collections.Counter()
  for op in graph.get_operations():
    step = _StepOf(op.name)
    if op.type != 'StatefulPartitionedCall' or step is None:
      continue
    body = library[op.get_attr('f').name]
    timestamps = [n.device for n in body.node_def if n.op == 'Timestamp']
    if not timestamps:
      continue
    (device,) = timestamps
    want = tf.DeviceSpec.from_string(pipe.devices[pipe.placement[step[0]]])
    got = tf.DeviceSpec.from_string(device)
    assert (got.device_type, got.device_index) == (want.device_type, want.device_index), (
        f'{op.name} stamps on {device!r}, not on {want.to_string()!r}')
    stamped[pipe.placement[step[0]]] += 1
  assert stamped == {0: 8, 1: 8}  # Start and end of F and BW of 2 micro-batches per stage.


def testStackTimesKeepsEachStampOnItsDevice():
  """A stamp sent off its device as soon as it exists costs that device's thread a send
  between two actions (0.1-0.2 ms each on two worker processes, counted as idle): each
  device's stamps are stacked where they are taken, and only the stacks leave."""
  pipe = _Pipe(2, 2, 'never', 'zb_h1')
  x = tf.random.stateless_normal([BATCH, DIM], [1, 2])
  records = []

  @tf.function
  def Step():
    records.clear()
    with py_utils.Context(step_stats=records):
      pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
    return pipeline_stats.StackTimes(records)

  graph = Step.get_concrete_function().graph
  stamps = {t.ref() for r in records for t in (r.start, r.end)}
  crossings = []
  for op in graph.get_operations():
    for t in op.inputs:
      if t.ref() in stamps and tf.DeviceSpec.from_string(op.device) != tf.DeviceSpec.from_string(
          t.device):
        crossings.append(f'{t.name} on {t.device!r} read by {op.name} on {op.device!r}')
  assert not crossings, crossings[:3]
  # Still each record's own times, in the records' order.
  timeline = pipeline_stats.Timeline.FromRecords(records, Step().numpy())
  _CheckTimeline(timeline, 2, 2, 'never', 'zb_h1')

# -- the trainer's --pipeline_stats_every ------------------------------------------------

_PARAMS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'testdata', 'params')


def _StartTrainer(logdir, *flags):
  env = dict(os.environ, LINGVO_GPIPE_PARAMS=_PARAMS_DIR, TF_CPP_MIN_LOG_LEVEL='2')
  return subprocess.Popen(
      [sys.executable, '-m', 'lingvo_gpipe.runners.trainer',
       '--model=toy.regression.PipelinedRegression', f'--logdir={logdir}', '--max_steps=4',
       *flags],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _Scalars(directory):
  scalars = {}
  for path in glob.glob(os.path.join(directory, 'events.out.tfevents.*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        array = tf.make_ndarray(value.tensor)
        if array.dtype.kind == 'f':  # Not the text summaries.
          scalars.setdefault(value.tag, {})[event.step] = float(array)
  return scalars


def testTrainerWritesPipelineStatisticsAndTrainsTheSame(tmp_path):
  """The toy experiment: K=2 stages, M=2 micro-batches, remat 'always', steps of 8 rows."""
  runs = {name: _StartTrainer(tmp_path / name, *flags) for name, flags in
          (('plain', ()), ('measured', ('--pipeline_stats_every=2',)))}
  for proc in runs.values():
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
  train_dir = str(tmp_path / 'measured' / 'train')
  scalars = _Scalars(train_dir)
  # Step 2, the first measured, traced its function: its times (a spike) are not written.
  assert sorted(scalars['pipeline/bubble_fraction']) == [4]
  assert scalars['pipeline/bubble_fraction_theory'][4] == pytest.approx(1 / 3)
  for tag in ('stage0/forward', 'stage1/recompute', 'stage1/busy', 'stage0/idle'):
    assert sorted(scalars[f'pipeline/{tag}']) == [4]
  assert 'pipeline/bubble_fraction' not in _Scalars(str(tmp_path / 'plain' / 'train'))
  assert not os.path.exists(os.path.join(train_dir, 'pipeline_trace_2.json'))
  with open(os.path.join(train_dir, 'pipeline_trace_4.json')) as f:
    events = json.load(f)['traceEvents']
  spans = [e for e in events if e['ph'] == 'X']
  tracks = sorted(e['args']['name'] for e in events if e['name'] == 'thread_name')
  assert tracks == ['/device:CPU:0', '/device:CPU:1'], tracks  # Named by their devices.
  assert sorted(e['name'] for e in spans) == sorted(
      ['F0', 'F1', 'R0', 'R1', 'BW0', 'BW1'] * 2)
  checkpoints = [
      tf.train.load_checkpoint(tf.train.latest_checkpoint(str(tmp_path / name / 'train')))
      for name in ('plain', 'measured')]
  names = checkpoints[0].get_variable_to_shape_map()
  assert names == checkpoints[1].get_variable_to_shape_map()
  for name in names:
    measured, plain = (np.asarray(c.get_tensor(name)) for c in reversed(checkpoints))
    if plain.dtype.kind == 'f':
      np.testing.assert_allclose(measured, plain, rtol=1e-5, atol=1e-7)
    else:
      np.testing.assert_array_equal(measured, plain)
