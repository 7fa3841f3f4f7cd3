"""Byte-level Transformer language model of a text file (input_generators.TextLmInput)."""

from lingvo_gpipe.inputs import input_generators
from lingvo_gpipe.models import base_model_params
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.models import tasks
from lingvo_gpipe.params.lm import synthetic


@model_registry.RegisterSingleTaskModel
class GPipeByteLm(base_model_params.SingleTaskModelParams):
  """A 4-layer, 2-stage byte LM of any UTF-8 file; no tokenizer, nothing downloaded.

  By default it reads the short English text shipped in lingvo_gpipe/data; name
  your own with the override `input.input_file : /path/to/file.txt` (Dev and
  Test are the file's held-out end, so set the same file for every dataset).
  """

  def _Input(self, split, seed, num_batches):
    return input_generators.TextLmInput.Params().Set(
        name=f'text_{split}', split=split, heldout_fraction=0.2, seq_len=64,
        batch_size=16 if split == 'train' else 8, seed=seed, num_batches=num_batches)

  def Train(self):
    return self._Input('train', seed=1, num_batches=None)

  def Dev(self):
    return self._Input('dev', seed=2, num_batches=4)

  def Test(self):
    return self._Input('test', seed=3, num_batches=4)

  def Task(self):
    data = self.Train()
    p = tasks.LanguageModelTask.Params().Set(name='byte_lm', input=data)
    p.stack = synthetic.TransformerStackParams(
        data.vocab_size, data.seq_len, model_dim=64, num_heads=4, hidden_dim=256,
        num_encoder_layers=0, num_decoder_layers=4, splits=2, num_micro_batches=4)
    p.stack.dropout_prob = 0.1
    p.train.learning_rate = 2e-3
    # Decoders continue each window's first half; text has no eos.
    p.decoder.Set(prompt_len=data.seq_len // 2, eos_id=None, detokenize='bytes')
    return p
