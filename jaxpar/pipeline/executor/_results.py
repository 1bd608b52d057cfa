"""What the executor's training steps return: ``PipelineResult``, with its
``PipelineGrads`` and ``PipelineState``.

Example:
  >>> from jaxpar.pipeline.executor._results import PipelineState
  >>> PipelineState(stages={'mean': 0.0}).embed is None
  True
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

PyTree = Any


class PipelineGrads(NamedTuple):
  """Gradients of the mean batch loss, in ``PipelineResult.grads``.

  Attributes:
    stages: like the stage parameters: ``[num_stages, ...]`` in model order
      from ``pipeline_value_and_grad``, one rank's ``[v, ...]`` in rank
      order from ``pipeline_value_and_grad_local``.
    head: like ``loss_params``, the parameters ``loss_fn`` takes.
    inputs: like ``inputs`` (the same pytree of ``[batch, ...]`` leaves,
      ``float0`` zeros for an integer leaf): chain it with the VJP of a
      layer in front of the pipeline (``None`` with ``embed_fn``, which
      runs that layer inside the step, or with ``input_grads=False``).
    embed: like ``embed_params`` (``None`` without ``embed_fn``).
  """
  stages: PyTree
  head: PyTree
  inputs: PyTree
  embed: PyTree = None


class PipelineState(NamedTuple):
  """Model state that is not a parameter (BatchNorm's running statistics)
  after a step, in ``PipelineResult.state``; each part like the one given
  to the step, ``None`` where none was.

  Attributes:
    stages: ``stage_state``'s: ``[num_stages, ...]`` in model order from
      ``pipeline_value_and_grad``, one rank's ``[v, ...]`` in rank order
      from ``pipeline_value_and_grad_local``.
    embed: ``embed_state``'s (``embed_fn``'s), the same on every rank.
    head: ``head_state``'s (``loss_fn``'s), the same on every rank.

  Example (a parallel trainer's ``state.model_state`` of a ResNet with a
  BatchNorm stem is laid out the same way, as a ``PipelineParams``):
    >>> import jax.numpy as jnp, jaxpar
    >>> s = jaxpar.pipeline.PipelineState(
    ...     embed={'stem_bn': {'mean': jnp.zeros(8), 'var': jnp.ones(8)}})
    >>> s.stages is None, s.embed['stem_bn']['mean'].shape
    (True, (8,))
  """
  stages: PyTree = None
  embed: PyTree = None
  head: PyTree = None


class PipelineResult(NamedTuple):
  """What a pipelined training step returns, whatever its options.

  Attributes:
    loss: the mean loss over the batch, a float scalar.
    aux: ``loss_fn``'s auxiliary output averaged over the microbatches
      like the loss (``has_aux=True``); ``None`` without ``has_aux``.
    grads: the gradients, a ``PipelineGrads``.
    state: the model state after the last microbatch, a ``PipelineState``
      like the ``stage_state`` (and ``embed_state``, ``head_state``) given;
      ``None`` without any.
  """
  loss: jax.Array
  aux: PyTree
  grads: PipelineGrads
  state: PipelineState | None
