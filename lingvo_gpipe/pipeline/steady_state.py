"""Where a schedule repeats itself: the stretches a pipelined pass runs as one loop.

A schedule's steady state does the same actions over and over, each time for
micro-batches `stride` further on: 1F1B's is one forward and one backward per
stage. Traced one call op per action, a pass at K=8, M=64 is a thousand calls,
each taking every weight of its chunk as an input: tracing, Grappler and
placement then grow with the calls (docs/benchmarks/2026-12-02-startup.md). Run
as a tf.while_loop over one period, the calls are traced once, whatever M. The
actions, their order on each device and their inputs stay the schedule's
(executor.Pass runs the period's actions with the micro-batch of each iteration).
What the period makes for after the loop (fill-drain's stash of inputs for the
backward) leaves it in TensorArrays, and what it takes from before (the stash,
in the backward) is fed to it from them (_Plan).
"""

import copy
import dataclasses

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import schedule_actions

MIN_REPEATS = 3  # Fewer repeats save less than a loop's set-up costs.
# loop_steady_state='auto' loops a program whose windows hold this many instructions: unrolled,
# about 3 s of start-up on a 2-core CPU (docs/benchmarks/2026-12-07-startup.md).
AUTO_MIN_INSTRUCTIONS = 256


@dataclasses.dataclass(frozen=True)
class Window:
  """Actions [start, start + period * repeats) of a list: the period's actions, repeated
  with every micro-batch `stride` further on each time."""
  start: int
  period: int
  repeats: int
  stride: int

  @property
  def end(self):
    return self.start + self.period * self.repeats


def _Repeats(a, b, stride, same):
  """Whether action b is action a for the micro-batch `stride` further on."""
  return (a.kind == b.kind and a.chunk == b.chunk and
          a.micro_batch != schedule_actions.ALL and b.micro_batch == a.micro_batch + stride and
          same(a, b))


def _LongestRun(actions, start, period, stride, same):
  """(first index, repeats) of the longest periodic stretch from `start` on."""
  best, run_start, run = (start, 0), start, 0
  for j in range(start, len(actions) - period):
    if _Repeats(actions[j], actions[j + period], stride, same):
      run += 1
      repeats = run // period + 1
      if repeats > best[1]:
        best = (run_start, repeats)
    else:
      run_start, run = j + 1, 0
  return best


def _Periods(actions, stride):
  """Candidate periods: `stride` micro-batches' actions of some of the kinds (a phase of
  forwards only, of forwards and backwards, with or without losses)."""
  kinds = {}
  for a in actions:
    if a.micro_batch == 0:
      kinds[a.kind] = kinds.get(a.kind, 0) + 1
  counts = {0}
  for count in kinds.values():
    counts |= {c + count for c in counts}
  return sorted(abs(stride) * c for c in counts if c)


def Windows(actions, same=lambda a, b: True, max_stride=8):
  """Non-overlapping Windows of `actions` (a schedule's, in the order they run), in order.

  No window holds the first action of a kind and chunk (nor so the first loss):
  what their traces make (gradient sums) is made once,
  before. `same(a, b)` says whether two actions of one kind and chunk may share
  one trace (their micro-batches are alike: size, re-materialized or not).
  """
  firsts = {}
  for i, a in enumerate(actions):
    firsts.setdefault((a.kind, a.chunk), i)

  def Best(lo, hi):
    best = None
    for stride in [s for s in range(-max_stride, max_stride + 1) if s]:
      for period in _Periods(actions, stride):
        first, repeats = _LongestRun(actions[:hi], lo, period, stride, same)
        end = first + period * repeats
        # Start after the first action of each kind and chunk inside.
        first = max([first] + [firsts[(a.kind, a.chunk)] + 1 for a in actions[first:end]])
        repeats = (end - first) // period
        if repeats >= MIN_REPEATS and (best is None or period * repeats > best.period *
                                       best.repeats):
          best = Window(first, period, repeats, stride)
    return best

  def Within(lo, hi):
    best = Best(lo, hi)
    return [] if best is None else Within(lo, best.start) + [best] + Within(best.end, hi)

  return Within(0, len(actions))


