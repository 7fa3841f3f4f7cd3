"""Balancing a sequence of layer costs into K contiguous, non-empty stages.

The pipeline runs at the pace of its slowest stage, so the split minimises the
most expensive stage exactly; among the splits that reach that minimum it takes
the most even one (least sum of squared stage costs), so that 16 equal layers
over 4 stages give 4,4,4,4 and a heavy layer gets a stage to itself.

No TensorFlow here: costs come from the caller (FLOPs, parameters or measured
time; see gpipe.PartitionSequentialLayers).
"""

from typing import Sequence

import numpy as np


def _CheckArgs(costs, num_stages):
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f'num_stages must be a positive int, got {num_stages!r}.')
  if len(costs) < num_stages:
    raise ValueError(f'Cannot split {len(costs)} layers into {num_stages} non-empty stages: '
                     'need at least as many layers as stages.')
  costs = np.asarray(costs, dtype=np.float64)
  if costs.ndim != 1 or not np.all(np.isfinite(costs)) or np.any(costs < 0):
    raise ValueError(f'Layer costs must be finite and non-negative, got {costs.tolist()}.')
  return costs


def _SplitDP(prefix, num_stages, stage_value, combine):
  """Dynamic programme over split points.

  best[k][i] is the best value of splitting the first i layers into k stages;
  stage_value(j, i) values the stage holding layers j..i-1 and combine merges a
  prefix's value with it. Returns the list of stage end indices.
  """
  n = len(prefix) - 1
  best = np.full((num_stages + 1, n + 1), np.inf)
  arg = np.zeros((num_stages + 1, n + 1), dtype=np.int64)
  best[0][0] = 0.0
  for k in range(1, num_stages + 1):
    for i in range(k, n - (num_stages - k) + 1):
      j = np.arange(k - 1, i)  # The last stage holds layers j..i-1, never empty.
      values = combine(best[k - 1][j], stage_value(j, i))
      pick = int(np.argmin(values))
      best[k][i], arg[k][i] = values[pick], j[pick]
  ends, i = [], n
  for k in range(num_stages, 0, -1):
    ends.append(int(i))
    i = arg[k][i]
  return ends[::-1]


def Balance(costs: Sequence[float], num_stages: int) -> list[int]:
  """Stage end indices (exclusive, ascending) of the best contiguous split.

  Args:
    costs: per-layer costs (non-negative).
    num_stages: K, at most len(costs).

  Returns:
    K ascending end indices; stage k holds layers ends[k-1]..ends[k]-1.
  """
  costs = _CheckArgs(costs, num_stages)
  prefix = np.concatenate([[0.0], np.cumsum(costs)])

  def StageCost(j, i):
    return prefix[i] - prefix[j]

  ends = _SplitDP(prefix, num_stages, StageCost, np.maximum)
  bottleneck = max(StageCost(j, i) for j, i in zip([0] + ends[:-1], ends))
  # Among splits whose slowest stage costs no more than the optimum, the most even.
  tolerance = 1e-9 * max(1.0, bottleneck)

  def Square(j, i):
    stage = StageCost(j, i)
    return np.where(stage <= bottleneck + tolerance, stage * stage, np.inf)

  return _SplitDP(prefix, num_stages, Square, np.add)


def CheckEnds(ends: Sequence[int], num_layers: int, where: str) -> None:
  """Raises a ValueError unless `ends` are ascending stage ends of num_layers layers."""
  ends = list(ends) if isinstance(ends, (list, tuple)) else None
  if (not ends or any(not isinstance(e, int) or isinstance(e, bool) for e in ends) or
      any(b <= a for a, b in zip([0] + ends, ends))):
    raise ValueError(f'{where}: stage ends {ends!r} must be ascending positive ints.')
  if ends[-1] != num_layers:
    raise ValueError(f'{where}: stage ends {ends} must end at the layer count {num_layers}.')


def StageSizes(ends: Sequence[int]) -> list[int]:
  """[3, 7, 10] -> [3, 4, 3]."""
  return [b - a for a, b in zip([0] + list(ends[:-1]), ends)]


def StageCosts(costs: Sequence[float], ends: Sequence[int]) -> list[float]:
  """Total cost of every stage of a split."""
  return [float(sum(costs[a:b])) for a, b in zip([0] + list(ends[:-1]), ends)]
