"""``PipelineParams``: a pipelined model's params, ``embed -> stages -> head``.

A leaf module: ``jaxpar.models`` builds these (``gpt.split_for_pipeline``) and
``jaxpar.parallel`` trains them, so neither has to import the other.
"""

from __future__ import annotations

from typing import Any, NamedTuple

PyTree = Any


class PipelineParams(NamedTuple):
  """A pipelined model's params: ``embed`` -> ``stages`` -> ``head``.

  ``stages`` leaves are stacked ``[num_stages, ...]`` in model order (in a
  ``TrainState`` from ``Trainer.init`` they are in the executor's rank
  layout ``[p, v, ...]``; ``Trainer.params`` converts back).

  Example:
    >>> from jaxpar.pipeline_params import PipelineParams
    >>> pp = PipelineParams(embed={'w': jnp.ones(2)},
    ...                     stages={'w': jnp.ones((4, 2))}, head={})
    >>> pp.stages['w'].shape
    (4, 2)
  """
  embed: PyTree
  stages: PyTree
  head: PyTree
