"""The import path of lingvo_gpipe.runners.keras_pipeline, which holds the code."""

from lingvo_gpipe.runners.keras_pipeline import *  # noqa: F401,F403
