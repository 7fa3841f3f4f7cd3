"""KerasLayer: a Keras 3 layer as a lingvo_gpipe layer, so pipelines can hold Keras layers.

The Keras layer is built from params (a function that makes it, or its
`keras.layers.serialize` config), so it lives in params classes and in
`gpipe.PartitionSequentialLayers` like any layer. Its variables are this
layer's variables, created once and named by its path ('pipe/dense0/kernel'),
so they are the pipeline's theta: tracked, checkpointed and trained. FProp runs
the Keras layer as a pure function of theta, as Keras 3's `stateless_call` does
(`keras.StatelessScope` maps each Keras variable to its theta value), through
the layer's `__call__` so that Keras applies its dtype policy.

What Keras would do with state, this layer does the way the pipeline needs it:
  * `keras.layers.Dropout` draws its mask from `py_utils.BatchUniform`, the
    stateless per-example noise of DropoutLayer: the same units drop for any
    number of micro-batches or stages, and again in a recomputed forward. Its
    seed is the layer's path, and the Dropout's own seed if it has one. Its
    subclasses (SpatialDropout*) are refused: their masks are not per element.
    Random ops inside other layers (MultiHeadAttention's dropout, GaussianNoise)
    get a seed from (layer, step, micro-batch): deterministic under
    re-materialization, but other numbers than the same layer unpipelined.
  * `keras.layers.BatchNormalization` normalizes with each micro-batch's
    statistics and records them (RecordUpdate): the moving averages follow the
    whole batch's statistics once per step, as BatchNormLayer's do.
  * Any other update of a non-trainable variable in `call()` is an error: the
    pipeline could not apply it once per step. So is a loss added in `call()`.
  * A layer that makes a Keras mask (Embedding(mask_zero=True), Masking) is an
    error: the mask would not reach the layers after a cut.

Initial values are those of the Keras layer's initializers; the seeds Keras
draws for unseeded ones derive from this layer's path, so the values do not
depend on Keras's or Python's random state or on where a pipeline cuts the model.

Mixed precision: the Keras layer computes in its dtype policy's compute dtype,
and that is this layer's fprop_dtype. A layer made under a mixed policy (e.g.
`keras.mixed_precision.set_global_policy('mixed_bfloat16')`) sets fprop_dtype;
a float32 Keras layer inside params whose fprop_dtype is bfloat16 or float16 is
given the 'mixed_<dtype>' policy. Variables stay in their dtype. A dtype or
fprop_dtype inherited from a parent (one that sets float64, say) gives way to
the Keras layer's own; one set in this layer's params must match it.
"""

import contextlib
import math
import random
import re

import keras
import tensorflow as tf

from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import layer_utils

# Keras's SeedGenerator names its state variable so (keras.random.SeedGenerator).
_SEED_STATE_NAME = 'seed_generator_state'
_MIXED_POLICIES = {'float16': 'mixed_float16', 'bfloat16': 'mixed_bfloat16'}


@contextlib.contextmanager
def _KerasInitSeed(seed):
  """Keras's unseeded initializers and random layers draw their seeds from Python's
  `random` when they are made: in this scope it is seeded by `seed`; its state is
  restored afterwards, also on error."""
  state = random.getstate()
  random.seed(seed)
  try:
    yield
  finally:
    random.setstate(state)


def _ExampleShape(what, input_shape):
  """`input_shape` (one example's, no batch dimension) as a tuple of ints or None."""
  if not isinstance(input_shape, (list, tuple, tf.TensorShape)) or not all(
      d is None or (isinstance(d, int) and d > 0) for d in input_shape):
    raise ValueError(f'{what}: input_shape must be the shape of one example without the '
                     f'batch dimension, a list of positive ints (or None), e.g. [64]; got '
                     f'{input_shape!r}.')
  return tuple(input_shape)


def _NewKerasLayer(what, spec):
  """A new, unbuilt Keras layer from params.layer: a function or a serialized config."""
  if isinstance(spec, dict):
    try:  # Without its build_config, deserialize leaves the layer unbuilt.
      layer = keras.layers.deserialize({k: v for k, v in spec.items() if k != 'build_config'})
    except (TypeError, ValueError) as e:
      # Keras nests the cause in 'Exception encountered:' paragraphs: the last is the cause.
      cause = str(e).split(' Full object config:')[0].rsplit('Exception encountered:', 1)[-1]
      cause = cause.strip()
      advice = (' (Here: keras.config.enable_unsafe_deserialization().)'
                if 'safe_mode' in cause else '')
      raise ValueError(f'{what}: a pipeline builds each Keras layer from its config, and Keras '
                       f'cannot: {cause}{advice}') from None
  elif callable(spec) and not isinstance(spec, keras.layers.Layer):
    layer = spec()
  else:
    raise ValueError(
        f'{what}: params.layer must be a function that returns a new Keras layer (e.g. '
        f'lambda: keras.layers.Dense(64)) or a keras.layers.serialize(layer) config; got '
        f'{type(spec).__name__}.')
  if not isinstance(layer, keras.layers.Layer):
    raise ValueError(f'{what}: params.layer made a {type(layer).__name__}; expected a '
                     'keras.layers.Layer.')
  if layer.built and layer.weights:
    raise ValueError(f'{what}: params.layer returned the built Keras layer {layer.name!r}; '
                     'KerasLayer builds its own, so the function must make a new layer on '
                     'each call (its weights can be copied in with set_weights).')
  return layer


