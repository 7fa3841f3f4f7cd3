"""Lingvo's import paths (core.gpipe, core.layers, core.base_layer, core.hyperparams,
core.py_utils, core.schedule), kept as thin re-exports of the sub-packages."""
