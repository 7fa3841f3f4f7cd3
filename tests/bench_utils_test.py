"""tools/bench_utils.py's measured step: one step's timeline, timed behind another step."""

import os
import sys
import time

import numpy as np
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.pipeline import gpipe

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'tools'))
import bench_utils  # pylint: disable=g-import-not-at-top,wrong-import-position

_SLEEP_S = 0.3


def testTheMeasuredStepStartsOnceTheStepBeforeItHasEnded():
  """A step dispatched alone starts with the dispatch; the timed loops' steps follow another
  step, so the measured one does too, and only its actions are in the timeline."""
  layer = layers.ProjectionLayer.Params().Set(input_dim=8, output_dim=8)
  cells = gpipe.PartitionSequentialLayers([layer.Copy().Set(name=f'p{i}') for i in range(4)],
                                          2, tf.TensorShape([12, 8]))
  pipe = gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells, num_micro_batches=3,
                                            schedule='1f1b', remat='never').Instantiate()
  x = tf.random.stateless_normal([12, 8], [1, 2])
  steps = tf.Variable(0, dtype=tf.int64)

  def Body():
    loss, grads = pipe.ForwardBackward(pipe.theta, x, lambda y: tf.reduce_mean(y ** 2),
                                       loss_reduction='mean')
    steps.assign_add(1)
    # A step that ends _SLEEP_S after it started: its last output.
    slept = tf.py_function(lambda: time.sleep(_SLEEP_S) or 0.0, [], tf.float32)
    return loss, grads, slept

  measured = bench_utils.MeasuredStep(tf, Body)
  measured()  # Traces.
  start = time.time()  # tf.timestamp's clock.
  timeline = measured()
  assert int(steps.numpy()) == 4  # Two calls of two steps.
  assert len(timeline.start) == 2 * 2 * 3  # F and BW of 2 chunks x 3 micro-batches.
  assert np.min(timeline.start) >= start + _SLEEP_S