def CheckSetting(setting):
  """ValueError unless `setting` is one of loop_steady_state's: True, False or 'auto'."""
  if not (isinstance(setting, bool) or setting == 'auto'):
    raise ValueError(f"loop_steady_state must be True, False or 'auto', got {setting!r}.")


def Looped(windows, params):
  """Those of a program's `windows` that a PipeliningLayer with `params` runs as loops: all
  (loop_steady_state True), none (False; 'auto' with inline_cell_functions), or under 'auto'
  all where together they hold AUTO_MIN_INSTRUCTIONS."""
  setting = params.loop_steady_state
  if setting is True:
    return windows
  if (setting == 'auto' and not params.inline_cell_functions and
      sum(w.end - w.start for w in windows) >= AUTO_MIN_INSTRUCTIONS):
    return windows
  return []


def LoopsIn(graph):
  """How many windows a traced step's graph runs as loops."""
  return sum(f.signature.name.startswith('__inference_steady_state_')
             for f in graph.as_graph_def().library.function)


# -- running a window as a loop ------------------------------------------------------------------

# The Pass dicts that carry values from one action to a later one, keyed by (micro-batch,
# chunk): what is in flight at a window's start goes round the loop as its variables.
_CARRIED = ('inputs', 'out_grads', 'act_grads', 'pending_w', 'to_losses')


class NotPeriodic(Exception):
  """A period's actions left other values in flight than they found: no loop."""


def _Shifted(values, by):
  """`values` keyed by (micro-batch, chunk) or micro-batch, `by` micro-batches further."""
  return {(key[0] + by, key[1]) if isinstance(key, tuple) else key + by: v
          for key, v in values.items()}


def _Key(key, by):
  return (key[0] + by, key[1]) if isinstance(key, tuple) else key + by


class _Reads(dict):
  """A carried dict that records the keys the period's actions look up (_Plan.Of)."""

  def __init__(self, values, read):
    super().__init__(values)
    self._read = read

  def __getitem__(self, key):
    self._read.add(key)
    return super().__getitem__(key)

  def __contains__(self, key):
    self._read.add(key)
    return super().__contains__(key)

  def get(self, key, default=None):
    self._read.add(key)
    return super().get(key, default)

  def pop(self, key, *default):
    self._read.add(key)
    return super().pop(key, *default)


@dataclasses.dataclass
class _Plan:
  """Which in-flight values of a period that does not leave what it found (fill-drain's
  stash of inputs for the backward) take which way, as (dict name, key) in the first
  iteration's micro-batches: `carried` go round the loop; `fed` come, per iteration, from
  what was in flight before it (keys `stride` further each time); `stashed`, made by each
  iteration for after the loop, leave it in TensorArrays (`specs`); what the period does not
  look up stays outside the loop."""
  carried: list
  fed: list
  stashed: list
  specs: list

  @classmethod
  def Of(cls, begin, one, reads, stride, repeats):
    """The plan of a period traced from `begin` (_Carried at its start) to the Pass `one`,
    whose actions looked up the keys `reads`; None if it leaves what it found.

    A value the period looks up is carried if the next iteration's is one it makes, or one
    in flight that it leaves alone (which is then carried too: a value in flight for
    several iterations); fed if the next iteration's was in flight before the loop (a
    fill-drain's backward takes its stash so). What the period makes and no next
    iteration takes is stashed.
    """
    carried, fed, stashed, outside = [], [], [], []
    afters = {name: dict(getattr(one, name)) for name in _CARRIED}
    for name in _CARRIED:
      before, after = begin[name], afters[name]
      untouched = {k for k, v in before.items() if k not in reads[name] and after.get(k) is v}
      made = set(after) - untouched
      slots = set()
      for k in set(before) - untouched:
        chain = [k]
        while _Key(chain[-1], stride) in untouched:
          chain.append(_Key(chain[-1], stride))
        if _Key(chain[-1], stride) in made:
          slots.update(chain)
        elif len(chain) >= repeats and not slots & set(chain):  # Iteration r's is chain[r].
          fed.append((name, k))
          untouched -= set(chain)
        else:
          raise NotPeriodic(f'{name} {k} is not in flight for every iteration')
      carried += [(name, k) for k in slots]
      stashed += [(name, k) for k in made if _Key(k, -stride) not in slots]
      outside += [(name, k) for k in untouched - slots]
      later = {_Key(k, r * stride) for k in reads[name] | made for r in range(1, repeats)}
      if later & (untouched - slots):
        raise NotPeriodic(f'a later iteration looks up {name} that the first leaves alone')
    if not fed and not stashed and not outside:
      return None
    stashed.sort(key=str)
    specs = [(x.dtype, x.shape) for name, k in stashed for x in _Split(afters[name][k])[0]]
    return cls(sorted(carried, key=str), sorted(fed, key=str), stashed, specs)


