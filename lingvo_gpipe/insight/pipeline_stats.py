"""Pipeline statistics of a real run: busy and idle time per stage, the measured bubble, traces.

Under `py_utils.Context(step_stats=records)` a PipeliningLayer appends one
record per schedule action it runs (step_timing.StepTracer): replica, stage (the
device), chunk, kind ('F', 'B', 'W' or 'BW'), micro_batch, and tf.timestamp()
seconds start (inputs ready), end (outputs exist) and, for a re-materialized
backward, recompute_end. This module turns
the records into numbers and pictures:

  records = []
  with py_utils.Context(step_stats=records):
    loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, loss_reduction='mean')
  timeline = pipeline_stats.Timeline.FromRecords(records)
  summary = pipeline_stats.Summarize(timeline, 'gpipe')
  print(summary.MarkdownTable())
  pipeline_stats.WriteChromeTrace('/tmp/step.json', timeline)  # ui.perfetto.dev

In a tf.function, return the records (or, for a function traced once and
called many times, StackTimes(records), with the traced records as metadata).

What is measured, so it compares with schedule.py and the simulator like with
like: a device is one (replica, stage); its busy time is the union of its
actions' [start, end] intervals, split into forward, recompute (start to
recompute_end) and backward (B, W and BW); the step window runs from the first start to the
last end; idle = window - busy, and the bubble fraction is the idle share of
devices x window, as schedule.Schedule.BubbleFraction and
simulator.Prediction.bubble_fraction define it. Besides the unit-cost theory
((K-1)/(M+K-1) for fill-drain) the summary simulates the schedule with this
run's own median F, B, W and BW time per chunk and median hand-over time per
chunk boundary: the bubble the schedule implies for these costs, so the gap
to the measured bubble is what the runtime adds beyond them (dispatch, devices
sharing cores).
"""

import dataclasses
import json

import numpy as np
import tensorflow as tf

from lingvo_gpipe.insight import simulator
from lingvo_gpipe.pipeline import cost_model
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import schedule_actions

_PASS_NAMES = {'F': 'forward', 'R': 'recompute', 'B': 'input gradient', 'W': 'weight gradient',
               'BW': 'backward'}
_KINDS = ('F', 'B', 'W', 'BW')  # Indexed by simulator.FORWARD.. BACKWARD.


def _Python(value):
  """A record field (tensor, numpy or Python value; bytes from tf.function) as Python."""
  if hasattr(value, 'numpy'):
    value = value.numpy()
  value = np.asarray(value).item()
  return value.decode() if isinstance(value, bytes) else value


def StackTimes(records):
  """[N, 3] float64 tensor of (start, end, recompute_end or NaN) of the records, in order.

  Each device's stamps are stacked on that device, so its times leave it as one
  tensor once its last action is done. Stacked elsewhere, every stamp would be
  sent off its device as soon as it exists, each send taking the device's thread
  between two of its actions: time the measured step counts as idle, more of it
  for schedules with more actions (docs/benchmarks/2026-11-29-schedules.md).
  """
  if not records:
    return tf.zeros([0, 3], tf.float64)
  by_device = {}
  for i, r in enumerate(records):
    by_device.setdefault(getattr(r.end, 'device', ''), []).append(i)
  parts = []
  for device, indices in by_device.items():
    with tf.device(device):
      nan = tf.constant(np.nan, tf.float64)
      parts.append(tf.stack([
          tf.stack([r.start, r.end, nan if r.recompute_end is None else r.recompute_end])
          for r in (records[i] for i in indices)]))
  order = [i for indices in by_device.values() for i in indices]
  return tf.gather(tf.concat(parts, 0), np.argsort(order))


