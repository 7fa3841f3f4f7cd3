"""PipelineModel: a Keras model whose layers run as a GPipe pipeline.

    model = keras.Sequential([keras.Input((64,)), ...])  # An existing model, or a layer list.
    pipe = keras_pipeline.PipelineModel(model, num_stages=4, num_micro_batches=8,
                                        schedule='1f1b')
    pipe.compile(optimizer='adam', loss='mse')
    pipe.fit(x, y, batch_size=64, epochs=10)

The layers are cut into `num_stages` balanced cells on as many devices
(`num_stages * virtual_stages` chunks for schedules that put several on each
device: gpipe.PartitionSequentialLayers), each batch into `num_micro_batches`,
and the backward pass re-computes each cell's forward instead of storing
activations. Each layer runs as a KerasLayer (lingvo_gpipe/layers/keras_layer.py) built from
its config and starting from its weights if it has any, so the given layers are
copied, not shared: read the trained weights from this model.

Training runs the pipeline's schedule, any of named_schedules.SCHEDULE_NAMES:
train_step calls PipeliningLayer.ForwardBackward, which runs the schedule's
forward and backward actions itself (Keras's default train_step differentiates
the forward, which can only run fill-drain). The loss is compile()'s, taken on
each micro-batch's outputs with its rows of the targets and sample weights
('gpipe': once on the whole batch) and merged into the whole batch's (a mean
weighs micro-batches by their rows); the layers' weight regularizers
(self.losses) read only the weights and are added outside the pipeline;
compiled metrics run on the whole batch's outputs. An overridden compute_loss
is refused by fit(), as are a layer's activity_regularizer and a loss added in
call(), and, but for 'gpipe', a loss with ignore_class.

It is a keras.Model: compile, fit (with callbacks and validation data),
evaluate, predict, save and keras.models.load_model, export, and get_weights /
set_weights, which list the weights in the order a keras.Sequential of the same
layers does, so weights move between the two. Training it gives the same losses
and weights as the Keras model unpipelined, up to float rounding; Dropout masks
come from the step and each example's position (KerasLayer), not from Keras's
random state, so they match the unpipelined model with the same masks.

Any batch runs: one that num_micro_batches does not divide is split into
micro-batches that differ by a row (10 examples, M=4: 3, 3, 2, 2), and a batch
of unknown size at trace time is split when it runs, so fit() takes a partial
last batch and export() serves a `[None, ...]` signature, one example too. A
batch smaller than num_micro_batches leaves micro-batches empty, which add
nothing. With a Keras
mixed-precision policy (e.g.
keras.mixed_precision.set_global_policy('mixed_bfloat16')) the layers compute in
its compute dtype and the weights stay float32; a layer given its own dtype (a
float32 output layer, as Keras advises) computes in that, as in Keras.
"""

import contextlib
import functools
from typing import Any, Callable, Sequence
import warnings

import keras
from keras.src import backend as keras_backend  # AutocastScope: no public name.
import numpy as np
import tensorflow as tf

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import keras_layer
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import schedule as schedule_lib
from lingvo_gpipe.pipeline import steady_state

# The attribute that marks a Keras step function as rerunning its cancelled steps.
_RERUNS = '_lingvo_gpipe_reruns_cancelled_steps'


def _ComputeDType(config: dict[str, Any]) -> tf.DType:
  """The compute dtype of a serialized Keras layer's dtype policy."""
  return tf.as_dtype(keras.dtype_policies.get(config['config'].get('dtype')).compute_dtype)


def _LayersAndShape(layers) -> tuple[list, tuple | None]:
  """(layers, one example's input shape or None) of a Sequential or a layer list."""
  if isinstance(layers, keras.Sequential):
    shape = tuple(layers.inputs[0].shape[1:]) if layers.built and layers.inputs else None
    return _Flattened(layers.layers), shape
  if not isinstance(layers, (list, tuple)) or not layers:
    raise ValueError(f'PipelineModel takes a keras.Sequential or a non-empty list of Keras '
                     f'layers; got {type(layers).__name__} {layers!r}.')
  layers = list(layers)
  if isinstance(layers[0], keras.KerasTensor):  # keras.Input(shape), as in a Sequential.
    return _Flattened(layers[1:]), tuple(layers[0].shape[1:])
  return _Flattened(layers), None


