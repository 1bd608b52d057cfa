"""3D parallelism: data x pipeline x tensor on one ``('data', 'stage', 'tensor')`` mesh.

The whole 3D trainer: ``trainer`` for three functions and ``model_trainer``
for a ``from_nnx`` model (the step, its specs and placement), the
params it trains (``PipelineParams``, the per-layer ``LayerParams`` view the
optimizer sees, the ``LayerSplit`` of layers over stages), the moves of stage
trees between the executor's rank order and model order, and
``from_nnx``, which cuts a Flax NNX model as written into a pipeline (tied
embeddings one param, the blocks' BatchNorm statistics carried by the step).
"""

from jaxpar.parallel._from_nnx import PipelineModel as PipelineModel
from jaxpar.parallel._from_nnx import from_nnx as from_nnx
from jaxpar.parallel._params import LayerParams as LayerParams
from jaxpar.parallel._params import LayerSplit as LayerSplit
from jaxpar.parallel._params import PipelineParams as PipelineParams
from jaxpar.parallel._placement import (
    stages_in_model_order as stages_in_model_order)
from jaxpar.parallel._placement import stages_like as stages_like
from jaxpar.parallel._trainer import model_trainer as model_trainer
from jaxpar.parallel._trainer import trainer as trainer

__all__ = [
    'LayerParams', 'LayerSplit', 'PipelineModel', 'PipelineParams',
    'from_nnx', 'model_trainer', 'stages_in_model_order', 'stages_like',
    'trainer',
]