@dataclasses.dataclass
class Timeline:
  """Actions of one pipelined run as parallel numpy arrays (times in seconds).

  replica, stage (device), chunk, micro_batch: int arrays; kind: int array of
  simulator.FORWARD.. BACKWARD; start, end, recompute_end: float64
  (recompute_end NaN where the action recomputed nothing).
  """
  replica: np.ndarray
  stage: np.ndarray
  chunk: np.ndarray
  kind: np.ndarray
  micro_batch: np.ndarray
  start: np.ndarray
  end: np.ndarray
  recompute_end: np.ndarray

  @classmethod
  def FromRecords(cls, records, times=None):
    """From action records; `times` ([N, 3], see StackTimes) replaces their timestamps."""
    if not records:
      raise ValueError('No step records: run the pipeline under '
                       'py_utils.Context(step_stats=records) first.')
    if times is None:
      times = [[r.get('start'), r.get('end'), r.get('recompute_end')] for r in records]
      times = [[np.nan if t is None else _Python(t) for t in row] for row in times]
    times = np.asarray(times, np.float64).reshape(-1, 3)
    if len(times) != len(records):
      raise ValueError(f'Got {len(times)} rows of times for {len(records)} records.')
    if np.isnan(times[:, :2]).any():
      raise ValueError('A step record has no start or end time.')
    kinds = [_Python(r['kind']) for r in records]
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown:
      raise ValueError(f'Unknown action kinds {unknown}; expected one of {list(_KINDS)}.')
    stage = np.array([_Python(r['stage']) for r in records], np.int64)
    return cls(replica=np.array([_Python(r.get('replica', 0)) for r in records], np.int64),
               stage=stage,
               chunk=np.array([_Python(r.get('chunk', s)) for r, s in zip(records, stage)],
                              np.int64),
               kind=np.array([_KINDS.index(k) for k in kinds], np.int64),
               micro_batch=np.array([_Python(r['micro_batch']) for r in records], np.int64),
               start=times[:, 0], end=times[:, 1], recompute_end=times[:, 2])

  @classmethod
  def FromPrediction(cls, prediction):
    """The actions of a simulator.Prediction, to trace a planned pipeline like a measured one."""
    kind, chunk, micro_batch = np.nonzero(~np.isnan(prediction.end))
    order = np.argsort(prediction.start[kind, chunk, micro_batch], kind='stable')
    kind, chunk, micro_batch = kind[order], chunk[order], micro_batch[order]
    return cls(replica=np.zeros_like(chunk), stage=np.asarray(prediction.placement)[chunk],
               chunk=chunk, kind=kind, micro_batch=micro_batch,
               start=prediction.start[kind, chunk, micro_batch],
               end=prediction.end[kind, chunk, micro_batch],
               recompute_end=np.full(chunk.shape, np.nan))

  @property
  def backward(self):
    """Whether each action is a backward one (B, W or BW)."""
    return self.kind != simulator.FORWARD

  @property
  def num_stages(self):
    return int(self.stage.max()) + 1

  @property
  def num_chunks(self):
    return int(self.chunk.max()) + 1

  @property
  def virtual_stages(self):
    return self.num_chunks // self.num_stages

  @property
  def num_micro_batches(self):
    return int(self.micro_batch.max()) + 1

  @property
  def num_replicas(self):
    return int(self.replica.max()) + 1

  def Devices(self):
    """The (replica, stage) pairs that ran actions, sorted."""
    return sorted(set(zip(self.replica.tolist(), self.stage.tolist())))

  def Placement(self):
    """The device of each chunk."""
    placement = np.zeros(self.num_chunks, np.int64)
    placement[self.chunk] = self.stage
    return placement

  def Orders(self):
    """The cost_model.OrderArrays the devices ran (record order; the first replica's)."""
    orders = [[] for _ in range(self.num_stages)]
    for replica, stage, kind, m, c in zip(self.replica.tolist(), self.stage.tolist(),
                                          self.kind.tolist(), self.micro_batch.tolist(),
                                          self.chunk.tolist()):
      if replica == 0:
        orders[stage].append(schedule_actions.Action(_KINDS[kind], m, c))
    return cost_model.ToArrays(orders, self.Placement())

  def Schedule(self):
    """The name of the schedule whose per-device orders the actions ran in, or 'custom'
    (a user's own orders). Records do not show where the loss ran: a fill-drain text
    with a loss per micro-batch reads as 'gpipe' (the trainer labels runs by their
    configured schedule)."""
    ran = self.Orders()
    for name in named_schedules.SCHEDULE_NAMES:
      try:
        orders = simulator.Orders(name, self.num_stages, self.num_micro_batches,
                                  self.virtual_stages)
      except ValueError:  # Another number of chunks per device, or of micro-batches.
        continue
      if all(np.array_equal(getattr(orders, f), getattr(ran, f))
             for f in ('kind', 'micro_batch', 'chunk', 'length', 'placement')):
        return name
    return 'custom'

  def ChunkCosts(self):
    """[4, C] median duration of each action kind (simulator.FORWARD.. BACKWARD) per chunk,
    over replicas and micro-batches; 0 where a kind did not run."""
    duration = self.end - self.start
    costs = np.zeros((4, self.num_chunks))
    for kind in range(4):
      for c in range(self.num_chunks):
        steps = duration[(self.chunk == c) & (self.kind == kind)]
        costs[kind, c] = np.median(steps) if steps.size else 0.0
    return costs

  def HandOverTimes(self):
    """[C-1] median seconds per chunk boundary from an action's end until the action on
    another device that waited for its output started (F(m, c) -> F(m, c+1), B or BW(m, c+1)
    -> B or BW(m, c)); 0 where none waited. Only actions whose device was idle count: a busy
    device hides the hand-over."""
    passes = np.where(self.kind == simulator.FORWARD, 0,
                      np.where(self.kind == simulator.WEIGHT_GRAD, -1, 1))
    step = {key: i for i, key in enumerate(zip(self.replica.tolist(), self.chunk.tolist(),
                                                passes.tolist(), self.micro_batch.tolist()))
            if key[2] >= 0}
    previous_end = np.full(self.start.shape, -np.inf)
    for replica, stage in self.Devices():
      mine = np.flatnonzero((self.replica == replica) & (self.stage == stage))
      mine = mine[np.argsort(self.start[mine], kind='stable')]
      previous_end[mine[1:]] = self.end[mine[:-1]]
    samples = [[] for _ in range(max(self.num_chunks - 1, 0))]
    for (replica, chunk, backward, m), i in step.items():
      source = chunk + 1 if backward else chunk - 1
      producer = step.get((replica, source, backward, m))
      if (producer is not None and self.stage[producer] != self.stage[i] and
          previous_end[i] < self.end[producer]):
        samples[min(chunk, source)].append(max(self.start[i] - self.end[producer], 0.0))
    return np.array([np.median(s) if s else 0.0 for s in samples])


