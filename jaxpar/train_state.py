"""Training state and per-step statistics as NamedTuple pytrees."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


def check_optimizer(optimizer: Any) -> None:
  """``TypeError`` unless ``optimizer`` is an optax ``GradientTransformation``."""
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(
        f'optimizer must be an optax.GradientTransformation (e.g. '
        f'optax.adam(1e-3)), got {type(optimizer).__name__}: {optimizer!r}.')


class TrainState(NamedTuple):
  """What a train step carries from one step to the next.

  Attributes:
    step: int32 scalar, the number of updates applied so far (skipped,
      non-finite steps do not count).
    params: the model parameters (any pytree).
    opt_state: the optax optimizer state for ``params``.
  """
  step: jax.Array
  params: PyTree
  opt_state: PyTree

  @classmethod
  def create(cls, params: PyTree,
             optimizer: optax.GradientTransformation) -> 'TrainState':
    """A fresh state: ``step=0`` and ``opt_state=optimizer.init(params)``.

    Example:
      >>> state = jaxpar.TrainState.create({'w': jnp.zeros(3)}, optax.sgd(0.1))
      >>> int(state.step)
      0
    """
    check_optimizer(optimizer)
    return cls(jnp.zeros((), jnp.int32), params, optimizer.init(params))


class StepStats(NamedTuple):
  """Statistics of one train step, as device arrays (no host sync).

  Attributes:
    loss: global mean loss over the batch, before the update.
    grad_norm: global L2 norm of the gradient over all shards, before clipping.
    skipped: bool, True when the loss or gradient was non-finite and the
      update was not applied.
    aux: the ``loss_fn`` auxiliary output (``has_aux=True``), averaged over
      microbatches and replicas; ``None`` otherwise.
  """
  loss: jax.Array
  grad_norm: jax.Array
  skipped: jax.Array
  aux: PyTree = None
