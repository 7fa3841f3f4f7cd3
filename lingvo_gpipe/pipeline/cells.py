"""Pipeline cells: the layers of one stage, and cutting a layer list into them.

A cell (FeatureExtractionLayer) is a SequentialLayer that only says where a cut falls:
its layers keep the pipeline's names, so a model cut otherwise has the same variables.
PartitionSequentialLayers balances a cut by cost; CellsFromEnds makes the cells of a
given one. The PipeliningLayer (gpipe.py) runs the cells; gpipe exports these names too.
"""

from typing import Any, Sequence

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import profiler
from lingvo_gpipe.pipeline import partition


class FeatureExtractionLayer(layers.SequentialLayer):
  """A pipeline cell: layers run in order, some of whose outputs are exported.

  Transparent (base_layer): a cell only says where the cut falls, so its layers
  are named as the pipeline's ('pipe/layer3/w' in any cell), and a model cut
  otherwise has the same variables, initial values, dropout masks and checkpoint.
  """

  TRANSPARENT = True

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('act_fetch_layers', [],
             'Names of sub-layers whose outputs the pipeline also returns.')
    return p

  def __init__(self, params):
    super().__init__(params)
    names = [layer.params.name for layer in self.sub]
    unknown = [n for n in self.params.act_fetch_layers if n not in names]
    if unknown:
      raise ValueError(f'{self.path}: act_fetch_layers {unknown} are not sub-layers {names}.')

  def FPropWithActivations(self, theta: py_utils.NestedMap,
                           *args) -> tuple[Any, py_utils.NestedMap]:
    """(outputs, NestedMap of the act_fetch_layers' outputs)."""
    return self.FPropAndOutputs(theta, args, self.params.act_fetch_layers)


def PartitionSequentialLayers(layer_params_list: Sequence[hyperparams.Params], num_partitions: int,
                              input_shape, cost: Any = 'auto') -> list[hyperparams.Params]:
  """Cuts a layer list into `num_partitions` balanced FeatureExtractionLayer params.

  Args:
    layer_params_list: layer params, run in order.
    num_partitions: K, the number of stages.
    input_shape: the first layer's input tf.TensorShape (or TensorSpec), or a
      list of them for several inputs, or a NestedMap of them for one NestedMap.
    cost: 'auto' (FLOPs if every layer has FPropMeta, else parameter count),
      'flops', 'params', 'time' (profile each layer forward+backward once), or a
      list of per-layer numbers.

  Returns:
    K FeatureExtractionLayer params named cell0..cell{K-1}.
  """
  named = profiler.Named(layer_params_list)
  costs = list(cost) if isinstance(cost, (list, tuple)) else profiler.LayerCosts(
      named, input_shape, cost)
  if len(costs) != len(named):
    raise ValueError(f'Got {len(costs)} costs for {len(named)} layers.')
  return CellsFromEnds(named, partition.Balance(costs, num_partitions))


def CellsFromEnds(layer_params_list: Sequence[hyperparams.Params], ends: Sequence[int],
                  act_fetch_layers: Sequence[str] = ()) -> list[hyperparams.Params]:
  """FeatureExtractionLayer params cell0.. holding layers [ends[k-1], ends[k]).

  act_fetch_layers: names of layers whose outputs are fetched, in whichever cell.
  """
  cells = []
  for k, (a, b) in enumerate(zip([0] + list(ends[:-1]), ends)):
    sub = layer_params_list[a:b]
    cells.append(FeatureExtractionLayer.Params().Set(
        name=f'cell{k}', sub=sub,
        act_fetch_layers=[q.name for q in sub if q.name in act_fetch_layers]))
  return cells
