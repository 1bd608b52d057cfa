"""A pipelined model's params: stacked for the pipeline, per layer for the optimizer.

A leaf module: ``jaxpar.models`` builds these (``gpt.split_for_pipeline``) and
``jaxpar.parallel`` trains them, so neither has to import the other.

* ``PipelineParams(embed, stages, head)``: what the pipeline runs, stage
  leaves stacked ``[num_stages, ...]``;
* ``LayerParams(embed, layers, head)``: what the 3D trainer's optimizer sees
  (``jaxpar.pipeline_view``): the same arrays with one tree per layer, in
  model order and with the model's shapes.
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


class LayerParams(NamedTuple):
  """The per-layer view of ``PipelineParams``: ``embed``, ``layers``, ``head``.

  ``layers`` is a list with one tree per real layer in model order (identity
  slots of uneven splits are not layers), each shaped like one layer of the
  dense model. The 3D trainer's ``optimizer.init``/``update`` see this, and
  its optimizer state holds it (e.g. Adam's ``mu``).

  Example:
    >>> from jaxpar.pipeline_params import LayerParams
    >>> view = LayerParams(embed={}, layers=[{'w': jnp.ones(2)}] * 3, head={})
    >>> len(view.layers), view.layers[0]['w'].shape
    (3, (2,))
  """
  embed: PyTree
  layers: list
  head: PyTree
