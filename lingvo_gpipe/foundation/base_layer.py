"""BaseLayer: a `tf.Module` configured by Params whose FProp is a pure function of theta.

Layers build children and variables in `__init__` and compute in
`FProp(theta, *inputs)`, reading weights only from `theta`. Because the forward
pass is a function of (theta, inputs), the pipeline can re-run it on any device,
for any micro-batch, and get the same numbers.

A layer's identity is its path in the model ('lm/stack/dec3/ff'): variable
names, initial values, random seeds and checkpoint keys all derive from it. A
grouping that is not part of the model (a pipeline cell, which only says where
the cut falls) is *transparent*: its children are named as its parent's, so the
same model cut into other cells has the same identity, and a checkpoint of a
layer (tf.train.Checkpoint) lists the layers and variables by those names.
"""

import contextlib
import contextvars
import functools
import zlib

import numpy as np
import tensorflow as tf

from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils

# The layer whose __init__ is running, so a child learns its path and seed.
_PARENT = contextvars.ContextVar('lingvo_gpipe_parent_layer', default=None)


@contextlib.contextmanager
def _ParentScope(layer):
  token = _PARENT.set(layer)
  try:
    yield
  finally:
    _PARENT.reset(token)


def ApplyRecordedUpdates(updates):
  """Applies (layer, stats) records: one combined update per layer, in order."""
  by_layer = {}
  for layer, stats in updates:
    by_layer.setdefault(id(layer), (layer, []))[1].append(stats)
  for layer, stats_list in by_layer.values():
    layer.ApplyUpdate(layer.CombineUpdates(stats_list))


class _CallCounter:
  """A count of calls in an int64 variable made on first use (in or out of tf.function).

  A plain object, not a tf.Module, so the variable is no part of the model.
  """

  def __init__(self):
    self._var = None

  def Next(self):
    """The number of earlier calls, as a tensor; counts this call."""
    if self._var is None:
      with tf.init_scope():
        self._var = tf.Variable(0, dtype=tf.int64, trainable=False, name='call_count')
    return self._var.assign_add(1) - 1


def _CastsToFPropDtype(fprop):
  """FProp that first casts theta and floating inputs to the layer's fprop_dtype.

  Only the layer's own trainable variables are cast: its children's theta is
  cast by the children when they run, so a gradient taken through the call (a
  pipeline's, an optimizer's) stays in the variables' dtype; non-trainable
  state such as moving statistics keeps its precision.
  """

  @functools.wraps(fprop)
  def FProp(self, theta, *args, **kwargs):
    if self.CAST_TO_FPROP_DTYPE:
      theta, args, kwargs = self.CastToFPropDtype(theta, args, kwargs)
    return fprop(self, theta, *args, **kwargs)

  FProp.casts_to_fprop_dtype = True
  return FProp


_DEFAULT_PARAMS_INIT = py_utils.WeightInit.Xavier()


