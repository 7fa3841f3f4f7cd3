"""Where the classes and functions that a params text names moved to, so that a text
written by an earlier layout (a logdir's params.txt before the sub-packages) still loads:
'lingvo_gpipe.tasks.LanguageModelTask' reads as 'lingvo_gpipe.models.tasks.LanguageModelTask'.
Only data: the longest moved prefix of a dotted name is replaced, nothing is imported. The
Lingvo paths that stay as facades (lingvo_gpipe.core.layers, .core.gpipe, lingvo_gpipe.trainer,
...) resolve as they are and are not listed.
"""

# Old dotted prefix -> where it lives now (a module, or a class for one that changed module).
MOVED = {
    'lingvo_gpipe.base_input_generator': 'lingvo_gpipe.inputs.base_input_generator',
    'lingvo_gpipe.base_model': 'lingvo_gpipe.models.base_model',
    'lingvo_gpipe.base_runner': 'lingvo_gpipe.runners.base_runner',
    'lingvo_gpipe.binaries': 'lingvo_gpipe.runners.binaries',
    'lingvo_gpipe.checkpoint_files': 'lingvo_gpipe.training.checkpoint_files',
    'lingvo_gpipe.checkpointer': 'lingvo_gpipe.training.checkpointer',
    'lingvo_gpipe.cluster': 'lingvo_gpipe.distribution.cluster',
    'lingvo_gpipe.core.cell_functions': 'lingvo_gpipe.pipeline.cell_functions',
    'lingvo_gpipe.core.devices': 'lingvo_gpipe.foundation.devices',
    'lingvo_gpipe.core.executor': 'lingvo_gpipe.pipeline.executor',
    'lingvo_gpipe.core.keras_layer': 'lingvo_gpipe.layers.keras_layer',
    'lingvo_gpipe.core.layers_with_gpipe': 'lingvo_gpipe.models.layers_with_gpipe',
    'lingvo_gpipe.core.log_filter': 'lingvo_gpipe.foundation.log_filter',
    'lingvo_gpipe.core.memory_stats': 'lingvo_gpipe.foundation.memory_stats',
    'lingvo_gpipe.core.metrics': 'lingvo_gpipe.pipeline.metrics',
    'lingvo_gpipe.core.microbatch': 'lingvo_gpipe.pipeline.microbatch',
    'lingvo_gpipe.core.partition': 'lingvo_gpipe.pipeline.partition',
    'lingvo_gpipe.core.pipeline_params': 'lingvo_gpipe.pipeline.pipeline_params',
    'lingvo_gpipe.core.pipeline_stats': 'lingvo_gpipe.insight.pipeline_stats',
    'lingvo_gpipe.core.planner': 'lingvo_gpipe.insight.planner',
    'lingvo_gpipe.core.profiler': 'lingvo_gpipe.layers.profiler',
    'lingvo_gpipe.core.remat': 'lingvo_gpipe.layers.remat',
    'lingvo_gpipe.core.simulator': 'lingvo_gpipe.insight.simulator',
    'lingvo_gpipe.core.steady_state': 'lingvo_gpipe.pipeline.steady_state',
    'lingvo_gpipe.core.step_timing': 'lingvo_gpipe.pipeline.step_timing',
    'lingvo_gpipe.core.weight_grads': 'lingvo_gpipe.pipeline.weight_grads',
    'lingvo_gpipe.decoder': 'lingvo_gpipe.models.decoder',
    'lingvo_gpipe.evaler': 'lingvo_gpipe.runners.evaler',
    'lingvo_gpipe.input_generators': 'lingvo_gpipe.inputs.input_generators',
    'lingvo_gpipe.jobs': 'lingvo_gpipe.runners.jobs',
    'lingvo_gpipe.learner': 'lingvo_gpipe.training.learner',
    'lingvo_gpipe.loss_scale': 'lingvo_gpipe.training.loss_scale',
    'lingvo_gpipe.lr_schedule': 'lingvo_gpipe.training.lr_schedule',
    'lingvo_gpipe.optimizer': 'lingvo_gpipe.training.optimizer',
    'lingvo_gpipe.pipeline_check': 'lingvo_gpipe.runners.pipeline_check',
    'lingvo_gpipe.preemption': 'lingvo_gpipe.training.preemption',
    'lingvo_gpipe.run_lock': 'lingvo_gpipe.training.run_lock',
    'lingvo_gpipe.tasks': 'lingvo_gpipe.models.tasks',
}
# The layers of the state left layers_with_gpipe for state_layers; the stacks stayed.
MOVED.update({f'lingvo_gpipe.core.layers_with_gpipe.{name}':
                  f'lingvo_gpipe.models.state_layers.{name}'
              for name in ('GPipeEmbeddingLayer', 'GPipeTransformerLayer',
                           'SharedEmbeddingProjection', 'TiedSoftmax', 'GPipeSoftmaxLayer',
                           'GPipeConvBlock')})


def Current(dotted: str) -> str:
  """`dotted` with its longest moved prefix (a module or class path) replaced."""
  parts = dotted.split('.')
  for end in range(len(parts), 1, -1):
    new = MOVED.get('.'.join(parts[:end]))
    if new is not None:
      return '.'.join([new] + parts[end:])
  return dotted
