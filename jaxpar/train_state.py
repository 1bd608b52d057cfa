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


def apply_gradients(state: TrainState, grads: PyTree, *, loss: jax.Array,
                    grad_norm: jax.Array,
                    optimizer: optax.GradientTransformation,
                    max_grad_norm: float | None = None
                    ) -> tuple[TrainState, jax.Array]:
  """One optimizer update with global-norm clipping and non-finite skipping.

  The one update rule every jaxpar train step shares. ``grad_norm`` is the
  global L2 norm of ``grads`` over *all* shards, computed by the caller
  (inside ``shard_map`` each device sees only its shard, so the caller
  ``psum``s the squared norms over sharded axes first). Clipping then follows
  ``optax.clip_by_global_norm`` exactly::

    g <- g                          if ||g|| < max_grad_norm
    g <- g / ||g|| * max_grad_norm  otherwise

  If ``loss`` or ``grad_norm`` is not finite the update is skipped: params,
  optimizer state and step are returned unchanged.

  Returns:
    ``(new_state, skipped)`` with ``skipped`` a bool scalar.
  """
  if max_grad_norm is not None:
    grads = jax.tree.map(
        lambda g: jnp.where(grad_norm < max_grad_norm, g,
                            g / grad_norm * max_grad_norm).astype(g.dtype),
        grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  keep = lambda new, old: jax.tree.map(
      lambda n, o: jnp.where(ok, n, o), new, old)
  new_state = TrainState(state.step + ok.astype(state.step.dtype),
                         keep(params, state.params),
                         keep(opt_state, state.opt_state))
  return new_state, ~ok
