"""Tests of pairwise: every two parameters meet in every pair of their values."""

import itertools

import pytest

import pairwise


@pytest.mark.parametrize('sizes', [(4, 6, 3), (5, 3, 3), (2, 2, 2), (3, 7, 1)])
def testEveryTwoParametersMeetInEveryPairOfValues(sizes):
  values = [[f'{name}{i}' for i in range(n)] for name, n in zip('abc', sizes)]
  cases = pairwise.EveryPair(*values)
  assert len(cases) == sizes[0] * sizes[1]
  for x, y in itertools.combinations(range(3), 2):
    assert {(c[x], c[y]) for c in cases} == set(itertools.product(values[x], values[y]))


def testAThirdParameterWithMoreValuesIsRefused():
  with pytest.raises(ValueError, match='4 values of the third parameter'):
    pairwise.EveryPair([1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4])
