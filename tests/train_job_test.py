"""Tests of the trainer's training job helpers (lingvo_gpipe/runners/train_job.py)."""

import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import steady_state
from lingvo_gpipe.runners import train_job

BATCH, DIM = 32, 8


def _Task(num_micro_batches, schedule='1f1b', **kwargs):
  cells = gpipe.PartitionSequentialLayers(
      [layers.TransformerFeedForwardLayer.Params().Set(input_dim=DIM, hidden_dim=DIM)
       for _ in range(4)], 4, tf.TensorShape([BATCH, DIM]))
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
  hint, = train_job._LoopHints(task, BATCH)
  repeated = sum(w.end - w.start for w in windows)
  assert f'{repeated:,} of its {len(instructions):,} instructions repeat' in hint
  assert 'loop_steady_state : True' in hint


def testNoHintWhereTheLoopIsOnOrNothingRepeatsOrNothingWouldLoop():
  assert train_job._LoopHints(_Task(16, loop_steady_state=True), BATCH) == []
  assert train_job._LoopHints(_Task(16, 'gpipe'), BATCH) == []  # Its stash piles up.
  assert train_job._LoopHints(_Task(16, remat='never'), BATCH) == []  # Taped forwards.
  assert train_job._LoopHints(_Task(16, 'zb_h1', remat='never'), BATCH)  # B and W loop.
  assert train_job._LoopHints(_Task(4), BATCH) == []  # M = K: no three repeats.
  assert train_job._LoopHints(_Task(16), None) == []  # No batch size known: no program.
