"""Lingvo's import path of lingvo_gpipe.pipeline.schedule, which holds the code."""

from lingvo_gpipe.pipeline.schedule import *  # noqa: F401,F403