def _Carried(one, shift=0):
  """What one Pass holds in flight, keyed by the iteration's first micro-batches (`shift`:
  how far the keys are ahead of them)."""
  state = {name: _Shifted(getattr(one, name), -shift) for name in _CARRIED}
  state.update(tokens=list(one.tokens), earlier_tokens=list(one.earlier_tokens),
               last_adds=list(one.last_adds))
  return state


def _SetCarried(one, state, shift=0):
  for name in _CARRIED:
    setattr(one, name, _Shifted(state[name], shift))
  one.tokens, one.earlier_tokens = list(state['tokens']), list(state['earlier_tokens'])
  one.last_adds = list(state['last_adds'])


_TENSOR = object()  # Where _Split took a tensor out.


def _Split(structure):
  """(tensors, the other leaves) of a structure's leaves."""
  leaves = tf.nest.flatten(structure)
  return ([x for x in leaves if isinstance(x, tf.Tensor)],
          [_TENSOR if isinstance(x, tf.Tensor) else x for x in leaves])


def _Joined(structure, tensors, rest):
  it = iter(tensors)
  return tf.nest.pack_sequence_as(structure, [next(it) if x is _TENSOR else x for x in rest])


def _Marks(one):
  """What one Pass has left for after the pass so far (for _LeftSince)."""
  return set(one.outputs), set(one.input_grads), len(one.losses)


def _LeftSince(one, marks):
  """(kind, key, value) of what the actions since `marks` left for after the pass (the last
  chunk's outputs, the first chunk's input gradients, the losses), in order, taken out of
  the Pass: a loop hands them out of its iterations in TensorArrays."""
  outputs, input_grads, losses = marks
  left = ([('outputs', m, one.outputs.pop(m)) for m in list(one.outputs) if m not in outputs] +
          [('input_grads', m, one.input_grads.pop(m)) for m in list(one.input_grads)
           if m not in input_grads] +
          [('losses', None, loss) for loss in one.losses[losses:]])
  del one.losses[losses:]
  return left


def RunLoop(one, period, repeats, stride, run):
  """Runs the actions of `period` `repeats` times in one tf.while_loop, micro-batches
  `stride` further each time; `run(action)` runs one (and an L its loss). The Pass's
  dicts end as if the actions had run one by one. NotPeriodic, the Pass as it was, if they
  cannot."""
  if one.updates or any(one.acts.values()):
    raise NotPeriodic('the cells record layer statistics or fetch activations')
  one.CloseTokens()
  saved = {name: copy.copy(value) for name, value in vars(one).items()
           if isinstance(value, (dict, list, set))}
  try:
    try:
      _Loop(one, period, repeats, stride, run)
    except _Replan as e:  # Traced again, its values in flight taking the plan's ways.
      vars(one).update({name: copy.copy(value) for name, value in saved.items()})
      _Loop(one, period, repeats, stride, run, e.plan)
  except NotPeriodic:
    vars(one).update(saved)
    raise


class _Replan(Exception):
  """The period leaves other values in flight than it found: a loop needs `plan`."""

  def __init__(self, plan):
    super().__init__()
    self.plan = plan


