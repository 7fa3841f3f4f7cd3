"""The import path of lingvo_gpipe.models.base_model_params, which holds the code."""

from lingvo_gpipe.models.base_model_params import *  # noqa: F401,F403
