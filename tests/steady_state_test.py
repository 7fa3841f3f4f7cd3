"""steady_state: the stretches of each schedule that repeat, and a pipeline running them as a
loop equal to the same actions run one by one (which the other suites check against the plain
model)."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import cell_functions
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import schedule as schedule_lib
from lingvo_gpipe.pipeline import schedule_actions
from lingvo_gpipe.pipeline import steady_state

_V = {'interleaved_1f1b': 2, 'zbv': 2}
_SCHEDULES = list(named_schedules.SCHEDULE_NAMES)


def _Actions(name, k, m):
  return [s.action for s in schedule_lib.Schedule(name, k, m, _V.get(name, 1)).steps]


@pytest.mark.parametrize('name', _SCHEDULES)
def testAWindowIsItsPeriodRepeatedWithMicroBatchesFurtherOn(name):
  actions = _Actions(name, 4, 16)
  windows = steady_state.Windows(actions)
  firsts = {}
  for i, a in enumerate(actions):
    firsts.setdefault((a.kind, a.chunk), i)
  end = 0
  for w in windows:
    assert w.start >= end and w.repeats >= steady_state.MIN_REPEATS
    end = w.end
    period = actions[w.start:w.start + w.period]
    repeated = [schedule_actions.Action(a.kind, a.micro_batch + r * w.stride, a.chunk)
                for r in range(w.repeats) for a in period]
    assert actions[w.start:w.end] == repeated
    assert all(firsts[(a.kind, a.chunk)] < w.start for a in period)  # Traced before.


@pytest.mark.parametrize('name,covered', [('1f1b', 0.6), ('zb_h1', 0.6), ('gpipe', 0.8)])
def testMostOfADeepPipelineIsItsSteadyState(name, covered):
  actions = _Actions(name, 8, 64)
  inside = sum(w.end - w.start for w in steady_state.Windows(actions))
  assert inside >= covered * len(actions), (inside, len(actions))


def testAShortPipelineHasNoSteadyState():
  assert steady_state.Windows(_Actions('1f1b', 4, 4)) == []


def testWindowsHoldOnlyActionsThatShareATrace():
  actions = _Actions('1f1b', 2, 12)
  assert steady_state.Windows(actions, same=lambda a, b: False) == []


def _Pipeline(sched, remat, loop, m=12, rows=24, before=False):
  ff = layers.TransformerFeedForwardLayer.Params().Set(input_dim=8, hidden_dim=16)
  v = _V.get(sched, 1)
  cells = gpipe.PartitionSequentialLayers([ff.Copy() for _ in range(4 * v)], 2 * v,
                                          tf.TensorShape([rows, 8]))
  p = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=m, remat=remat, schedule=sched,
      virtual_stages=v, loop_steady_state=loop, random_seed=5)
  if before:
    p.before_tpl = [layers.ProjectionLayer.Params().Set(name='proj', input_dim=8,
                                                        output_dim=8)]
  pipe = p.Instantiate()
  cell_functions.CreateGradientSums(pipe)
  return pipe


def _Run(pipe, rows=24):
  x = tf.random.stateless_normal([rows, 8], [1, 2])
  labels = tf.random.stateless_normal([rows, 8], [3, 4])

  @tf.function(autograph=False)
  def Step(x, labels):
    with py_utils.Context(step=tf.constant(0, tf.int64)):
      return pipe.ForwardBackward(pipe.theta, x, lambda y, t: tf.reduce_mean(tf.square(y - t)),
                                  labels=labels, with_outputs=True, loss_reduction='mean')

  result = tf.nest.map_structure(lambda t: t.numpy(), Step(x, labels))
  loops = steady_state.LoopsIn(Step.get_concrete_function(x, labels).graph)
  return result, loops, Step.experimental_get_tracing_count()


@pytest.mark.parametrize('remat', ['always', 'except_last', 'never'])
@pytest.mark.parametrize('sched', _SCHEDULES)
def testALoopedSteadyStateEqualsTheActionsOneByOne(sched, remat):
  looped, loops, traces = _Run(_Pipeline(sched, remat, loop=True))
  unrolled, none, _ = _Run(_Pipeline(sched, remat, loop=False))
  assert none == 0 and traces == 1
  # Fill-drain's forwards and its backwards each loop, its stash fed and stashed.
  assert loops == (2 if sched == 'gpipe' else 1), loops
  for a, b in zip(tf.nest.flatten(looped), tf.nest.flatten(unrolled)):
    # Grappler may merge a loss's weights (constants unrolled) in another order: rounding.
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize('remat', ['always', 'never'])
@pytest.mark.parametrize('sched', ['gpipe', '1f1b', 'zb_h1'])
def testFillDrainOneFOneBAndZbH1LoopsAreBitwiseTheActionsOneByOne(sched, remat):
  looped, loops, _ = _Run(_Pipeline(sched, remat, loop=True, before=True))
  unrolled, _, _ = _Run(_Pipeline(sched, remat, loop=False, before=True))
  assert loops == (2 if sched == 'gpipe' else 1)
  for a, b in zip(tf.nest.flatten(looped), tf.nest.flatten(unrolled)):
    np.testing.assert_array_equal(a, b)


def testUnevenMicroBatchesRunOneByOne():
  """A loop's variables keep their shapes."""
  uneven, loops, _ = _Run(_Pipeline('1f1b', 'always', loop=True, rows=19), rows=19)
  assert loops == 0
  reference, _, _ = _Run(_Pipeline('1f1b', 'always', loop=False, rows=19), rows=19)
  for a, b in zip(tf.nest.flatten(uneven), tf.nest.flatten(reference)):
    np.testing.assert_array_equal(a, b)


