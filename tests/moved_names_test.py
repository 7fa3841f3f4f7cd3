"""A params text of the layout before the sub-packages (a logdir's params.txt from then)
loads into the params of today, and the mapping leaves today's names alone."""

import pytest

from lingvo_gpipe.foundation import moved_names
from lingvo_gpipe.models import model_registry

# Today's class paths in the texts of the registered models, and where they were before the
# move (commit b09b147: lingvo_gpipe/tasks.py, lingvo_gpipe/core/layers_with_gpipe.py, ...).
_OLD = {
    'lingvo_gpipe.inputs.input_generators.': 'lingvo_gpipe.input_generators.',
    'lingvo_gpipe.models.base_model.': 'lingvo_gpipe.base_model.',
    'lingvo_gpipe.models.tasks.': 'lingvo_gpipe.tasks.',
    'lingvo_gpipe.models.layers_with_gpipe.': 'lingvo_gpipe.core.layers_with_gpipe.',
    'lingvo_gpipe.models.state_layers.': 'lingvo_gpipe.core.layers_with_gpipe.',
    'lingvo_gpipe.training.loss_scale.': 'lingvo_gpipe.loss_scale.',
    'lingvo_gpipe.training.lr_schedule.': 'lingvo_gpipe.lr_schedule.',
    'lingvo_gpipe.training.optimizer.': 'lingvo_gpipe.optimizer.',
    'lingvo_gpipe.layers.basic.': 'lingvo_gpipe.core.layers.',
    'lingvo_gpipe.pipeline.gpipe.': 'lingvo_gpipe.core.gpipe.',
}


@pytest.mark.parametrize('key', ['lm.synthetic.GPipeTransformerLmTiny',
                                 'mt.synthetic.GPipeTransformerReverse',
                                 'image.synthetic.GPipeConvNet'])
def testAnOldLayoutsParamsTextLoadsIntoTodaysParams(key):
  params = model_registry.GetParams(key, 'Train')
  text = params.ToText()
  old = text
  for new_prefix, old_prefix in _OLD.items():
    old = old.replace(new_prefix, old_prefix)
  assert old != text and 'lingvo_gpipe.tasks.' in old
  fresh = model_registry.GetParams(key, 'Train')
  fresh.FromText(old)
  assert fresh.ToText() == text


def testTodaysNamesAndUnknownNamesStayAsTheyAre():
  for dotted in ('lingvo_gpipe.models.tasks.LanguageModelTask', 'tf.float32',
                 'lingvo_gpipe.core.layers.ProjectionLayer', 'my_pkg.tasks.Mine'):
    assert moved_names.Current(dotted) == dotted
  assert (moved_names.Current('lingvo_gpipe.core.layers_with_gpipe.GPipeTransformerStack.Params')
          == 'lingvo_gpipe.models.layers_with_gpipe.GPipeTransformerStack.Params')
