"""Transparency: a pipelined model is one model whatever its pipeline.

Random configurations (cut, K, M, schedule, remat, replicas, the training loop)
of a small language model with dropout, batch norm, tied embeddings and a
fetched activation train 20 steps each; every one must equal the same layers
trained unpipelined on one device (loss, weights and moving statistics,
relative 1e-5), and every configuration's checkpoint must restore into every
other one. The reference is written here with plain TensorFlow: the layers in
order, one micro-batch after the other (batch norm normalizes per micro-batch,
as GPipe does, so the reference runs the same micro-batches), one tape, SGD.
"""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.models import layers_with_gpipe
from lingvo_gpipe.models import state_layers
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import microbatch
from lingvo_gpipe.pipeline import pipeline_params
from lingvo_gpipe.training import learner

VOCAB, DIM, SEQ, BATCH = 11, 8, 5, 16
STEPS, LR, DROP = 20, 0.05, 0.2
NUM_LAYERS = 5


class _StateBatchNorm(base_layer.BaseLayer):
  """Batch norm of the state's tgt.vecs."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', DIM, 'Depth.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('bn', layers.BatchNormLayer.Params().Set(dim=self.params.dim, decay=0.8))

  def FProp(self, theta, state):
    out = py_utils.NestedMap(state)
    out.tgt = py_utils.NestedMap(state.tgt, vecs=self.bn.FProp(theta.bn, state.tgt.vecs))
    return out


class _TiedPipe(gpipe.PipeliningLayer):
  """A pipeline whose softmax uses the embedding table (on another stage, mostly)."""

  @classmethod
  def TieLayers(cls, p, layer_list):
    layers_with_gpipe.TieSoftmaxToEmbedding(layer_list)

  def __init__(self, params):
    super().__init__(params)
    self.TieLayers(self.params, [layer for cell in self.cell for layer in cell.sub])


def _LayerParams():
  def Decoder(name, last):
    return state_layers.GPipeTransformerLayer.Params().Set(
        name=name, stream='tgt', input_dim=DIM, num_heads=2, hidden_dim=16,
        mask_self_atten=True, residual_dropout_prob=DROP, relu_dropout_prob=DROP,
        final_layer_norm=last)

  return [
      state_layers.GPipeEmbeddingLayer.Params().Set(
          name='tgt_emb', vocab_size=VOCAB, embedding_dim=DIM, max_len=SEQ,
          dropout_prob=DROP),
      _StateBatchNorm.Params().Set(name='bn0'),
      Decoder('dec0', False),
      Decoder('dec1', True),
      state_layers.GPipeSoftmaxLayer.Params().Set(
          name='softmax', input_dim=DIM, num_classes=VOCAB, tie_embedding=True),
  ]


def _Loss(out, acts):
  """A bare scalar (a mean: schedules that call it per micro-batch probe it) of the
  outputs and the fetched batch-norm output."""
  return tf.reduce_mean(out.xent) + 0.1 * tf.reduce_mean(tf.square(acts.bn0.tgt.vecs))


def _Batch(step):
  ids = tf.random.stateless_uniform([BATCH, SEQ], [step, 5], 0, VOCAB, tf.int32)
  return py_utils.NestedMap(tgt=py_utils.NestedMap(
      ids=ids, labels=tf.roll(ids, -1, axis=1), paddings=tf.zeros([BATCH, SEQ]),
      weights=tf.ones([BATCH, SEQ])))


def _States(module):
  return {v.name: v.numpy() for v in module.variables}


# -- the reference: plain TensorFlow over the same layers ---------------------------------


def _Reference(num_parts):
  """(losses, final variables by name) of the layers trained unpipelined on num_parts
  micro-batches per step; the plain model's paths equal the pipeline's ('pipe/dec0/...')."""
  plain = layers.SequentialLayer.Params().Set(name='pipe', sub=_LayerParams()).Instantiate()
  layers_with_gpipe.TieSoftmaxToEmbedding(plain.sub)
  rows = BATCH // num_parts

  @tf.function(autograph=False)
  def Step(batch, step):
    updates = []
    with tf.GradientTape() as tape:
      outs, fetched = [], []
      for j, piece in enumerate(microbatch.Split(batch, num_parts)):
        with py_utils.Context(step=step, batch_slice=py_utils.BatchSlice(j * rows, rows),
                              updates=updates):
          x = piece
          for layer, theta in zip(plain.sub, plain.theta.sub):
            x = layer.FProp(theta, x)
            if layer.params.name == 'bn0':
              fetched.append(x)
          outs.append(x)
      loss = _Loss(microbatch.Merge(outs), py_utils.NestedMap(bn0=microbatch.Merge(fetched)))
    variables = plain.trainable_variables  # Each once: the tied table too.
    grads = tape.gradient(loss, variables)
    base_layer.ApplyRecordedUpdates(updates)
    for grad, var in zip(grads, variables):
      var.assign_sub(LR * grad)
    return loss

  losses = [float(Step(_Batch(s), tf.constant(s, tf.int64))) for s in range(STEPS)]
  return losses, _States(plain)


# -- the pipelined runs -----------------------------------------------------------------


def _Configs():
  """Random configurations (fixed seed), covering every schedule and remat mode."""
  rng = np.random.default_rng(2026)
  configs = []
  for i in range(8):
    k = int(rng.integers(1, 5))
    ends = sorted(rng.choice(np.arange(1, NUM_LAYERS), k - 1, replace=False).tolist())
    configs.append(dict(
        ends=ends + [NUM_LAYERS], m=int(rng.choice([1, 2, 4])), r=int(rng.integers(1, 3)),
        schedule=['gpipe', '1f1b'][i % 2], remat=['always', 'except_last', 'never'][i % 3],
        loop=['trainer', 'own'][(i // 2) % 2]))
  return configs


def _Name(c):
  return (f"K{len(c['ends'])}{c['ends']}-M{c['m']}-R{c['r']}-{c['schedule']}-{c['remat']}-"
          f"{c['loop']}")


def _Pipe(c):
  p = _TiedPipe.Params().Set(
      name='pipe', cell_tpl=gpipe.CellsFromEnds(_LayerParams(), [NUM_LAYERS], ['bn0']),
      num_micro_batches=c['m'], num_replicas=c['r'], schedule=c['schedule'],
      remat=c['remat'], allow_device_reuse=True)
  pipeline_params.Recut(p, c['ends'])  # As a balance plan does.
  return p.Instantiate()


def _Train(c):
  """(losses, pipe) of 20 steps of configuration c, with an eval pass every 5 steps."""
  pipe = _Pipe(c)

  def Gradients(batch):
    """(loss, [(gradient, variable)])."""
    if c['schedule'] == 'gpipe' and c['loop'] == 'own':  # FProp under the user's tape.
      with tf.GradientTape() as tape:
        loss = _Loss(*pipe.FProp(pipe.theta, batch))
      variables = pipe.trainable_variables
      return loss, list(zip(tape.gradient(loss, variables), variables))
    loss, grads = pipe.ForwardBackward(pipe.theta, batch, _Loss, loss_reduction='mean')
    return loss, learner.GradientsAndVariables(pipe.theta, grads)

  @tf.function(autograph=False)
  def Step(batch, step):
    if c['loop'] == 'trainer':  # The trainer sets the step; a user's own loop does not.
      with py_utils.Context(step=step):
        loss, grads = Gradients(batch)
    else:
      loss, grads = Gradients(batch)
    for grad, var in grads:
      var.assign_sub(LR * grad)
    return loss

  @tf.function(autograph=False)
  def Eval(batch):
    with py_utils.EvalMode():
      return pipe.FProp(pipe.theta, batch)

  losses = []
  for s in range(STEPS):
    losses.append(float(Step(_Batch(s), tf.constant(s, tf.int64))))
    if s % 5 == 4:
      Eval(_Batch(100 + s))  # Eval traces other cell functions; training goes on unchanged.
  return losses, pipe


def _RelErr(got, want):
  """Largest difference over the reference's scale."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-12))


