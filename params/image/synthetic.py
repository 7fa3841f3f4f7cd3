"""Residual conv nets on synthetic images (input_generators.SyntheticImageInput)."""

from lingvo_gpipe.inputs import input_generators
from lingvo_gpipe.models import layers_with_gpipe
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.models import tasks
from lingvo_gpipe.params.lm import synthetic


@model_registry.RegisterSingleTaskModel
class GPipeConvNet(synthetic.SyntheticDataModelParams):
  """A small ResNet (stem + 4 residual blocks, batch norm) on 2 stages with M=4.

  Classifies noisy 16x16 copies of 10 random class templates: the paper's image
  pipeline at a CPU size. Swap the input for input_generators.NpzImageInput to
  train on arrays of your own.
  """

  def Train(self):
    return input_generators.SyntheticImageInput.Params().Set(
        name='images', image_shape=(16, 16, 3), num_classes=10, noise=1.0, batch_size=32,
        seed=1)

  def Task(self):
    data = self.Train()
    p = tasks.ImageClassifierTask.Params().Set(name='classifier', input=data)
    p.stack = layers_with_gpipe.GPipeResNetStack.Params().Set(
        name='stack', image_shape=data.image_shape, num_classes=data.num_classes,
        stem_channels=16, block_channels=[16, 16, 32, 32], splits=2, num_micro_batches=4)
    p.train.learning_rate = 1e-3
    return p
