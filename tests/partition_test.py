"""Tests of lingvo_gpipe.pipeline.partition against brute force."""

import itertools
import random

import pytest

from lingvo_gpipe.pipeline import partition


def _AllSplits(n, k):
  for cuts in itertools.combinations(range(1, n), k - 1):
    yield list(cuts) + [n]


def _Bottleneck(costs, ends):
  return max(partition.StageCosts(costs, ends))


def testEqualLayersSplitEvenly():
  assert partition.StageSizes(partition.Balance([1.0] * 16, 4)) == [4, 4, 4, 4]
  assert partition.StageSizes(partition.Balance([1.0] * 10, 4)) in (
      [3, 3, 2, 2], [3, 2, 3, 2], [2, 3, 2, 3], [2, 2, 3, 3], [3, 2, 2, 3], [2, 3, 3, 2])


@pytest.mark.parametrize('heavy_at', [0, 7, 15])
def testHeavyLayerGetsItsOwnStage(heavy_at):
  costs = [1.0] * 16
  costs[heavy_at] = 16.0
  ends = partition.Balance(costs, 4)
  stage_of_heavy = next(k for k, e in enumerate(ends) if heavy_at < e)
  assert partition.StageSizes(ends)[stage_of_heavy] == 1
  assert max(partition.StageCosts(costs, ends)) == 16.0


def testNeverEmptyEvenWithZeroCosts():
  assert partition.StageSizes(partition.Balance([0.0] * 5, 5)) == [1] * 5
  assert min(partition.StageSizes(partition.Balance([9.0, 0, 0, 0, 0], 3))) >= 1


def testMatchesBruteForceOptimum():
  rng = random.Random(0)
  for _ in range(200):
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    costs = [float(rng.randint(0, 20)) for _ in range(n)]
    ends = partition.Balance(costs, k)
    assert len(ends) == k and ends[-1] == n and min(partition.StageSizes(ends)) >= 1
    best = min(_Bottleneck(costs, e) for e in _AllSplits(n, k))
    assert _Bottleneck(costs, ends) == best
    # Among optimal splits, the most even (least sum of squares).
    best_sq = min(sum(c * c for c in partition.StageCosts(costs, e))
                  for e in _AllSplits(n, k) if _Bottleneck(costs, e) == best)
    assert sum(c * c for c in partition.StageCosts(costs, ends)) == best_sq


@pytest.mark.parametrize('costs,k,match', [
    ([1.0, 2.0], 3, 'Cannot split 2 layers into 3'),
    ([1.0], 0, 'positive int'),
    ([1.0, -1.0], 1, 'non-negative'),
    ([1.0, float('nan')], 1, 'finite'),
])
def testBadArguments(costs, k, match):
  with pytest.raises(ValueError, match=match):
    partition.Balance(costs, k)