def testADeepPipelinesGraphHoldsFewerCallsLooped():
  def Calls(loop):
    pipe = _Pipeline('1f1b', 'always', loop, m=32, rows=32)
    x = tf.zeros([32, 8])

    @tf.function(autograph=False)
    def Step():
      with py_utils.Context(step=tf.constant(0, tf.int64)):
        return pipe.ForwardBackward(pipe.theta, x, lambda y: tf.reduce_mean(y),
                                    loss_reduction='mean')

    graph = Step.get_concrete_function().graph
    return sum(op.type == 'StatefulPartitionedCall' for op in graph.get_operations())

  assert Calls(True) * 3 < Calls(False)


def testAutoLoopsALongSteadyStateOnly():
  """'auto', the default, loops where the windows hold AUTO_MIN_INSTRUCTIONS (K=2, M=64: 1F1B's
  program has 320 instructions), not a short pipeline's (K=2, M=12), nor inlined calls."""
  assert gpipe.PipeliningLayer.Params().loop_steady_state == 'auto'
  program = _Pipeline('1f1b', 'always', 'auto', m=64, rows=64).GetProgram(64).instructions
  assert sum(w.end - w.start for w in steady_state.Windows(program)) >= (
      steady_state.AUTO_MIN_INSTRUCTIONS)
  auto, loops, _ = _Run(_Pipeline('1f1b', 'always', 'auto', m=64, rows=64), rows=64)
  assert loops == 1
  unrolled, _, _ = _Run(_Pipeline('1f1b', 'always', False, m=64, rows=64), rows=64)
  for a, b in zip(tf.nest.flatten(auto), tf.nest.flatten(unrolled)):
    np.testing.assert_array_equal(a, b)
  assert _Run(_Pipeline('1f1b', 'always', 'auto'))[1] == 0  # M=12: 60 instructions.
  inlined = _Pipeline('1f1b', 'always', 'auto', m=64, rows=64).params.Copy()
  inlined.inline_cell_functions = True
  assert steady_state.Looped(steady_state.Windows(program), inlined) == []


@pytest.mark.parametrize('text, value', [('False', False), ('True', True), ("'auto'", 'auto')])
def testALoopSettingReadsFromAnOverrideAndRoundTrips(text, value):
  """The trainer's --model_params_override text gives the bool, not the string 'False'."""
  p = gpipe.PipeliningLayer.Params()
  p.FromText(f'loop_steady_state : {text}')
  assert p.loop_steady_state is value or p.loop_steady_state == value == 'auto'
  again = gpipe.PipeliningLayer.Params()
  again.FromText(p.ToText())
  assert again.loop_steady_state == value and type(again.loop_steady_state) is type(value)


@pytest.mark.parametrize('value', ['yes', 1, None])
def testALoopSettingIsTrueFalseOrAuto(value):
  with pytest.raises(ValueError, match=f"loop_steady_state must be True, False or 'auto', got "
                     f'{value!r}'):
    _Pipeline('1f1b', 'always', loop=value)


@pytest.mark.parametrize('sched', ['1f1b', 'zb_h1'])
def testALoopedStepGivesTheSameNumbersEveryTime(sched):
  """The loop's function has no automatic control dependencies: its own tokens order it."""
  pipe = _Pipeline(sched, 'always', loop=True)
  x = tf.random.stateless_normal([24, 8], [1, 2])

  @tf.function(autograph=False)
  def Step():
    with py_utils.Context(step=tf.constant(0, tf.int64)):
      return pipe.ForwardBackward(pipe.theta, x, lambda y: tf.reduce_mean(tf.square(y)),
                                  loss_reduction='mean')

  first = tf.nest.flatten(tf.nest.map_structure(lambda t: t.numpy(), Step()))
  for _ in range(15):
    again = tf.nest.flatten(tf.nest.map_structure(lambda t: t.numpy(), Step()))
    for a, b in zip(first, again):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('sched', ['1f1b', 'interleaved_1f1b'])
def testALoopedEvalForwardEqualsTheForwardsOneByOne(sched):
  """FProp in eval runs the schedule's forwards only, none kept for a backward."""
  x = tf.random.stateless_normal([24, 8], [1, 2])
  outs = []
  for loop in (True, False):
    pipe = _Pipeline(sched, 'always', loop)

    @tf.function(autograph=False)
    def Eval():
      with py_utils.EvalMode():
        return pipe.FProp(pipe.theta, x)

    outs.append(Eval().numpy())
    assert steady_state.LoopsIn(Eval.get_concrete_function().graph) == int(loop)
  np.testing.assert_array_equal(*outs)
