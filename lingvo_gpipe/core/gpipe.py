"""Lingvo's import path of lingvo_gpipe.pipeline.gpipe, which holds the code."""

from lingvo_gpipe.pipeline.gpipe import *  # noqa: F401,F403