def _UnionLength(start, end):
  """Total length covered by intervals [start_i, end_i]."""
  order = np.argsort(start, kind='stable')
  start, end = start[order], end[order]
  covered_until = np.maximum.accumulate(np.concatenate([[-np.inf], end[:-1]]))
  return float(np.sum(np.maximum(end - np.maximum(start, covered_until), 0.0)))


@dataclasses.dataclass
class DeviceStats:
  """Seconds one device (replica, stage) spent per pass, busy in all, and idle in the window."""
  replica: int
  stage: int
  forward: float
  recompute: float
  backward: float
  busy: float
  idle: float


@dataclasses.dataclass
class Summary:
  """A step's pipeline statistics (see the module docstring for the definitions)."""
  schedule: str
  num_stages: int
  num_micro_batches: int
  num_replicas: int
  step_time: float
  bubble_fraction: float
  theoretical_bubble: float
  simulated_bubble: float
  devices: list
  # What the simulation took: per chunk, the median seconds of each action kind ('F', 'B',
  # 'W', 'BW'; 0 where none ran), and per chunk boundary the median hand-over seconds.
  chunk_costs: dict
  hand_over_times: list

  def AsDict(self):
    return dataclasses.asdict(self)

  def Scalars(self, prefix='pipeline'):
    """Flat name -> value, for TensorBoard: the bubble fractions and per-device seconds."""
    scalars = {f'{prefix}/bubble_fraction': self.bubble_fraction,
               f'{prefix}/bubble_fraction_theory': self.theoretical_bubble,
               f'{prefix}/bubble_fraction_simulated': self.simulated_bubble,
               f'{prefix}/step_time': self.step_time}
    for d in self.devices:
      name = f'stage{d.stage}' if self.num_replicas == 1 else f'replica{d.replica}_stage{d.stage}'
      for field in ('forward', 'recompute', 'backward', 'busy', 'idle'):
        scalars[f'{prefix}/{name}/{field}'] = getattr(d, field)
    return scalars

  def MarkdownTable(self):
    """Per-device milliseconds and the bubble, measured, simulated and in theory."""
    lines = [f'{self.schedule}: K={self.num_stages}, M={self.num_micro_batches}, step '
             f'{self.step_time * 1e3:.1f} ms; bubble measured {self.bubble_fraction:.3f}, '
             f'simulated with these stage and hand-over costs {self.simulated_bubble:.3f}, '
             f'unit-cost theory {self.theoretical_bubble:.3f}', '',
             '| replica | stage | forward ms | recompute ms | backward ms | busy ms | idle ms |',
             '|---|---|---|---|---|---|---|']
    for d in self.devices:
      lines.append(f'| {d.replica} | {d.stage} | {d.forward * 1e3:.1f} | {d.recompute * 1e3:.1f} '
                   f'| {d.backward * 1e3:.1f} | {d.busy * 1e3:.1f} | {d.idle * 1e3:.1f} |')
    return '\n'.join(lines)


