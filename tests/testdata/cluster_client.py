r"""Loss and gradients of a small pipelined MLP, its stages on a cluster's workers.

  python tests/testdata/cluster_client.py --workers=worker=localhost:1,localhost:2 \
      --layouts=2x1,3x1,2x2 --out_dir=/tmp/out

For each layout KxR (K stages, R replicas) it connects (once) to the cluster,
places replica r's stages on split r of K worker devices, runs one
ForwardBackward and writes <out_dir>/<layout>.npz: the loss, the gradients and
the devices of the variables and of the step's ops. tests/cluster_test.py runs
it in its own process (connecting changes the whole process's TensorFlow
context) and compares with MakePipeline's single-device run.
"""

import os
import sys

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.distribution import cluster as cluster_lib
from lingvo_gpipe.pipeline import gpipe

FLAGS = flags.FLAGS
flags.DEFINE_string('workers', None, "The cluster's workers as Lingvo's cluster spec.")
flags.DEFINE_list('layouts', ['2x1'], 'KxR: K stages, R replicas.')
flags.DEFINE_string('out_dir', None, 'Where <layout>.npz go.')

BATCH = 8
DIM = 4


def MakePipeline(stages, replicas=1, devices=None, num_micro_batches=2):
  """A K-stage ReLU MLP; initial weights depend only on the layer paths, not on devices."""
  widths = [DIM] + [8] * (stages - 1) + [1]
  cells = [layers.ProjectionLayer.Params().Set(
      name=f'proj{k}', input_dim=widths[k], output_dim=widths[k + 1],
      activation='RELU' if k + 1 < stages else 'NONE') for k in range(stages)]
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=num_micro_batches, devices=devices,
      num_replicas=replicas, allow_device_reuse=True).Instantiate()


def Batch():
  x = tf.random.stateless_normal([BATCH, DIM], [1, 2])
  y = tf.reduce_sum(x * tf.range(1.0, DIM + 1.0), axis=1, keepdims=True)
  return x, y


def LossAndGradients(pipe):
  """(loss, {variable name: gradient}) of mean squared error on Batch()."""
  x, y = Batch()

  @tf.function(autograph=False)
  def Step():
    with cluster_lib.ColocatedWithInputs():
      return pipe.ForwardBackward(pipe.theta, x, lambda out: tf.reduce_mean(tf.square(out - y)),
                                  loss_reduction='mean')

  loss, grads = Step()
  names = [v.name for v in tf.nest.flatten(pipe.theta)]
  return loss.numpy(), dict(zip(names, [g.numpy() for g in tf.nest.flatten(grads)])), Step


def _Devices(step_fn):
  graph = step_fn.get_concrete_function().graph
  return sorted({op.device for op in graph.get_operations() if op.device})


def main(argv):
  del argv
  spec = cluster_lib.ParseClusterSpec(FLAGS.workers)
  cluster_lib.Connect(spec, timeout_secs=60)
  for layout in FLAGS.layouts:
    stages, replicas = map(int, layout.split('x'))
    pipe = MakePipeline(stages, replicas, cluster_lib.PipelineDevices(stages, replicas))
    loss, grads, step_fn = LossAndGradients(pipe)
    np.savez(os.path.join(FLAGS.out_dir, f'{layout}.npz'), loss=loss,
             grad_names=np.array(list(grads)), variable_devices=np.array(
                 [v.device for v in tf.nest.flatten(pipe.theta)]),
             stage_devices=np.array(pipe.devices), op_devices=np.array(_Devices(step_fn)),
             **{f'grad_{i}': g for i, g in enumerate(grads.values())})
    print(f'{layout}: loss {loss:.6g}', file=sys.stderr)


if __name__ == '__main__':
  app.run(main)