def _Shape(spec):
  """The shape of a Keras output spec, or a tuple of them for several outputs."""
  if isinstance(spec, (list, tuple)):
    return tuple(_Shape(s) for s in spec)
  return tf.TensorShape(spec.shape)


class KerasLayer(base_layer.BaseLayer):
  """A Keras 3 layer run as a pure function of theta (see the module doc).

  Example:
    p = keras_layer.KerasLayer.Params().Set(
        name='ff', layer=lambda: keras.layers.Dense(64, activation='relu'), input_shape=[32])
    cells = gpipe.PartitionSequentialLayers([p, ...], 4, tf.TensorShape([batch, 32]))
  """

  # The Keras layer casts by its own dtype policy; its variables must map unchanged.
  CAST_TO_FPROP_DTYPE = False
  _TF_MODULE_IGNORED_PROPERTIES = base_layer.BaseLayer._TF_MODULE_IGNORED_PROPERTIES | {
      '_keras_layer'}

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('layer', None,
             'The Keras layer: a function returning a new keras.layers.Layer, or the '
             'keras.layers.serialize() config of one.')
    p.Define('input_shape', None,
             "Shape of one example's input, without the batch dimension, e.g. [64].")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    shape = _ExampleShape(self.path, p.input_shape)
    with _KerasInitSeed(self.layer_seed), tf.variable_creator_scope(self._CreateVariable):
      layer = _NewKerasLayer(self.path, p.layer)
      self._SetDTypePolicy(layer, params)
      layer.build((None,) + shape)
    self._keras_layer = layer
    names = {var.ref(): name for name, var in self._variables_dict.items()}
    foreign = [v.path for v in layer.variables if v.value.ref() not in names]
    if foreign:
      raise ValueError(f'{self.path}: the Keras layer has variables it did not create in its '
                       f'build ({foreign}); KerasLayer needs a layer that owns its variables.')
    # (our variable name, Keras variable), in the order of layer.variables.
    self._state = [(names[v.value.ref()], v) for v in layer.variables]
    if isinstance(layer, keras.layers.Dropout) and type(layer) is not keras.layers.Dropout:
      raise ValueError(f'{self.path}: {type(layer).__name__} is not supported: its mask would '
                       'be drawn per element; use keras.layers.Dropout with a noise_shape '
                       '(SpatialDropout1D is noise_shape=(None, 1, channels)).')
    if isinstance(layer, keras.layers.Dropout) and layer.noise_shape is not None and (
        layer.noise_shape[0] is not None):
      raise ValueError(f'{self.path}: Dropout noise_shape {layer.noise_shape} must leave the '
                       'batch dimension None: each example draws its own mask.')
    if layer.compute_mask(keras.KerasTensor((None,) + shape), None) is not None:
      raise ValueError(f'{self.path}: the Keras layer {layer.name!r} makes a Keras mask (as '
                       'Embedding(mask_zero=True) or Masking do), which the layers after it '
                       'would not get once a pipeline cut lies between them; leave the mask '
                       'off and pass the padding yourself (e.g. as zeros).')
    if getattr(layer, 'activity_regularizer', None) is not None:
      raise ValueError(f'{self.path}: activity_regularizer is not supported: the loss it adds '
                       'in call() would be dropped (weight regularizers work).')
    if isinstance(layer, keras.layers.BatchNormalization) and layer.renorm:
      raise ValueError(f'{self.path}: BatchNormalization(renorm=True) is not supported; its '
                       'renorm statistics would be updated once per micro-batch.')

  @property
  def keras_layer(self):
    """The Keras layer; its variables are this layer's (get_weights, set_weights)."""
    return self._keras_layer

  def _CreateVariable(self, next_creator, **kwargs):
    """Creates the Keras layer's variables as this layer's, named by its path."""
    name = re.sub(r'\W', '_', kwargs.get('name') or 'variable')
    if not name.isidentifier():
      name = f'v_{name}'
    unique, i = name, 1
    while unique in self._variables_dict:
      unique, i = f'{name}_{i}', i + 1
    kwargs['name'] = f'{self.scope}/{unique}'
    with tf.name_scope(''):  # Not below the Keras layer's name scopes.
      var = next_creator(**kwargs)
    self._Register(unique, var)
    self._variables_dict[unique] = var
    return var

  def _SetDTypePolicy(self, layer, given):
    """Reconciles the Keras layer's dtype policy with dtype and fprop_dtype (module doc);
    `given` are the params as given, before a parent's dtypes were inherited."""
    p = self.params
    dtype, fprop_dtype = tf.as_dtype(p.dtype).name, tf.as_dtype(p.fprop_dtype).name
    if layer.variable_dtype != dtype:
      if given.dtype != tf.float32:  # Set for this layer, not inherited.
        raise ValueError(f'{self.path}: the Keras layer keeps variables in '
                         f'{layer.variable_dtype} but params.dtype is {dtype}.')
      dtype = layer.variable_dtype  # The Keras layer's own variables, as in Keras.
    compute = layer.compute_dtype
    if compute != fprop_dtype and compute == dtype and fprop_dtype in _MIXED_POLICIES:
      layer.dtype_policy = _MIXED_POLICIES[fprop_dtype]
      compute = fprop_dtype
    elif compute != fprop_dtype and given.fprop_dtype is not None:
      raise ValueError(f'{self.path}: the Keras layer computes in {compute} (its dtype policy '
                       f'{layer.dtype_policy.name}) but params.fprop_dtype is {fprop_dtype}.')
    self._params = p.Copy().Set(dtype=tf.as_dtype(dtype),
                                fprop_dtype=tf.as_dtype(compute)).Freeze()

  # -- computation -------------------------------------------------------------

  def FProp(self, theta, inputs):
    """The Keras layer's output for `inputs`, its variables read from theta."""
    layer = self._keras_layer
    training = bool(py_utils.CurrentContext().training)
    if isinstance(layer, keras.layers.Dropout):
      return self._Dropout(inputs, training)
    random_state = training and any(v.name == _SEED_STATE_NAME for _, v in self._state)
    step = self.TrainingStep() if random_state else None
    mapping = [(v, self._SeedState(i, step) if random_state and v.name == _SEED_STATE_NAME
                else theta[name]) for i, (name, v) in enumerate(self._state)]
    # Below a scope of ours: Keras names its scope after the layer, and at a function's root
    # a name such as '_odd' (a class _Odd) is not a valid TensorFlow scope.
    with tf.name_scope('keras'), keras.StatelessScope(state_mapping=mapping,
                                                      collect_losses=True) as scope:
      before = [scope.get_current_value(v) for _, v in self._state]
      if isinstance(layer, _NEED_A_ROW):
        out = layer_utils.OnAtLeastOneRow(lambda x: layer(x, training=training), inputs)
      else:
        out = layer(inputs, training=training)
    if scope.losses:
      raise ValueError(f'{self.path}: the Keras layer {layer.name!r} adds a loss in call() '
                       '(add_loss), which the pipeline would drop; weight regularizers work.')
    updated = [v for (_, v), value in zip(self._state, before)
               if scope.get_current_value(v) is not value and v.name != _SEED_STATE_NAME]
    if isinstance(layer, keras.layers.BatchNormalization) and updated:
      self._RecordMoments(inputs)
      moving = (id(layer.moving_mean), id(layer.moving_variance))
      updated = [v for v in updated if id(v) not in moving]
    if updated:
      raise ValueError(f'{self.path}: the Keras layer {layer.name!r} updates '
                       f'{[v.path for v in updated]} in call(); KerasLayer applies only '
                       'BatchNormalization statistics, once per step.')
    return out

  def _SeedState(self, index, step):
    """The seed state of random op `index` in this training call: one per (layer, step,
    micro-batch), so a recomputed forward draws the same numbers."""
    where = py_utils.CurrentContext().batch_slice
    seed = tf.random.experimental.stateless_fold_in(
        tf.constant([self.layer_seed, index], tf.int64), tf.cast(step, tf.int64))
    if where is not None:
      seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(where.offset, tf.int64))
    return tf.cast(seed, self._state[index][1].dtype)

  def _Dropout(self, inputs, training):
    """keras.layers.Dropout with DropoutLayer's stateless per-example mask."""
    layer = self._keras_layer
    x = tf.convert_to_tensor(inputs)
    if x.dtype.is_floating:
      x = tf.cast(x, layer.compute_dtype)
    if not training or layer.rate == 0:
      return x
    like = x
    if layer.noise_shape is not None:
      dims = tf.unstack(tf.shape(x))
      like = tf.zeros([dims[i] if d is None else d for i, d in enumerate(layer.noise_shape)])
    keep_prob = 1.0 - layer.rate
    seed = self.layer_seed
    if layer.seed is not None:  # The user's seed: another seed gives other masks.
      seed = (seed * 1000003 + layer.seed) % 2**31
    keep = py_utils.BatchUniform(seed, self.TrainingStep(), like) < keep_prob
    return tf.where(keep, x / tf.cast(keep_prob, x.dtype), tf.zeros_like(x))

  # -- batch-norm statistics ------------------------------------------------------

  def _RecordMoments(self, inputs):
    """Records the float32 moments of `inputs` BatchNormalization normalized with."""
    x32 = tf.cast(inputs, tf.float32)
    rank = x32.shape.rank
    axes = [d for d in range(rank) if d != self._keras_layer.axis % rank]
    mean, variance = tf.nn.moments(x32, axes=axes)
    count = tf.cast(tf.size(x32) // tf.size(mean), tf.float32)
    self.RecordUpdate(tf.nest.map_structure(
        tf.stop_gradient, py_utils.NestedMap(mean=mean, variance=variance, count=count)))

  def CombineUpdates(self, stats_list):
    return py_utils.CombineMoments(stats_list)

  def ApplyUpdate(self, stats):
    """moving = momentum * moving + (1 - momentum) * statistic, as Keras's."""
    layer = self._keras_layer
    momentum = layer.momentum
    names = {id(v): name for name, v in self._state}
    for keras_var, value in ((layer.moving_mean, stats.mean),
                             (layer.moving_variance, stats.variance)):
      var = self.vars[names[id(keras_var)]]
      var.assign(momentum * var + (1.0 - momentum) * tf.cast(value, var.dtype))

  # -- partitioning -----------------------------------------------------------------

  @classmethod
  def FPropMeta(cls, params, input_shape):
    """An estimate: 2 FLOPs per weight and output position (exact for Dense and
    convolutions), one per output element for layers without weights. Builds a
    throwaway copy of the layer, with Keras's global random state untouched."""
    what = params.name or cls.__name__
    shape = tf.TensorShape(input_shape)
    _ExampleShape(what, shape[1:])
    with _KerasInitSeed(0):
      layer = _NewKerasLayer(what, params.layer)
      layer.build(shape)
      out = _Shape(layer.compute_output_spec(keras.KerasTensor(shape.as_list())))
    outs = out if isinstance(out, tuple) else (out,)
    first = tf.TensorShape(outs[0])
    weights = layer.count_params()
    if weights:
      flops = 2 * weights * math.prod(d or 1 for d in first[:-1])
    else:
      flops = math.prod(d or 1 for d in first)
    return py_utils.NestedMap(flops=flops, out_shapes=outs)


# Layers whose TensorFlow CPU kernels fail on a batch of no rows (layer_utils.OnAtLeastOneRow).
_NEED_A_ROW = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
               keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D,
               keras.layers.SeparableConv1D, keras.layers.SeparableConv2D,
               keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D)