class BaseLayer(tf.Module):
  """Base class of all layers.

  Mixed precision is done here, once for every layer: the FProp of every
  subclass is wrapped so that it receives its trainable theta and floating
  inputs in `fprop_dtype` (CastToFPropDtype), while the variables and their
  gradients stay in `dtype`. A layer that handles dtypes itself sets the class
  attribute CAST_TO_FPROP_DTYPE = False.
  """

  # False for a layer whose FProp takes theta and inputs in the dtypes they come in.
  CAST_TO_FPROP_DTYPE = True

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    fprop = cls.__dict__.get('FProp')
    if fprop is not None and not getattr(fprop, 'casts_to_fprop_dtype', False):
      cls.FProp = _CastsToFPropDtype(fprop)

  @classmethod
  def Params(cls):
    """Params of this layer class; `p.Instantiate()` builds one."""
    p = hyperparams.InstantiableParams(cls)
    p.Define('name', '', 'Layer name: the last component of its variable path.')
    p.Define('dtype', tf.float32, "Dtype of the variables; left at float32, the parent's.")
    p.Define('fprop_dtype', None,
             'Dtype of activations; None inherits the parent\'s, else `dtype`.')
    p.Define('random_seed', None,
             'Seed of initial values and random ops; None inherits the parent\'s (0 at the top).',
             kinds=(int,))
    p.Define('params_init', _DEFAULT_PARAMS_INIT.Copy(),
             "Initializer of variables whose WeightParams name none; left at this default, "
             "the parent's.")
    return p

  # True for groupings that are not part of the model's identity (see the module doc).
  TRANSPARENT = False
  # _identity repeats the variables and children: tf.Module need not walk it twice.
  _TF_MODULE_IGNORED_PROPERTIES = tf.Module._TF_MODULE_IGNORED_PROPERTIES | {'_identity'}

  def __init__(self, params):
    if not params.name:
      raise ValueError(f'{type(self).__name__} params need a non-empty name.')
    if not params.name.isidentifier():
      raise ValueError(f'Layer name {params.name!r} is invalid: expected an identifier.')
    super().__init__(name=params.name)
    parent = _PARENT.get()
    p = params.Copy()
    if parent and p.dtype == tf.float32:
      p.dtype = parent.params.dtype
    if p.random_seed is None:
      p.random_seed = parent.params.random_seed if parent else 0
    if p.fprop_dtype is None:
      p.fprop_dtype = parent.params.fprop_dtype if parent else p.dtype
    if parent and p.params_init == _DEFAULT_PARAMS_INIT:
      p.params_init = parent.params.params_init.Copy()
    self._params = p.Freeze()
    parent_scope = parent.scope if parent else ''
    self._path = f'{parent_scope}/{p.name}' if parent_scope else p.name
    self._scope = parent_scope if self.TRANSPARENT else self._path
    self._variables_dict = {}
    self._children_dict = {}
    self._identity = {}  # What a checkpoint of this layer holds, by name (_Register).
    self._call_count = _CallCounter()

  @property
  def params(self):
    """The frozen params this layer was built from."""
    return self._params

  @property
  def path(self):
    """'parent/child/...': names this layer in messages and seeds its random ops."""
    return self._path

  @property
  def scope(self):
    """The prefix of the names of this layer's variables and children: its path, or its
    parent's scope if this layer is transparent."""
    return self._scope

  @property
  def layer_seed(self):
    """An integer seed for this layer's random ops, distinct per path."""
    return (int(self.params.random_seed) * 1000003 + zlib.crc32(self.path.encode())) & 0x7FFFFFFF

  @property
  def fprop_dtype(self):
    return self.params.fprop_dtype

  def __getattr__(self, name):
    children = self.__dict__.get('_children_dict')
    if children is not None and name in children:
      return children[name]
    raise AttributeError(f'{type(self).__name__} {self.__dict__.get("_path", "?")!r} '
                         f'has no attribute or child {name!r}.')

  # -- construction ------------------------------------------------------------

  def _CheckNewName(self, name):
    if not name.isidentifier():
      raise ValueError(f'Child or variable name {name!r} is invalid: expected an identifier.')
    if name in self._children_dict or name in self._variables_dict:
      raise ValueError(f'{self.path}: {name!r} is already a child or variable.')

  def _Register(self, name, value):
    """Adds a variable or child layer to this layer's identity (a transparent child's own
    identity instead), refusing a name taken: two layers would share variable names."""
    items = value.IdentityItems() if getattr(value, 'TRANSPARENT', False) else {name: value}
    for key, item in items.items():
      if key in self._identity:
        raise ValueError(f'{self.path}: two layers or variables are named {self.scope}/{key}; '
                         'names must be unique, also across pipeline cells, which are not '
                         'part of the names.')
      self._identity[key] = item

  def _Build(self, name, p):
    p = p.Copy()
    p.name = name
    with _ParentScope(self):
      child = p.Instantiate()
    self._Register(name, child)
    return child

  def CreateChild(self, name, p):
    """Builds child layer `name` from params `p`; reachable as self.<name>."""
    self._CheckNewName(name)
    child = self._Build(name, p)
    self._children_dict[name] = child
    return child

  def CreateChildren(self, name, params_list, devices=None):
    """Builds a list of children; each is named by its params' name, else name<i>.

    devices: optional device names, one per child, where its variables live.
    """
    self._CheckNewName(name)
    names = [p.name or f'{name}{i}' for i, p in enumerate(params_list)]
    if len(set(names)) != len(names):
      raise ValueError(f'{self.path}: children of {name!r} have duplicate names {names}.')
    children = []
    for i, (child_name, p) in enumerate(zip(names, params_list)):
      with tf.device(devices[i]) if devices else contextlib.nullcontext():
        children.append(self._Build(child_name, p))
    self._children_dict[name] = children
    return children

  def CreateVariable(self, name, weight_params):
    """Creates variable `name`; its initial value depends only on the seed and path."""
    self._CheckNewName(name)
    if self.TRANSPARENT:
      raise ValueError(f'{self.path}: a {type(self).__name__} groups layers and cannot own '
                       f'variable {name!r}.')
    wp = weight_params
    dtype = wp.dtype or self.params.dtype
    init = wp.init or self.params.params_init
    path = f'{self.scope}/{name}'
    seed = py_utils.PathSeed(self.params.random_seed, path)
    value = py_utils.InitialValue(init, wp.shape, dtype, seed)
    var = tf.Variable(value, name=path, trainable=wp.trainable)
    self._Register(name, var)
    self._variables_dict[name] = var
    return var

  def AddSharedVariable(self, name, var):
    """Makes `var`, created by another layer, also this layer's variable `name`.

    For tied weights: theta then holds the same tf.Variable in two places, and
    a pipeline returns one gradient share per place, to be summed per variable.
    """
    self._CheckNewName(name)
    self._Register(name, var)
    self._variables_dict[name] = var
    return var

  def LayersByPath(self):
    """path -> layer, of this layer and every layer below it."""
    out = {self.path: self}
    for child in self._children_dict.values():
      for layer in child if isinstance(child, list) else [child]:
        out.update(layer.LayersByPath())
    return out

  def IdentityItems(self):
    """name -> variable or child layer: what identifies this layer in a model."""
    return dict(self._identity)

  def _trackable_children(self, save_type='checkpoint', **kwargs):
    """A checkpoint of a layer holds its identity: the same at any pipeline cut.

    (tf.Module would list its attributes, so cells and their indices.) A
    SavedModel also gets the tf.functions that tf.Module finds.
    """
    children = self.IdentityItems()
    if save_type == 'savedmodel':
      functions = super()._trackable_children(save_type, **kwargs)
      children.update((name, fn) for name, fn in functions.items()
                      if isinstance(fn, (tf.types.experimental.PolymorphicFunction,
                                         tf.types.experimental.ConcreteFunction)))
    return children

  # -- theta ------------------------------------------------------------------

  @property
  def vars(self):
    """NestedMap of this layer's variables, mirroring the child tree."""
    out = py_utils.NestedMap(self._variables_dict)
    for name, child in self._children_dict.items():
      out[name] = [c.vars for c in child] if isinstance(child, list) else child.vars
    return out

  @property
  def theta(self):
    """The values FProp reads: by default the variables themselves."""
    return self.vars

  def CastToFPropDtype(self, theta, args, kwargs):
    """(theta, args, kwargs) as FProp receives them: this layer's trainable floating
    variables in theta and every floating tensor or array in args and kwargs cast to
    fprop_dtype; everything else as given."""
    dtype = tf.as_dtype(self.fprop_dtype)

    def Cast(x):
      if isinstance(x, (tf.Tensor, tf.Variable, np.ndarray)):
        x_dtype = tf.as_dtype(x.dtype)
        if x_dtype.is_floating and x_dtype != dtype:
          return tf.cast(x, dtype)
      return x

    if isinstance(theta, dict):
      own = [name for name, var in self._variables_dict.items()
             if var.trainable and name in theta]
      if own:
        theta = type(theta)(theta)
        for name in own:
          theta[name] = Cast(theta[name])
    return theta, tf.nest.map_structure(Cast, args), tf.nest.map_structure(Cast, kwargs)

  def ToFPropDtype(self, value):
    """Casts floating tensors (theta or activations) to the activation dtype."""
    def Cast(x):
      x = tf.convert_to_tensor(x)
      return tf.cast(x, self.fprop_dtype) if x.dtype.is_floating else x
    return tf.nest.map_structure(Cast, value)

  # -- computation -------------------------------------------------------------

  def TrainingStep(self):
    """The step that seeds this training call's random ops (dropout masks).

    It is the FProp context's step when one is set (the trainer sets the global
    step); else the number of this layer's earlier calls that asked, so that
    consecutive training steps of a user's own loop draw new masks. That count
    lives outside the layer's variables and checkpoints: to resume a run's masks
    exactly, set `py_utils.Context(step=...)`.
    """
    step = py_utils.CurrentContext().step
    return self._call_count.Next() if step is None else step

  def FProp(self, theta, *args, **kwargs):
    """The forward computation, a pure function of theta and the inputs."""
    raise NotImplementedError(f'{type(self).__name__}.FProp')

  def __call__(self, *args, **kwargs):
    return self.FProp(self.theta, *args, **kwargs)

  # -- state updates (e.g. batch-norm moving statistics) ------------------------

  def RecordUpdate(self, stats):
    """Hands this layer's per-batch statistics to whoever applies updates.

    Outside a pipeline the update is applied at once. Inside one, the pipeline
    collects the statistics of every micro-batch's real forward (recomputed
    forwards record nothing) and applies their combination once per step.
    """
    updates = py_utils.CurrentContext().updates
    if updates is None:
      self.ApplyUpdate(stats)
    else:
      updates.append((self, stats))

  def CombineUpdates(self, stats_list):
    """Merges the statistics of several micro-batches into one batch's."""
    raise NotImplementedError(f'{type(self).__name__}.CombineUpdates')

  def ApplyUpdate(self, stats):
    """Applies one batch's statistics to this layer's state variables."""
    raise NotImplementedError(f'{type(self).__name__}.ApplyUpdate')

  @classmethod
  def HasFPropMeta(cls):
    return cls.FPropMeta.__func__ is not BaseLayer.FPropMeta.__func__

  @classmethod
  def FPropMeta(cls, params, *input_shapes):
    """NestedMap(flops=..., out_shapes=(...)) for partitioning; optional."""
    raise NotImplementedError(f'{cls.__name__} has no FPropMeta.')