def _Flattened(layers: Sequence) -> list:
  """The layers with each keras.Sequential among them replaced by its own (it runs them in
  order, so the pipeline can cut between them); other models are refused."""
  out = []
  for layer in layers:
    if isinstance(layer, keras.Sequential):
      out += _Flattened(layer.layers)
    elif isinstance(layer, keras.Model):
      raise ValueError(f'PipelineModel takes Keras layers and Sequential blocks; got the '
                       f'{type(layer).__name__} {layer.name!r}, a model whose layers do not '
                       'run one after another: pass its layers, or make it a Sequential.')
    else:
      out.append(layer)
  return out


def _CheckedBalance(balance: Sequence[int], cost, num_layers: int, chunks: int) -> list[int]:
  """`balance` as a list of ints, or a ValueError naming what does not fit."""
  if cost != 'auto':
    raise ValueError(f'PipelineModel: give cost={cost!r} or balance={balance!r}, not both.')
  counts = [int(n) if isinstance(n, np.integer) else n for n in balance]
  if (len(counts) != chunks or not all(isinstance(n, int) and n >= 1 for n in counts) or
      sum(counts) != num_layers):
    raise ValueError(f'PipelineModel: balance={list(balance)!r} must be {chunks} counts >= 1 '
                     f'(num_stages * virtual_stages chunks) summing to the {num_layers} layers.')
  return counts


def _LossOption(loss: Any, name: str, default: Any = None) -> Any:
  """A loss object's or functools.partial's option `name` (default if it has none)."""
  if isinstance(loss, functools.partial):
    return loss.keywords.get(name, default)
  return getattr(loss, name, default)


