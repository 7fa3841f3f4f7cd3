"""Tests of the trainer's training job helpers (lingvo_gpipe/runners/train_job.py)."""

import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import steady_state
from lingvo_gpipe.runners import train_job

BATCH, DIM = 32, 8
LONG = train_job.LONG_TRACE_SECS + 1  # A trace that gets the hint.


def _Task(num_micro_batches, schedule='1f1b', batch=BATCH, **kwargs):
  cells = gpipe.PartitionSequentialLayers(
      [layers.TransformerFeedForwardLayer.Params().Set(input_dim=DIM, hidden_dim=DIM)
       for _ in range(4)], 4, tf.TensorShape([batch, DIM]))
  task = tf.Module()
  task.stack = gpipe.PipeliningLayer.Params().Set(
      name='stack', cell_tpl=cells, num_micro_batches=num_micro_batches, schedule=schedule,
      **kwargs).Instantiate()
  return task


def testAnUnrolledSteadyStateGetsTheLoopHintWithItsCounts():
  task = _Task(16)
  instructions = task.stack.GetProgram(BATCH).instructions
  windows = steady_state.Windows(instructions)
  assert windows  # 1F1B at K=4, M=16 repeats itself.
  hint, = train_job._LoopLines(task, BATCH, LONG)
  repeated = sum(w.end - w.start for w in windows)
  assert f'{repeated:,} of its {len(instructions):,} instructions repeat' in hint
  assert "(loop_steady_state='auto')" in hint and 'loop_steady_state : True' in hint


def testAnAutoLoopIsSaidWithHowToUnrollIt():
  # 'auto' (the default) loops 1F1B at K=4, M=64 (a program of 576 instructions): said
  # whatever the trace took, as its steps may be slower.
  line, = train_job._LoopLines(_Task(64, batch=128), 128, 0.1)
  assert "run as one loop (loop_steady_state='auto')" in line
  assert 'loop_steady_state=False unrolls them' in line
  looped, = train_job._LoopLines(_Task(64, 'gpipe', batch=128), 128, 0.1)  # Fill-drain too.
  assert 'run as one loop' in looped
  unrolled, = train_job._LoopLines(_Task(64, batch=128, loop_steady_state=False), 128, LONG)
  assert 'each traced on its own (loop_steady_state=False)' in unrolled


def testForwardsWithoutRematLoopAndGetTheSameHints():
  # remat='never' hands each forward's saved tensors to its backward: its steady state loops.
  line, = train_job._LoopLines(_Task(64, batch=128, remat='never'), 128, 0.1)
  assert "run as one loop (loop_steady_state='auto')" in line
  hint, = train_job._LoopLines(_Task(16, remat='never'), BATCH, LONG)
  assert 'loop_steady_state : True' in hint


def testNoHintWhereTheLoopIsOnOrNothingRepeatsOrNothingWouldLoop():
  assert train_job._LoopLines(_Task(16, loop_steady_state=True), BATCH, LONG) == []
  assert train_job._LoopLines(_Task(64, batch=128, loop_steady_state=True), 128, LONG) == []
  assert train_job._LoopLines(_Task(16), BATCH, 0.1) == []  # A short trace: no hint.
  assert train_job._LoopLines(_Task(16, inline_cell_functions=True), BATCH, LONG) == []
  assert train_job._LoopLines(_Task(64, batch=130), 130, LONG) == []  # Uneven micro-batches.
  assert train_job._LoopLines(_Task(16, 'gpipe'), BATCH, LONG)  # Short: unrolled.
  assert train_job._LoopLines(_Task(16, 'zb_h1', remat='never'), BATCH, LONG)  # B and W loop.
  assert train_job._LoopLines(_Task(4), BATCH, LONG) == []  # M = K: no three repeats.
  assert train_job._LoopLines(_Task(16), None, LONG) == []  # No batch size known: no program.
