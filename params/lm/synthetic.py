"""Transformer language models on synthetic sequence tasks (input_generators.SyntheticLmInput).

Each example is `bos source sep target eos`, the target a fixed function of a
random source, so the loss on the target falls as the model learns the task.
"""

from lingvo_gpipe.inputs import input_generators
from lingvo_gpipe.models import base_model_params
from lingvo_gpipe.models import layers_with_gpipe
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.models import tasks


def TransformerStackParams(vocab_size, max_seq_len, model_dim, num_heads, hidden_dim,
                           num_encoder_layers, num_decoder_layers, splits, num_micro_batches):
  """GPipeTransformerStack params whose vocabulary and position table fit the input."""
  p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
      name='stack', model_dim=model_dim, num_heads=num_heads, hidden_dim=hidden_dim,
      num_encoder_layers=num_encoder_layers, num_decoder_layers=num_decoder_layers,
      max_seq_len=max_seq_len, splits=splits, num_micro_batches=num_micro_batches)
  p.emb_tpl.vocab_size = vocab_size
  p.softmax_tpl.num_classes = vocab_size
  return p


class SyntheticDataModelParams(base_model_params.SingleTaskModelParams):
  """Base of experiments on seeded synthetic data: Dev and Test are finite
  passes over the training distribution with other seeds."""

  def Dev(self):
    return self.Train().Set(seed=2, num_batches=4)

  def Test(self):
    return self.Train().Set(seed=3, num_batches=4)


@model_registry.RegisterSingleTaskModel
class GPipeTransformerLmTiny(SyntheticDataModelParams):
  """A 2-layer, 2-stage LM learning to reverse digit strings: the quick CPU demo.

  Trains in a couple of CPU minutes: token accuracy on the reversed half rises
  well above chance and the loss falls from about log(14) = 2.6.
  """

  def Train(self):
    return input_generators.SyntheticLmInput.Params().Set(
        name='reverse_lm', task='reverse', vocab_size=14, min_len=2, max_len=6, seq_len=14,
        batch_size=32, seed=1)

  def Task(self):
    data = self.Train()
    p = tasks.LanguageModelTask.Params().Set(name='lm', input=data)
    p.stack = TransformerStackParams(
        data.vocab_size, data.seq_len, model_dim=32, num_heads=4, hidden_dim=64,
        num_encoder_layers=0, num_decoder_layers=2, splits=2, num_micro_batches=2)
    p.train.learning_rate = 3e-3
    return p

  def Model(self):
    p = super().Model()
    p.train.Set(max_steps=600, save_interval_steps=200, summary_interval_steps=20,
                log_interval_steps=20)
    return p


@model_registry.RegisterSingleTaskModel
class GPipeTransformerLmBig(SyntheticDataModelParams):
  """An 8-layer LM sorting symbol strings on 4 stages with M=16: for pipeline benchmarks.

  Sized so each of 4 stages has real work on CPU (d=256, 64 tokens, batch 64)
  and the bubble is small (M = 4K); it trains too, slowly on CPU.
  """

  def Train(self):
    return input_generators.SyntheticLmInput.Params().Set(
        name='sort_lm', task='sort', vocab_size=68, min_len=16, max_len=31, seq_len=64,
        batch_size=64, seed=1)

  def Task(self):
    data = self.Train()
    p = tasks.LanguageModelTask.Params().Set(name='lm', input=data)
    p.stack = TransformerStackParams(
        data.vocab_size, data.seq_len, model_dim=256, num_heads=4, hidden_dim=1024,
        num_encoder_layers=0, num_decoder_layers=8, splits=4, num_micro_batches=16)
    p.train.learning_rate = 1e-3
    return p
