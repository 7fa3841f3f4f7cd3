"""Test cases in which every two parameters meet in each pair of their values.

A grid of three parameters costs the product of their sizes; most failures need only two
of them to meet (a policy with a schedule, a cut with a micro-batch count). EveryPair
gives each value of the first with each of the second once, and the third cycled so that
it meets every value of the other two: len(first) * len(second) cases.
"""


def EveryPair(first, second, third):
  """[(a, b, c)]: third[(i + j) mod len(third)] for first[i] and second[j]."""
  if len(third) > min(len(first), len(second)):
    raise ValueError(f'{len(third)} values of the third parameter cannot meet every value of '
                     f'the first ({len(first)}) and second ({len(second)}) by cycling')
  return [(a, b, third[(i + j) % len(third)])
          for i, a in enumerate(first) for j, b in enumerate(second)]
