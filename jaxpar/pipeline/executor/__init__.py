"""The pipeline executor (JAX): a schedule as one ``lax.scan`` in a ``shard_map``.

``pipeline_value_and_grad`` and ``pipeline_apply`` own their ``shard_map``;
the ``_local`` forms run inside a caller's (the 3D trainer's). Inside, a
stage's backward is cut into its input-gradient and weight-gradient halves
(``StageVJP``, with a ``remat_policy`` for what the stash keeps), and stage
trees move between model order ``[num_stages, ...]`` and rank order
``[p, v, ...]`` (``stages_to_ranks`` / ``ranks_to_stages``). A training
step returns a ``PipelineResult`` (its gradients a ``PipelineGrads``, its
model state a ``PipelineState``). ``timeline`` runs a step with a host
timestamp at each tick's seams and returns a ``Timeline``: each rank's
blocks and messages as they ran, and where the time went.
"""

from jaxpar.pipeline.executor._microbatches import LossFn as LossFn
from jaxpar.pipeline.executor._microbatches import StageFn as StageFn
from jaxpar.pipeline.executor._pipeline import pipeline_apply as pipeline_apply
from jaxpar.pipeline.executor._pipeline import (
    pipeline_apply_local as pipeline_apply_local)
from jaxpar.pipeline.executor._pipeline import (
    pipeline_value_and_grad as pipeline_value_and_grad)
from jaxpar.pipeline.executor._pipeline import (
    pipeline_value_and_grad_local as pipeline_value_and_grad_local)
from jaxpar.pipeline.executor._placement import (
    ranks_to_stages as ranks_to_stages)
from jaxpar.pipeline.executor._placement import (
    stages_to_ranks as stages_to_ranks)
from jaxpar.pipeline.executor._results import PipelineGrads as PipelineGrads
from jaxpar.pipeline.executor._results import (
    PipelineResult as PipelineResult)
from jaxpar.pipeline.executor._results import PipelineState as PipelineState
from jaxpar.pipeline.executor._stage_vjp import StageVJP as StageVJP
from jaxpar.pipeline.executor._stage_vjp import stash_policy as stash_policy
from jaxpar.pipeline.executor._stamps import timeline as timeline
from jaxpar.pipeline.executor._timeline import RankTotals as RankTotals
from jaxpar.pipeline.executor._timeline import Timeline as Timeline

__all__ = [
    'LossFn', 'StageFn', 'PipelineGrads', 'PipelineResult', 'PipelineState',
    'StageVJP',
    'pipeline_apply', 'pipeline_apply_local', 'pipeline_value_and_grad',
    'pipeline_value_and_grad_local', 'ranks_to_stages', 'stages_to_ranks',
    'stash_policy',
    # jaxpar.pipeline.timeline: a step's ticks as they ran
    'timeline', 'RankTotals', 'Timeline',
]