@keras.saving.register_keras_serializable(package='lingvo_gpipe')
class PipelineModel(keras.Model):
  """A keras.Model running a sequence of Keras layers as a GPipe pipeline (module doc).

  Args:
    layers: a keras.Sequential, or a list of Keras layers (optionally starting
      with keras.Input(shape)), or their keras.layers.serialize() configs.
    num_stages: K, the number of cells and devices.
    num_micro_batches: M, the micro-batches each batch is split into.
    schedule: one of named_schedules.SCHEDULE_NAMES: 'gpipe' (fill-drain), '1f1b',
      'interleaved_1f1b', 'zb_h1', 'zb_h2', 'zbv'; or your own orders for these
      K, M and v as a schedule text (schedule.Schedule.ToText).
    virtual_stages: v chunks per device (interleaved_1f1b: any v, its
      num_micro_batches at most num_stages or a multiple of it; zbv: 2; the
      others: 1); the layers are cut into num_stages * v chunks.
    remat: re-materialization, 'always', 'except_last' or 'never'.
    devices: device names, one per stage; None takes the local devices.
    allow_device_reuse: place stages round-robin when there are fewer devices
      than stages (else that is a ValueError).
    cost: how stages are balanced: 'auto' or 'flops' (an estimate per layer,
      KerasLayer.FPropMeta), 'params', 'time' (measured), or per-layer numbers.
    balance: instead of a cost, the number of layers of each chunk, in order
      (torchgpipe's balance), e.g. [3, 2, 2, 1]: num_stages * virtual_stages
      counts that sum to the layers.
    jit_compile: compile each cell's forward and backward step with XLA (a whole
      train step cannot be: it spans the stages' devices); needs remat='always'.
    inline_cell_functions: the PipeliningLayer param: an op failing in a chunk
      raises its own error, not only CancelledError (docs/pipeline.md).
    loop_steady_state: the PipeliningLayer param: 'auto' runs a long steady state
      (M large) as one tf.while_loop, for a faster start; False unrolls every
      action (steps measured 2-15% faster, up to 1.5x with tiny layers); True loops
      any (docs/pipeline.md).
    input_shape: one example's input shape, if `layers` does not give it; else
      the model is built on its first call.
    **kwargs: keras.Model arguments (name, dtype, trainable).
  """

  def __init__(self, layers, num_stages: int = 1, num_micro_batches: int = 1,
               schedule: str = 'gpipe', virtual_stages: int = 1, remat: str = 'always',
               devices: Sequence[str] | None = None, allow_device_reuse: bool = False,
               cost='auto', balance: Sequence[int] | None = None, jit_compile: bool = False,
               input_shape: Sequence[int | None] | None = None,
               inline_cell_functions: bool = False, loop_steady_state: bool | str = 'auto',
               **kwargs):
    super().__init__(**kwargs)
    # XLA compiles one device's work and a train step spans the stages' devices: Keras
    # then warns of and ignores compile(jit_compile=True); see jit_compile above.
    self.supports_jit = False
    layers, shape = _LayersAndShape(layers)
    # numpy integers (a sweep over np.arange, say) count as ints, as in input_shape.
    num_stages, num_micro_batches, virtual_stages = (
        int(n) if isinstance(n, np.integer) else n
        for n in (num_stages, num_micro_batches, virtual_stages))
    # A ValueError naming a bad schedule, virtual_stages or loop setting now, not at the first
    # batch.
    steady_state.CheckSetting(loop_steady_state)
    self._whole_batch_loss = schedule_lib.ForPipeline(
        schedule, num_stages, num_micro_batches, virtual_stages).whole_batch_loss
    self._layer_configs = [layer if isinstance(layer, dict) else keras.layers.serialize(layer)
                           for layer in layers]
    # Weights of the given layers that are built, copied in when the pipeline is built.
    self._given_weights = [layer.get_weights() if isinstance(layer, keras.layers.Layer) and
                           layer.built else None for layer in layers]
    if balance is not None:
      balance = _CheckedBalance(balance, cost, len(layers), num_stages * virtual_stages)
    self._options = dict(num_stages=num_stages, num_micro_batches=num_micro_batches,
                         schedule=schedule, virtual_stages=virtual_stages, remat=remat,
                         devices=devices, allow_device_reuse=allow_device_reuse, cost=cost,
                         balance=balance, jit_compile=jit_compile,
                         inline_cell_functions=inline_cell_functions,
                         loop_steady_state=loop_steady_state)
    self._pipeline = None
    self._output_shape = None
    if input_shape is not None:
      if isinstance(input_shape, str) or not hasattr(input_shape, '__iter__') or not all(
          d is None or isinstance(d, (int, np.integer)) for d in input_shape):
        raise ValueError(f'PipelineModel: input_shape must be the shape of one example, ints '
                         f'such as (64,); got {input_shape!r}.')
      input_shape = tuple(None if d is None else int(d) for d in input_shape)
    if input_shape is not None and shape is not None and input_shape != shape:
      raise ValueError(f'PipelineModel: input_shape={tuple(input_shape)}, but the layers '
                       f'take examples of shape {shape} (their keras.Input).')
    shape = input_shape if input_shape is not None else shape
    self._input_shape = None if shape is None else tuple(shape)
    if self._input_shape is not None:
      self.build((None,) + self._input_shape)

  @property
  def pipeline(self) -> gpipe.PipeliningLayer | None:
    """The gpipe.PipeliningLayer that runs the layers (None before the model is built)."""
    return self._pipeline

  @property
  def pipeline_layers(self) -> list[keras.layers.Layer]:
    """The Keras layers as the pipeline runs them, in order; their weights are the model's."""
    return list(self._pipeline_layers) if self._pipeline is not None else []

  def build(self, input_shape) -> None:
    if self._pipeline is not None:
      return
    shape = tuple(tf.TensorShape(input_shape).as_list()[1:])
    if self._input_shape is not None and shape != self._input_shape:
      raise ValueError(f'{self.name}: built for examples of shape {self._input_shape}, '
                       f'called on shape {shape}.')
    opts = self._options
    with tf.init_scope():
      params_list, self._output_shape = keras_layer.ParamsFromKerasLayers(
          self._layer_configs, shape)
      for layer_params in params_list:  # Each layer computes in its own policy, as in Keras.
        layer_params.fprop_dtype = _ComputeDType(layer_params.layer)
      chunks = opts['num_stages'] * opts['virtual_stages']
      if len(params_list) < chunks:
        raise ValueError(f"{self.name}: {len(params_list)} layers cannot be cut into "
                         f"num_stages * virtual_stages = {opts['num_stages']} * "
                         f"{opts['virtual_stages']} = {chunks} chunks of one layer or more.")
      if opts['balance'] is not None:
        cells = gpipe.CellsFromEnds(params_list, list(np.cumsum(opts['balance']).tolist()))
      else:
        cells = gpipe.PartitionSequentialLayers(params_list, chunks,
                                                tf.TensorShape((1,) + shape), cost=opts['cost'])
      p = gpipe.PipeliningLayer.Params().Set(
          name='pipeline', cell_tpl=cells, num_micro_batches=opts['num_micro_batches'],
          schedule=opts['schedule'], virtual_stages=opts['virtual_stages'],
          remat=opts['remat'], devices=opts['devices'],
          allow_device_reuse=opts['allow_device_reuse'], jit_compile=opts['jit_compile'],
          inline_cell_functions=opts['inline_cell_functions'],
          loop_steady_state=opts['loop_steady_state'], dtype=tf.as_dtype(self.variable_dtype),
          fprop_dtype=tf.as_dtype(self.compute_dtype))
      self._pipeline = p.Instantiate()
    self._input_shape = shape
    # Tracked by Keras as this model's layers: their variables are the pipeline's.
    self._pipeline_layers = [layer.keras_layer for cell in self._pipeline.cell
                             for layer in cell.sub]
    for layer, weights in zip(self._pipeline_layers, self._given_weights):
      if weights:
        layer.set_weights(weights)
        if hasattr(layer, 'finalize_state'):  # Statistics adapt() left in weights (Normalization).
          layer.finalize_state()
    self.built = True

  def call(self, inputs, training=False):
    """The pipelined forward; with training=True differentiable, by fill-drain ('gpipe'
    only: fit() trains any schedule through train_step)."""
    training = bool(training)
    if training and not self._whole_batch_loss:
      raise ValueError(f"{self.name}: a call with training=True is differentiated as a whole, "
                       f"which only schedule='gpipe' runs; fit() trains with "
                       f"schedule={self._options['schedule']!r}.")
    # Before compile() there is no optimizer: random ops then count their own calls.
    optimizer = getattr(self, 'optimizer', None)
    step = optimizer.iterations if training and optimizer is not None else None
    # Under a mixed policy keras.Model.__call__ opens an autocast scope of the compute dtype;
    # within it a float32 layer's weights would reach the layer rounded to that dtype (a
    # float32 head would predict with bfloat16 weights, unlike Keras's). Cleared, each layer
    # opens its own scope, as in fit(), whose train_step runs outside __call__; where Keras
    # opened none (a policy that is not mixed), none is added.
    autocast = (keras_backend.AutocastScope(None)
                if keras_backend.get_autocast_scope() is not None
                else contextlib.nullcontext())
    with py_utils.Context(training=training, step=step), autocast:
      return self._pipeline.FProp(self._pipeline.theta, inputs)

  # An op failing in a chunk may surface as the other devices' CancelledError: each step
  # function below runs such a step again eagerly on its batch, which raises the op's own
  # error (errors.ExplainingCancelledSteps). Keras's train and test functions take the
  # iterator; with steps_per_execution=1 they are given the batch taken out of it first.
  # With more steps per call the batch stays inside Keras's loop: fit and evaluate then
  # only say how to see the error.

  def make_train_function(self, force=False):
    super().make_train_function(force)
    self.train_function = self._ByBatch(self.train_function, self._ForwardBackward)
    return self.train_function

  def make_test_function(self, force=False):
    super().make_test_function(force)
    self.test_function = self._ByBatch(self.test_function, self.test_step)
    return self.test_function

  def make_predict_function(self, force=False):
    super().make_predict_function(force)
    function = self.predict_function
    if not getattr(function, _RERUNS, False):
      def Predict(data):  # Keras hands its predict function the batches themselves.
        with errors.ExplainingCancelledSteps(functools.partial(function, data)):
          return function(data)

      setattr(Predict, _RERUNS, True)
      self.predict_function = Predict
    return self.predict_function

  def _ByBatch(self, function: Callable, rerun_fn: Callable) -> Callable:
    """Keras's step `function` (iterator -> logs), called on the iterator's next batch
    alone, whose cancelled step rerun_fn(batch) runs again eagerly."""
    if self.steps_per_execution != 1 or getattr(function, _RERUNS, False):
      return function

    def Step(iterator):
      batch = next(iterator)  # Its StopIteration ends the epoch, as Keras's own function's.
      with errors.ExplainingCancelledSteps(functools.partial(rerun_fn, batch)):
        return function([batch])  # Keras's function steps through any iterable of batches.

    setattr(Step, _RERUNS, True)
    return Step

  def fit(self, *args, **kwargs):
    """keras.Model.fit; a cancelled step says how to see the error of an op that failed
    in a chunk (errors.ExplainingCancelledSteps)."""
    with errors.ExplainingCancelledSteps():
      return super().fit(*args, **kwargs)

  def evaluate(self, *args, **kwargs):
    """keras.Model.evaluate; a cancelled step says how to see the error of an op that failed
    in a chunk (errors.ExplainingCancelledSteps)."""
    with errors.ExplainingCancelledSteps():
      return super().evaluate(*args, **kwargs)

  def train_step(self, data) -> dict[str, Any]:
    """One step of the schedule (module doc): ForwardBackward with compile()'s loss,
    the regularizers' gradients added, applied by the optimizer; the logs of
    Keras's own train_step (loss and compiled metrics)."""
    try:
      return self._TrainStep(data)
    except Exception:
      # Keras keeps the step function whose trace failed, and it then returns nothing: the
      # next fit() makes a new one.
      self.train_function = None
      raise

  def _TrainStep(self, data) -> dict[str, Any]:
    x, y, sample_weight, loss, grads, y_pred = self._ForwardBackward(data)
    variables = self.trainable_variables
    tf_variables = [v.value for v in variables]  # What theta holds (KerasLayer).
    pipe = self._pipeline
    by_ref = {v.ref(): g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
    grads = [by_ref[v.ref()] for v in tf_variables]
    loss = loss / self.optimizer.scale_loss(tf.ones([], loss.dtype))
    loss, grads = self._WithRegularization(loss, grads, tf_variables)
    if variables:
      self.optimizer.apply_gradients(zip(grads, variables))
    else:  # As Keras's own train_step: the loss is still computed and logged.
      warnings.warn('The model does not have any trainable weights.', stacklevel=2)
    self._loss_tracker.update_state(loss, sample_weight=tf.shape(x)[0])
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

  def _ForwardBackward(self, data) -> tuple:
    """(x, y, sample_weight, scaled loss, gradients of theta, outputs) of a batch: a
    training step without its update."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if self._compile_loss is None:
      raise ValueError(f'{self.name}: fit() trains the loss of compile(loss=...); none given.')
    if y is None:
      raise ValueError(f"{self.name}: fit() got inputs but no targets (y), which compile()'s "
                       'loss compares the outputs with.')
    if type(self).compute_loss is not keras.Model.compute_loss:
      raise ValueError(f'{self.name}: fit() trains the loss of compile(loss=...) on each '
                       'micro-batch, so an overridden compute_loss would not run; put the loss '
                       'into compile(loss=...) instead.')
    loss_reduction = self._LossReduction()
    x = self._CastInput(x)
    if not self.built:  # Not built by its first call (call() does not run in training).
      self.build(tuple(x.shape.as_list()))
    pipe = self._pipeline
    with py_utils.Context(training=True, step=self.optimizer.iterations):
      loss, grads, y_pred = pipe.ForwardBackward(pipe.theta, x, self._ScaledLoss,
                                                 labels=(y, sample_weight), with_outputs=True,
                                                 loss_reduction=loss_reduction)
    return x, y, sample_weight, loss, grads, y_pred

  def _LossReduction(self) -> str | None:
    """How compile()'s loss merges over micro-batches (loss_contract.py): 'mean' for Keras's
    reduction='sum_over_batch_size' (a function of your own is wrapped with it), 'sum' for
    reduction='sum'. A loss of per-example values (reduction=None) is refused: fit() trains
    a scalar. A mean over some labels (ignore_class), one weighted by the batch's sum of
    sample weights (reduction='mean_with_sample_weight') or a mix of means and sums cannot
    be merged from micro-batches: refused unless the schedule takes the whole batch's loss
    ('gpipe'). Seen on loss objects and functools.partial."""
    schedule = self._options['schedule']
    reductions = set()
    for item in tf.nest.flatten(self.loss):
      reduction = _LossOption(item, 'reduction', 'sum_over_batch_size')
      if reduction in (None, 'none'):
        raise ValueError(
            f"{self.name}: the loss's reduction={reduction!r} returns a value per example, "
            "and fit() trains one scalar per batch: use reduction='sum_over_batch_size' (the "
            "mean) or 'sum'.")
      reductions.add('sum' if reduction == 'sum' else 'mean')
      if self._whole_batch_loss:
        continue
      ignored = _LossOption(item, 'ignore_class')
      if ignored is not None:
        raise ValueError(
            f"{self.name}: the loss's ignore_class={ignored} makes it a mean over the labels "
            f"that are not {ignored}, which schedule={schedule!r} cannot merge from its "
            "micro-batches' losses; use schedule='gpipe', or a loss that returns per-example "
            'values with sample weights that are 0 for those labels.')
      if reduction == 'mean_with_sample_weight':
        raise ValueError(
            f"{self.name}: the loss's reduction='mean_with_sample_weight' divides by the "
            f"batch's sum of sample weights, which schedule={schedule!r} cannot merge from "
            "its micro-batches' losses; use schedule='gpipe', or "
            "reduction='sum_over_batch_size'.")
    if self._whole_batch_loss:
      return None
    if len(reductions) > 1:
      raise ValueError(
          f"{self.name}: compile()'s losses mix reduction='sum' with means, whose total "
          f"schedule={schedule!r} cannot merge from its micro-batches' losses; give them "
          "one reduction, or use schedule='gpipe'.")
    return reductions.pop() if reductions else 'mean'

  def _CastInput(self, x) -> tf.Tensor:
    """A floating input in the compute dtype, as keras.Model.__call__ hands it to call()."""
    x = tf.convert_to_tensor(x)
    return tf.cast(x, self.compute_dtype) if x.dtype.is_floating else x

  def _ScaledLoss(self, y_pred: tf.Tensor, labels: tuple) -> tf.Tensor:
    """compile()'s loss of (a micro-batch's) outputs, scaled as the optimizer asks (a
    LossScaleOptimizer's scale keeps float16 gradients from underflowing)."""
    y, sample_weight = labels
    return self.optimizer.scale_loss(self._compile_loss(y, y_pred, sample_weight))

  def _WithRegularization(self, loss: tf.Tensor, grads: list[tf.Tensor],
                          variables: list[tf.Variable]) -> tuple[tf.Tensor, list[tf.Tensor]]:
    """loss and grads plus those of self.losses (the layers' weight regularizers, which
    Keras's compute_loss adds): they read only the weights, so a tape outside the
    pipeline gives their gradients exactly."""
    if not self.losses:
      return loss, grads
    with tf.GradientTape() as tape:
      extra = tf.add_n([tf.reduce_sum(tf.cast(x, loss.dtype)) for x in self.losses])
      scaled = self.optimizer.scale_loss(extra)
    extra_grads = tape.gradient(scaled, variables,
                                unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return loss + extra, [g + e for g, e in zip(grads, extra_grads)]

  def compute_output_spec(self, inputs, training=False) -> keras.KerasTensor:
    del training  # The shapes do not depend on it.
    return keras.KerasTensor((inputs.shape[0],) + self._output_shape,
                             dtype=_ComputeDType(self._layer_configs[-1]).name)

  def summary(self, *args, print_fn: Callable[[str], Any] | None = None, **kwargs) -> None:
    """Keras's summary, then which layers each stage (chunk) runs on which device."""
    super().summary(*args, print_fn=print_fn, **kwargs)
    if self._pipeline is None:
      return
    pipe = self._pipeline
    lines = ['Pipeline chunks (chunk: stage on its device: layers):']
    for c, (cell, stage) in enumerate(zip(pipe.cell, pipe.placement)):
      names = ', '.join(layer.keras_layer.name for layer in cell.sub)
      lines.append(f'  {c}: stage {stage} on {pipe.devices[stage]}: {names}')
    for line in lines:
      (print_fn or print)(line)

  def get_config(self) -> dict[str, Any]:
    config = super().get_config()
    config.update(self._options, layers=list(self._layer_configs),
                  input_shape=None if self._input_shape is None else list(self._input_shape))
    return config
