"""Params, NestedMap, the base layer and what every other package may use: errors, devices,
memory statistics, log filtering."""
