"""Experiment params of lingvo_gpipe, one folder per domain (see model_registry)."""
