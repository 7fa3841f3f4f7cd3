"""Tests of lingvo_gpipe.pipeline.pipeline_params: one API over every pipeline's params."""

import pytest

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.models import layers_with_gpipe
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import pipeline_params


def _Projections(n):
  return [layers.ProjectionLayer.Params().Set(name=f'p{i}', input_dim=4, output_dim=4)
          for i in range(n)]


def _Pipe(ends, **kwargs):
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=gpipe.CellsFromEnds(_Projections(ends[-1]), ends), **kwargs)


def _Stack(splits):
  p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
      name='stack', model_dim=8, num_heads=2, hidden_dim=16, num_decoder_layers=3,
      max_seq_len=4, splits=splits)
  p.emb_tpl.vocab_size = p.softmax_tpl.num_classes = 6
  return p


def testFindGivesDottedPathsOutermostFirst():
  outer = hyperparams.Params()
  outer.Define('pipes', [_Pipe([1, 3]), _Stack(2)], '')
  outer.Define('other', layers.ProjectionLayer.Params(), '')
  found = list(pipeline_params.Find(outer, 'task'))
  assert [path for path, _ in found] == ['task.pipes[0]', 'task.pipes[1]']
  assert pipeline_params.MaxStages(outer) == 2
  assert pipeline_params.MaxStages(layers.ProjectionLayer.Params()) == 0
  outer.pipes[0].num_replicas = 3  # 2 stages x 3 replicas.
  assert pipeline_params.MaxStages(outer) == 2 and pipeline_params.MaxDevices(outer) == 6
  # A pipeline inside a pipeline's cell runs within its stage: not one of the model's.
  nested = gpipe.PipeliningLayer.Params().Set(name='outer', cell_tpl=[_Pipe([1, 2])])
  assert [p.name for _, p in pipeline_params.Find(nested)] == ['outer']


def testLayersAndEndsOfCellsAndOfStacks():
  layer_params, ends = pipeline_params.LayersAndEnds(_Pipe([1, 3, 4]))
  assert [q.name for q in layer_params] == ['p0', 'p1', 'p2', 'p3'] and ends == [1, 3, 4]
  plain_cells = gpipe.PipeliningLayer.Params().Set(cell_tpl=_Projections(3))
  assert pipeline_params.LayersAndEnds(plain_cells)[1] == [1, 2, 3]
  layer_params, ends = pipeline_params.LayersAndEnds(_Stack([2, 5]))
  assert [q.name for q in layer_params] == ['tgt_emb', 'dec0', 'dec1', 'dec2', 'softmax']
  assert ends == [2, 5]
  assert pipeline_params.NumStages(_Stack(3)) == 3
  assert pipeline_params.NumStages(_Stack([2, 5])) == 2


def testRecutKeepsTheLayersAndRefusesBadEnds():
  p = _Pipe([2, 4])
  pipeline_params.Recut(p, [1, 2, 4])
  assert [[q.name for q in c.sub] for c in p.cell_tpl] == [['p0'], ['p1'], ['p2', 'p3']]
  with pytest.raises(ValueError, match=r'must end at the layer count 4'):
    pipeline_params.Recut(p, [1, 3])
  with pytest.raises(ValueError, match=r'ascending positive ints'):
    pipeline_params.Recut(p, [2, 2, 4])
  with pytest.raises(ValueError, match='not FeatureExtractionLayers'):
    pipeline_params.Recut(gpipe.PipeliningLayer.Params().Set(cell_tpl=_Projections(2)), [2])
  stack = _Stack(2)
  pipeline_params.Recut(stack, [1, 3, 5])
  assert stack.splits == [1, 3, 5]
  with pytest.raises(ValueError, match='leaves the softmax alone'):
    pipeline_params.Recut(stack, [2, 4, 5])


def testCheckBatchNamesBothParams():
  p = _Pipe([1, 2], num_micro_batches=3)
  pipeline_params.CheckBatch(p, 32, 'input.batch_size', 'task')  # Micro-batches 11, 11, 10.
  with pytest.raises(ValueError, match=r'input.batch_size=2 cannot be split by '
                     r'task.num_micro_batches=3: .*every micro-batch needs at least one'):
    pipeline_params.CheckBatch(p, 2, 'input.batch_size', 'task')
  replicated = _Pipe([1, 2], micro_batch_size=4, num_replicas=2)
  assert pipeline_params.NumMicroBatches(replicated, 32) == 4
  assert pipeline_params.NumMicroBatches(replicated, 36) == 5  # 18 rows a replica: 4,4,4,3,3.
  with pytest.raises(ValueError, match=r'micro_batch_size=4 x pipe.num_replicas=2: A batch '
                     r'of 1 examples is smaller than num_micro_batches=1 x num_replicas=2'):
    pipeline_params.CheckBatch(replicated, 1, 'batch', 'pipe')
