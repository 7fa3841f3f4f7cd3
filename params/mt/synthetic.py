"""Transformer encoder-decoders on synthetic translation
(input_generators.SyntheticSeq2SeqInput)."""

from lingvo_gpipe.inputs import input_generators
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.models import tasks
from lingvo_gpipe.params.lm import synthetic


@model_registry.RegisterSingleTaskModel
class GPipeTransformerReverse(synthetic.SyntheticDataModelParams):
  """Translates a string of up to 8 symbols into its reverse; 2+2 layers on 2 stages.

  The encoder output crosses from stage 0 to the decoder layers of stage 1;
  teacher-forced token and sequence accuracy show the task being learned.
  """

  def Train(self):
    return input_generators.SyntheticSeq2SeqInput.Params().Set(
        name='reverse', task='reverse', vocab_size=14, min_len=2, max_len=8, seq_len=9,
        batch_size=32, seed=1)

  def Task(self):
    data = self.Train()
    p = tasks.EncoderDecoderTask.Params().Set(name='reverse', input=data)
    p.stack = synthetic.TransformerStackParams(
        data.vocab_size, data.seq_len, model_dim=32, num_heads=4, hidden_dim=64,
        num_encoder_layers=2, num_decoder_layers=2, splits=2, num_micro_batches=2)
    p.train.learning_rate = 3e-3
    return p

  def Model(self):
    p = super().Model()
    p.train.Set(max_steps=600, save_interval_steps=200, summary_interval_steps=20,
                log_interval_steps=20)
    return p