def _LayerName(config, index):
  """'dense0', 'batch_normalization3': the class in snake case and the position."""
  snake = re.sub(r'(?<!^)(?=[A-Z])', '_', config['class_name']).lower()
  return f'{snake}{index}'


def ParamsFromKerasLayers(keras_layers, input_shape):
  """KerasLayer params of Keras layers run in order, each given its input shape.

  Args:
    keras_layers: Keras layer objects (built or not) or their
      keras.layers.serialize() configs; each becomes a KerasLayer built from its
      config, named '<class in snake case><index>'. Weights are not carried:
      copy them with set_weights (keras_pipeline.PipelineModel does).
    input_shape: the first layer's input shape of one example (no batch dimension).

  Returns:
    (list of KerasLayer params, the last layer's output shape of one example).
  """
  shape = _ExampleShape('ParamsFromKerasLayers', input_shape)
  params_list = []
  for i, layer in enumerate(keras_layers):
    if isinstance(layer, keras.layers.Layer):
      config = keras.layers.serialize(layer)
    elif isinstance(layer, dict) and 'class_name' in layer:
      config = layer
    else:
      raise ValueError(f'Layer {i} is a {type(layer).__name__}; expected a Keras layer or '
                       'its keras.layers.serialize() config.')
    p = KerasLayer.Params().Set(name=_LayerName(config, i), layer=config,
                                input_shape=list(shape))
    params_list.append(p)
    out = KerasLayer.FPropMeta(p, tf.TensorShape((1,) + shape)).out_shapes
    if len(out) != 1:
      raise ValueError(f'Layer {i} ({p.name}) has {len(out)} outputs; a sequence of Keras '
                       'layers must pass one tensor from layer to layer.')
    shape = tuple(out[0][1:].as_list())
  return params_list, shape
