"""The import path of lingvo_gpipe.models.model_registry, which holds the code."""

from lingvo_gpipe.models.model_registry import *  # noqa: F401,F403
