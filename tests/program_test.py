"""Tests of lingvo_gpipe.pipeline.program: a schedule lowered to instructions with explicit
sends, and the executor running exactly those instructions."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.pipeline import cost_model
from lingvo_gpipe.pipeline import executor
from lingvo_gpipe.pipeline import program
from lingvo_gpipe.pipeline import schedule
from lingvo_gpipe.pipeline import schedule_actions

NAMED = [('gpipe', 1), ('1f1b', 1), ('interleaved_1f1b', 2), ('zb_h1', 1), ('zb_h2', 1),
         ('zbv', 2)]


@pytest.mark.parametrize('k,m', [(1, 2), (2, 4), (3, 6), (4, 8)])
@pytest.mark.parametrize('name,v', NAMED)
def testActionsInClockOrderEachFollowedByTheSendOfWhatItMade(name, v, k, m):
  sched = schedule.Schedule(name, k, m, v)
  prog = program.Lower(sched)
  assert prog.Actions() == [s.action for s in sched.steps]
  last, where = sched.num_chunks - 1, sched.placement
  for i, ins in enumerate(prog.instructions):
    kind, mb, c = ins
    sends_on = (kind == 'F' and c < last and where[c + 1] != where[c]) or (
        kind in ('B', 'BW') and c > 0 and where[c - 1] != where[c])
    following = prog.instructions[i + 1] if i + 1 < len(prog.instructions) else None
    if sends_on:
      assert following == (('SF' if kind == 'F' else 'SB'), mb, c), (ins, following)
    if kind in ('SF', 'SB'):
      assert prog.instructions[i - 1][1:] == (mb, c)
      assert where[program.Receiver(ins)] != where[c]
  # One send per micro-batch and cross-device boundary, each way (none for K = 1).
  crossings = sum(where[c] != where[c + 1] for c in range(last))
  assert len(prog.Sends()) == 2 * m * crossings


def testTheTextOfAFillDrainProgram():
  """K=2, M=2 fill-drain, written out by hand: forwards and their sends, the whole batch's
  loss, the backwards (each adding to its chunk's sum) and their sends, the reduction."""
  want = '''program gpipe K=2 M=2 v=1
device0: F0@0
device0: SF0@0>1  to device1
device0: F1@0
device0: SF1@0>1  to device1
device1: F0@1
device1: F1@1
device1: L*@1
device1: BW1@1  += gradient sum of chunk 1
device1: SB1@1>0  to device0
device0: BW1@0  += gradient sum of chunk 0
device1: BW0@1  += gradient sum of chunk 1
device1: SB0@1>0  to device0
device0: BW0@0  += gradient sum of chunk 0
reduce: the gradient sums of every replica added; loss and gradients / the losses' total weight
'''
  assert program.Lower(schedule.Schedule('gpipe', 2, 2)).ToText() == want


def testTheVsTurnSendsNothing():
  """ZB-V puts chunks K-1 and K on one device: no send between them."""
  prog = program.Lower(schedule.Schedule('zbv', 2, 2, 2))
  assert {(s.kind, s.chunk) for s in prog.Sends()} == {('SF', 0), ('SF', 2), ('SB', 3),
                                                        ('SB', 1)}


def testUnitCostTimingIsThePrintedClock():
  sched = schedule.Schedule('zb_h1', 3, 6)
  start, _ = program.Lower(sched).Time(cost_model.CostModel.Unit(3, 6))
  for s in sched.steps:
    if s.action.kind != 'L':
      assert start[cost_model.CODES[s.action.kind], s.action.chunk, s.action.micro_batch] == (
          s.clock)


@pytest.mark.parametrize('name,v', NAMED)
def testTheExecutorRunsExactlyTheProgram(name, v, monkeypatch):
  """Every instruction but the losses reaches executor.Pass.Run once, in the program's order,
  and the pass trains as the unpipelined layers do."""
  from lingvo_gpipe import layers  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.pipeline import gpipe  # pylint: disable=g-import-not-at-top
  layer = layers.TransformerFeedForwardLayer.Params().Set(input_dim=8, hidden_dim=16)
  cells = gpipe.PartitionSequentialLayers([layer.Copy() for _ in range(4)], 4 // v * v,
                                          tf.TensorShape([8, 8]))
  pipe = gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells, num_micro_batches=4,
                                            schedule=name, virtual_stages=v).Instantiate()
  ran = []
  run = executor.Pass.Run
  monkeypatch.setattr(executor.Pass, 'Run', lambda one, ins: (ran.append(ins), run(one, ins)))
  x = tf.random.stateless_normal([8, 8], [1, 2])
  loss, grads = pipe.ForwardBackward(pipe.theta, x, lambda y: tf.reduce_mean(tf.square(y)),
                                     loss_reduction='mean')
  prog = pipe.GetProgram(8)
  assert ran == [i for i in prog.instructions if i.kind != schedule_actions.LOSS]
  with tf.GradientTape() as tape:  # The cells one after the other on the whole batch.
    y = x
    for cell, theta in zip(pipe.cell, pipe.theta.cell):
      y = cell.FProp(theta, y)
    want = tf.reduce_mean(tf.square(y))
  want_grads = tape.gradient(want, pipe.theta)
  np.testing.assert_allclose(loss.numpy(), want.numpy(), rtol=1e-6)
  for got, ref in zip(tf.nest.flatten(grads.cell), tf.nest.flatten(want_grads.cell)):
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-5, atol=1e-7)