def _Loop(one, period, repeats, stride, run, plan=None):
  # Micro-batches not yet in the pipe are no loop variables: the window's first forwards
  # take theirs from the batch, by the iteration.
  waiting = {key: one.inputs.pop(key) for key in list(one.inputs)
             if key[1] == 0 and key[0] not in one.released}
  entering = {a.micro_batch + r * stride for a in period for r in range(repeats)
              if a.kind == schedule_actions.FORWARD and a.chunk == 0}
  kept, fed = _Outside(one, plan, repeats, stride)
  start = _Carried(one)
  tensors, rest = _Split(start)
  columns = _FedColumns(fed)
  specs = _LeftSpecs(one, period) + (plan.specs if plan else [])
  left = []  # (kind, key, value, its other leaves) of what the period left, as traced.
  acts_before = set(one.acts)
  acts = {}  # The period's forwards' fetched activations: none (RunLoop), each iteration.

  def Body(i, loop_tensors, arrays, fed_arrays):
    del left[:]
    _SetCarried(one, _Joined(start, loop_tensors, rest))
    if plan:
      _PutFed(one, fed, _ReadAt(fed_arrays, columns, i))
    else:
      entry = _Carried(one)  # Holding the loop's tensors, which _Plan.Of follows.
      reads = {name: set() for name in _CARRIED}
      for name in _CARRIED:
        setattr(one, name, _Reads(getattr(one, name), reads[name]))
    marks = _Marks(one)
    one.loop = (i, stride)
    try:
      for a in period:
        run(a)
    finally:
      one.loop = None
    one.CloseTokens()
    acts.update({key: one.acts[key] for key in set(one.acts) - acts_before})
    if not plan:
      needed = _Plan.Of(entry, one, reads, stride, repeats)
      if needed:
        raise _Replan(needed)
    stashed = [getattr(one, name).pop(key) for name, key in (plan.stashed if plan else [])]
    end = _Carried(one, shift=stride)
    try:
      tf.nest.assert_same_structure(start, end)
    except (ValueError, TypeError) as e:
      raise NotPeriodic(str(e)) from None
    end_tensors, end_rest = _Split(end)
    if end_rest != rest:
      raise NotPeriodic('other Python values in flight')
    flat = []
    for kind, key, value in _LeftSince(one, marks):
      value_tensors, value_rest = _Split(value)
      left.append((kind, key, value, value_rest))
      flat += value_tensors
    for (name, key), value in zip(plan.stashed if plan else [], stashed):
      value_tensors, value_rest = _Split(value)
      left.append((name, key, value, value_rest))
      flat += value_tensors
    if [(x.dtype, x.shape) for x in flat] != specs:
      raise NotPeriodic('other values left for after the pass')
    return i + 1, end_tensors, [array.write(i, x) for array, x in zip(arrays, flat)], fed_arrays

  # Without automatic control dependencies: in a tf.function they make every value an
  # iteration hands on wait for all of its stateful ops (the calls), so no iteration would
  # start before the last ended; each device's order is the actions' own tokens. Its control
  # output is the loop, so what is ordered after the call waits for the loop (without one,
  # the weight-gradient adds after it raced). The call is inlined: a call that is not holds
  # its inputs until it returns, and every value in flight at the loop's start stayed until
  # the loop's end (1F1B, K=4, M=64 without remat: a peak 1.5x the unrolled one,
  # docs/benchmarks/2026-12-08-saved-forward.md#memory).
  @py_utils.DistinctFunction(autograph=False, name='steady_state',
                             experimental_attributes={'_disable_acd': True})
  def Loop(tensors, columns):
    arrays = [tf.TensorArray(dtype, size=repeats, element_shape=shape)
              for dtype, shape in specs]
    _, out_tensors, arrays, _ = tf.while_loop(
        lambda i, *_: i < repeats, Body,
        (tf.constant(0), tensors, arrays, _FedArrays(columns)),
        parallel_iterations=2 * len(one.devices) + 2)
    graph = tf.compat.v1.get_default_graph()
    loops = [op for op in graph.get_operations() if op.type in ('While', 'StatelessWhile')]
    if len(loops) != 1:
      raise RuntimeError(f'a steady-state loop should be one while op, found {loops}')
    graph.control_outputs.extend(loops)
    return out_tensors, [[array.read(r) for r in range(repeats)] for array in arrays]

  out_tensors, reads = Loop(tensors, columns)
  _SetCarried(one, _Joined(start, out_tensors, rest), shift=repeats * stride)
  for name, values in kept.items():
    getattr(one, name).update(values)
  _PutBack(one, left, reads, repeats, stride)
  one.inputs.update({key: x for key, x in waiting.items() if key[0] not in entering})
  one.acts.update({(m + r * stride, c): value for (m, c), value in acts.items()
                   for r in range(repeats)})
  one.released |= entering