def Summarize(timeline, schedule=None):
  """The step's Summary; `schedule` names the schedule that ran, None to read it off the steps."""
  schedule = schedule or timeline.Schedule()
  window = float(timeline.end.max() - timeline.start.min())
  devices = []
  for replica, stage in timeline.Devices():
    mine = (timeline.replica == replica) & (timeline.stage == stage)
    fwd, bwd = mine & ~timeline.backward, mine & timeline.backward
    recomputed = bwd & ~np.isnan(timeline.recompute_end)
    recompute = float(np.sum(timeline.recompute_end[recomputed] - timeline.start[recomputed]))
    busy = _UnionLength(timeline.start[mine], timeline.end[mine])
    devices.append(DeviceStats(
        replica=replica, stage=stage,
        forward=float(np.sum(timeline.end[fwd] - timeline.start[fwd])), recompute=recompute,
        backward=float(np.sum(timeline.end[bwd] - timeline.start[bwd])) - recompute,
        busy=busy, idle=window - busy))
  idle = sum(d.idle for d in devices)
  orders = timeline.Orders()
  costs = timeline.ChunkCosts()
  forward, input_grad, weight_grad, backward = costs
  hand_over = timeline.HandOverTimes()
  return Summary(
      schedule=schedule, num_stages=timeline.num_stages,
      num_micro_batches=timeline.num_micro_batches, num_replicas=timeline.num_replicas,
      step_time=window, bubble_fraction=idle / (len(devices) * window) if window > 0 else 0.0,
      theoretical_bubble=simulator.Simulate(  # Unit costs: Schedule.BubbleFraction's.
          orders, 1.0, 2.0, input_grad_cost=1.0, weight_grad_cost=1.0).bubble_fraction,
      simulated_bubble=simulator.Simulate(
          orders, forward, backward, hand_over,
          input_grad_cost=input_grad, weight_grad_cost=weight_grad).bubble_fraction,
      devices=devices, chunk_costs=dict(zip(_KINDS, costs.tolist())),
      hand_over_times=hand_over.tolist())


def ChromeTrace(timeline, device_names=None):
  """The timeline as Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev).

  One process per replica, one thread (track) per device, one complete event
  per action: F (forward), R (recompute), B (input gradient), W (weight
  gradient), BW (fused backward), named with the micro-batch (and the chunk
  when a device holds several); times in microseconds from the first start.

  Args:
    timeline: a Timeline.
    device_names: optional {(replica, stage): name} for the track names.
  """
  t0 = timeline.start.min()
  events = []
  for replica in sorted(set(timeline.replica.tolist())):
    events.append(dict(ph='M', name='process_name', pid=replica, tid=0,
                       args=dict(name=f'replica {replica}')))
  for replica, stage in timeline.Devices():
    name = (device_names or {}).get((replica, stage), f'stage {stage}')
    events.append(dict(ph='M', name='thread_name', pid=replica, tid=stage,
                       args=dict(name=name)))
    events.append(dict(ph='M', name='thread_sort_index', pid=replica, tid=stage,
                       args=dict(sort_index=stage)))

  def Span(i, kind, start, end):
    m, c = int(timeline.micro_batch[i]), int(timeline.chunk[i])
    name = f'{kind}{m}' + (f'.{c}' if timeline.virtual_stages > 1 else '')
    events.append(dict(ph='X', name=name, cat=_PASS_NAMES[kind],
                       pid=int(timeline.replica[i]), tid=int(timeline.stage[i]),
                       ts=(start - t0) * 1e6, dur=(end - start) * 1e6,
                       args={'cell': c, 'micro_batch': m, 'pass': _PASS_NAMES[kind]}))

  for i in np.argsort(timeline.start, kind='stable'):
    start, end, recomputed = timeline.start[i], timeline.end[i], timeline.recompute_end[i]
    kind = _KINDS[timeline.kind[i]]
    if np.isnan(recomputed):
      Span(i, kind, start, end)
    else:
      Span(i, 'R', start, recomputed)
      Span(i, kind, recomputed, end)
  return dict(traceEvents=events, displayTimeUnit='ms')


def WriteChromeTrace(path, timeline, device_names=None):
  """Writes ChromeTrace(timeline) as JSON to `path`."""
  with open(path, 'w') as f:
    json.dump(ChromeTrace(timeline, device_names), f)
