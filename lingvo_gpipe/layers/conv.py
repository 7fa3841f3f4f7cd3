"""Convolution, pooling and batch normalization over NHWC images.

Batch norm keeps its moving statistics as non-trainable variables, updated through the
FProp context's update list, so they are never rounded through a low-precision dtype."""

import tensorflow as tf

from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import layer_utils

class Conv2DLayer(base_layer.BaseLayer):
  """2-D convolution over NHWC inputs, then bias and activation."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('filter_shape', None, '[height, width, in_channels, out_channels].')
    p.Define('filter_stride', (1, 1), '[height stride, width stride].')
    p.Define('padding', 'SAME', f'One of {list(layer_utils.PADDINGS)}.')
    p.Define('has_bias', True, 'Whether to add a learned bias per output channel.')
    p.Define('activation', 'NONE',
             f'Activation applied last, one of {list(layer_utils.ACTIVATIONS)}.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    layer_utils.CheckShape(self, 'filter_shape', p.filter_shape, 4)
    layer_utils.CheckShape(self, 'filter_stride', p.filter_stride, 2)
    layer_utils.CheckChoice(self, 'padding', p.padding, layer_utils.PADDINGS)
    layer_utils.CheckChoice(self, 'activation', p.activation, layer_utils.ACTIVATIONS)
    self.CreateVariable('w', py_utils.WeightParams(p.filter_shape))
    if p.has_bias:
      self.CreateVariable('b', py_utils.WeightParams([p.filter_shape[-1]],
                                                     py_utils.WeightInit.Constant(0.0)))

  def FProp(self, theta, inputs):
    """[B, H, W, in_channels] -> [B, H', W', out_channels]."""
    p = self.params
    theta = self.ToFPropDtype(theta)
    x = self.ToFPropDtype(inputs)
    y = layer_utils.OnAtLeastOneRow(
        lambda x: tf.nn.conv2d(x, theta.w, strides=[1, *p.filter_stride, 1],
                               padding=p.padding), x)
    return layer_utils.BiasAndActivation(y, theta, p)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    fh, fw, cin, cout = params.filter_shape
    out = layer_utils.WindowOutputShape(input_shape, (fh, fw), params.filter_stride,
                                        params.padding, cout)
    flops = 2 * layer_utils.NumElements(out) * fh * fw * cin
    return layer_utils.MetaWithBiasAndActivation(params, flops, out)


class PoolingLayer(base_layer.BaseLayer):
  """Max or average pooling over the spatial dimensions of NHWC inputs."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('window_shape', (2, 2), '[height, width] of the pooling window.')
    p.Define('window_stride', (2, 2), '[height stride, width stride].')
    p.Define('pooling_type', 'MAX', f'One of {list(layer_utils.POOLING_TYPES)}.')
    p.Define('padding', 'VALID', f'One of {list(layer_utils.PADDINGS)}.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    layer_utils.CheckShape(self, 'window_shape', p.window_shape, 2)
    layer_utils.CheckShape(self, 'window_stride', p.window_stride, 2)
    layer_utils.CheckChoice(self, 'pooling_type', p.pooling_type, layer_utils.POOLING_TYPES)
    layer_utils.CheckChoice(self, 'padding', p.padding, layer_utils.PADDINGS)

  def FProp(self, theta, inputs):
    """[B, H, W, C] -> [B, H', W', C]."""
    del theta  # No variables.
    p = self.params
    pool = lambda x: tf.nn.pool(x, p.window_shape, p.pooling_type, strides=p.window_stride,
                                padding=p.padding)
    x = self.ToFPropDtype(inputs)
    return layer_utils.OnAtLeastOneRow(pool, x) if p.pooling_type == 'MAX' else pool(x)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    depth = layer_utils.AsShape(input_shape)[-1]
    out = layer_utils.WindowOutputShape(input_shape, params.window_shape, params.window_stride,
                             params.padding, depth)
    window = params.window_shape[0] * params.window_shape[1]
    return layer_utils.Meta(layer_utils.NumElements(out) * window, out)


class GlobalPoolingLayer(base_layer.BaseLayer):
  """Averages NHWC inputs over height and width: [B, H, W, C] -> [B, C]."""

  def FProp(self, theta, inputs):
    del theta  # No variables.
    return tf.reduce_mean(self.ToFPropDtype(inputs), axis=[1, 2])

  @classmethod
  def FPropMeta(cls, params, input_shape):
    shape = layer_utils.AsShape(input_shape)
    return layer_utils.Meta(layer_utils.NumElements(shape), [shape[0], shape[-1]])


class BatchNormLayer(base_layer.BaseLayer):
  """Batch normalization over all but the last dimension.

  Training normalizes with the batch's statistics and records them
  (RecordUpdate); the moving averages follow the combined statistics of a whole
  step's micro-batches, exactly as if the batch had not been split. Eval
  normalizes with the moving averages.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 0, 'Depth of the inputs (their last dimension).')
    p.Define('decay', 0.999, 'moving = decay * moving + (1 - decay) * batch statistic.')
    p.Define('epsilon', 1e-3, 'Added to the variance so constant inputs do not divide by 0.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    layer_utils.CheckPositive(self, dim=p.dim)
    layer_utils.CheckProb(self, 'decay', p.decay, low_open=False, high_open=False)
    zeros, ones = py_utils.WeightInit.Constant(0.0), py_utils.WeightInit.Constant(1.0)
    self.CreateVariable('beta', py_utils.WeightParams([p.dim], zeros))
    self.CreateVariable('gamma', py_utils.WeightParams([p.dim], ones))
    self.CreateVariable('moving_mean', py_utils.WeightParams([p.dim], zeros, trainable=False))
    self.CreateVariable('moving_variance',
                        py_utils.WeightParams([p.dim], ones, trainable=False))

  def FProp(self, theta, inputs):
    """[..., dim] -> [..., dim]."""
    x32 = tf.cast(inputs, tf.float32)
    if py_utils.CurrentContext().training:
      mean, variance = tf.nn.moments(x32, axes=list(range(x32.shape.rank - 1)))
      count = tf.cast(tf.size(x32) // self.params.dim, tf.float32)
      self.RecordUpdate(tf.nest.map_structure(
          tf.stop_gradient, py_utils.NestedMap(mean=mean, variance=variance, count=count)))
    else:
      mean, variance = theta.moving_mean, theta.moving_variance
    return layer_utils.Normalize(x32, mean, variance, self.params.epsilon,
                      self.ToFPropDtype(theta.gamma), self.ToFPropDtype(theta.beta))

  def CombineUpdates(self, stats_list):
    """The exact mean and biased variance of the union of the batches."""
    return py_utils.CombineMoments(stats_list)

  def ApplyUpdate(self, stats):
    decay = self.params.decay
    for name, batch_value in (('moving_mean', stats.mean), ('moving_variance', stats.variance)):
      var = self.vars[name]
      var.assign(decay * var + (1.0 - decay) * batch_value)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    return layer_utils.Meta(layer_utils.NORM_FLOPS * layer_utils.NumElements(input_shape),
                            input_shape)
