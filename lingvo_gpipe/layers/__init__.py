"""The layer zoo, one module per family; `layers.ProjectionLayer` and the rest are
importable from here, as from Lingvo's core/layers.py."""

from lingvo_gpipe.layers.basic import (  # noqa: F401
    ProjectionLayer,
    LayerNorm,
    EmbeddingLayer,
    PositionalEmbeddingLayer,
    SimpleFullSoftmax,
    DropoutLayer,
    SequentialLayer,
)
from lingvo_gpipe.layers.transformer import (  # noqa: F401
    MultiHeadedAttention,
    TransformerAttentionLayer,
    TransformerFeedForwardLayer,
    TransformerLayer,
)
from lingvo_gpipe.layers.conv import (  # noqa: F401
    Conv2DLayer,
    PoolingLayer,
    GlobalPoolingLayer,
    BatchNormLayer,
)