def _Outside(one, plan, repeats, stride):
  """Under a plan, takes out of the Pass's dicts what stays outside the loop: ({name: the
  values it does not look up}, [((name, key), [its value in each iteration])] fed to it);
  the dicts then hold what goes round it."""
  if plan is None:
    return {}, []
  fed = [((name, key), [getattr(one, name).pop(_Key(key, r * stride)) for r in range(repeats)])
         for name, key in plan.fed]
  carried = {name: {} for name in _CARRIED}
  for name, key in plan.carried:
    carried[name][key] = getattr(one, name).pop(key)
  kept = {name: getattr(one, name) for name in _CARRIED}
  for name in _CARRIED:
    setattr(one, name, carried[name])
  return kept, fed


def _FedColumns(fed):
  """Per tensor of each fed value, its tensors of every iteration (a column)."""
  columns = []
  for (name, key), values in fed:
    splits = [_Split(value) for value in values]
    if any(rest != splits[0][1] for _, rest in splits):
      raise NotPeriodic(f'{name} {key} holds other Python values in other iterations')
    columns += [list(column) for column in zip(*[tensors for tensors, _ in splits])]
  return columns


def _FedArrays(columns):
  """A TensorArray per column, made where its tensors are (the loop reads it there)."""
  arrays = []
  for column in columns:
    with tf.device(column[0].device):
      array = tf.TensorArray(column[0].dtype, size=len(column),
                             element_shape=column[0].shape)
      for r, x in enumerate(column):
        array = array.write(r, x)
    arrays.append(array)
  return arrays


def _PutFed(one, fed, tensors):
  """Puts an iteration's fed values (their `tensors`, in _FedColumns' order) into the Pass."""
  it = iter(tensors)
  for (name, key), values in fed:
    first, rest = _Split(values[0])
    getattr(one, name)[key] = _Joined(values[0], [next(it) for _ in first], rest)


def _ReadAt(arrays, columns, i):
  """Element i of each TensorArray of _FedArrays, read where its column is."""
  reads = []
  for array, column in zip(arrays, columns):
    with tf.device(column[0].device):
      reads.append(array.read(i))
  return reads


def _LeftSpecs(one, period):
  """(dtype, shape) of each tensor a period leaves for after the pass (in _LeftSince's
  order), from values of the same kind that actions before the window left."""
  outputs, input_grads, losses = [], [], []
  for a in period:
    if a.kind == schedule_actions.FORWARD and a.chunk == one.num_chunks - 1 and one.keep_outputs:
      outputs.append(next(iter(one.outputs.values())))
    elif a.kind in (schedule_actions.BACKWARD, schedule_actions.INPUT_GRAD) and a.chunk == 0:
      input_grads.append(next(iter(one.input_grads.values())))
    elif a.kind == schedule_actions.LOSS:
      losses.append(one.losses[-1])
  return [(x.dtype, x.shape) for value in outputs + input_grads + losses
          for x in _Split(value)[0]]


def _PutBack(one, left, reads, repeats, stride):
  """Puts what each iteration left (reads: per TensorArray, per iteration) where the actions
  one by one would have."""
  losses = []
  for r in range(repeats):
    it = iter(reads)
    for kind, key, value, value_rest in left:
      value = _Joined(value, [next(it)[r] for _ in _Split(value)[0]], value_rest)
      if kind == 'losses':
        losses.append(value)
      else:
        getattr(one, kind)[_Key(key, r * stride)] = value
  one.losses += losses
