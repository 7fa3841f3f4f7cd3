"""Step timing: stamps that mean an action's outputs exist, per-device clocks, the tracer.

With the pipelines' step statistics on (py_utils.FPropContext.step_stats), each
action is stamped before and after on its own device; a stamp after GPU tensors
first waits for a host copy of their first element (CompletionTokens), since a
GPU runs a kernel after the op that launched it returns. The StepTracer records
one entry per action, which pipeline_stats.py turns into timelines and bubbles.
"""

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils


@tf.function(autograph=False)
def _Now(clock, device):
  """tf.timestamp() on `device`, in a call that takes the device's `clock` variable.

  Inside a tf.function, automatic control dependencies chain every stateful op
  that has no resource input (tf.timestamp is one) in program order, which
  would make each device's stamps wait for the other devices' steps. A call that
  takes a resource it only reads is ordered by nothing but its own inputs. The
  device is named inside (one trace per device): an inlined body op without
  one runs on the first worker process for every device, so a later stage's
  stamps would wait for a round trip to it and its actions would look longer.
  """
  del clock  # Only its presence as an input matters.
  with tf.device(device):
    return tf.timestamp()


def Stamp(clock, structure):
  """The time (seconds) on the clock's device once every tensor of `structure` exists."""
  with tf.control_dependencies(CompletionTokens(structure)):
    return _Now(clock, clock.device)


def CompletionTokens(structure):
  """Tensors that exist once `structure`'s tensors are computed, not only launched.

  A GPU runs a kernel after the op that launched it returns, so a control
  dependency on a GPU tensor orders after the launch. A copy of its first element
  to the host waits for the kernel: a stamp after it marks completion. CPU
  tensors are done when their op returns.
  """
  tokens = []
  for x in py_utils.Tensors(structure):
    spec = tf.DeviceSpec.from_string(x.device)
    if (spec.device_type or '').upper() != 'GPU' or x.dtype in (tf.resource, tf.variant,
                                                                 tf.string):
      tokens.append(x)
      continue
    with tf.device(x.device):
      first = tf.reshape(x, [-1])[:1]
    with tf.device(spec.replace(device_type='CPU', device_index=0)):
      tokens.append(tf.identity(first))
  return tokens


class DeviceClocks:
  """One variable per device for its time stamps (see _Now), made with the pipeline: one made
  by a step's trace would make tf.function trace the step twice."""

  def __init__(self, devices, name):
    """`name` is unique per pipeline."""
    self._clocks = []
    for k, device in enumerate(devices):
      with tf.init_scope(), tf.device(device):
        self._clocks.append(tf.Variable(0.0, trainable=False,
                                        name=f'{py_utils.SCRATCH_SCOPE}/{name}/clock{k}'))

  def __getitem__(self, device):
    return self._clocks[device]


class StepTracer:
  """Appends one timing record per action to `records` (py_utils.Context(step_stats=...)).

  A record: replica, stage (the device), chunk, kind, micro_batch, start, end
  and, for a re-materialized backward, recompute_end. The device's next action
  waits for the end stamp too: without that, the stamp can queue behind the next
  action's first ops (up to one matmul late), so a stage whose actions follow
  each other at once (the last: its loss and backward follow its forward) would
  look slower per action than another running the same ops as fast.
  """

  def __init__(self, records, clocks):
    self._records = records
    self.clocks = clocks

  def Start(self, device, inputs):
    """The stamp taken once `inputs` (tensors, and tokens to wait for) exist."""
    return Stamp(self.clocks[device], inputs)

  def End(self, replica, device, action, start, outputs, recompute_end=None):
    """Records the action; returns its end stamp, for the device's next action to wait for."""
    end = Stamp(self.clocks[device], (outputs, recompute_end))
    self._records.append(py_utils.NestedMap(
        replica=replica, stage=device, chunk=action.chunk, kind=action.kind,
        micro_batch=action.micro_batch, start=start, end=end, recompute_end=recompute_end))
    return end
