"""Tests of (value, weight) metrics and their merging (lingvo_gpipe/pipeline/metrics.py)."""

import pytest

from lingvo_gpipe.pipeline import metrics


def testMergeMetricsWeighsEachValueByItsWeight():
  merged = metrics.MergeMetrics([metrics.AsMetrics((2.0, 1.0)), metrics.AsMetrics((5.0, 2.0))])
  assert float(merged.loss[0]) == pytest.approx(4.0) and float(merged.loss[1]) == 3.0