def _WeightErr(states, ref_states):
  """The worst relative error of the variables.

  The key projections' biases are left out: their gradients are exactly 0 but for
  rounding (a softmax ignores a shift), so they hold noise whose relative error
  means nothing; they must stay that noise (below 1e-7) in both runs.
  """
  noise = [n for n in states if 'key_proj/b' in n]
  assert noise and all(np.abs(states[n]).max() < 1e-7 and np.abs(ref_states[n]).max() < 1e-7
                       for n in noise)
  return max(_RelErr(states[n], ref_states[n]) for n in states if n not in noise)


@pytest.fixture(scope='module')
def trained():
  runs, references = {}, {}
  for c in _Configs():
    parts = c['m'] * c['r']
    if parts not in references:
      references[parts] = _Reference(parts)
    runs[_Name(c)] = (c, references[parts]) + _Train(c)
  return runs


def testEveryConfigurationTrainsLikeTheUnpipelinedModel(trained):
  worst = []
  for name, (c, (ref_losses, ref_states), losses, pipe) in trained.items():
    loss_err = _RelErr(losses, ref_losses)
    states = _States(pipe)
    assert sorted(states) == sorted(ref_states), name
    weight_err = _WeightErr(states, ref_states)
    worst.append((name, loss_err, weight_err))
    assert loss_err <= 1e-5 and weight_err <= 1e-5, (name, loss_err, weight_err)
  # Each configuration and its worst relative errors (pytest -s shows them).
  for name, loss_err, weight_err in worst:
    print(f'{name}: loss {loss_err:.2e}, weights {weight_err:.2e}')
  assert any(c['m'] < len(c['ends']) for c, *_ in trained.values())  # M < K is covered.
  assert {(c['schedule'], c['remat']) for c, *_ in trained.values()} >= {
      ('gpipe', 'always'), ('1f1b', 'except_last'), ('gpipe', 'never'), ('1f1b', 'always')}


def testEveryCheckpointRestoresIntoEveryOtherConfiguration(trained, tmp_path):
  paths = {name: tf.train.Checkpoint(model=run[3]).save(str(tmp_path / f'c{i}'))
           for i, (name, run) in enumerate(trained.items())}
  saved = {name: _States(run[3]) for name, run in trained.items()}
  for target_name, (_, _, _, target) in trained.items():
    for source_name, path in paths.items():
      tf.train.Checkpoint(model=target).restore(path).assert_consumed()
      restored = _States(target)
      for var_name, value in saved[source_name].items():
        np.testing.assert_array_equal(restored[var_name], value,
                                      err_msg=f'{source_name} -> {target_name}')
