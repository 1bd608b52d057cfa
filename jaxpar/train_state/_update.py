"""The one update every train step ends in: clip, skip if non-finite, update.

``apply_gradients`` runs ``optimizer.update`` on global arrays;
``sharded_update`` runs it under ``jax.sharding.auto_axes`` inside a
trainer's ``jit``, so that XLA's partitioner inserts the collectives any
optax transform needs. ``global_norm`` is the gradient norm both report.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.train_state._placement import shardings
from jaxpar.train_state._state import StepStats, TrainState

PyTree = Any


def global_norm(tree: PyTree) -> jax.Array:
  """L2 norm over all leaves, accumulated in float32 or wider.

  ``sqrt(sum_leaves sum(x^2))``, each leaf cast to
  ``promote_types(dtype, float32)`` first, so bfloat16 gradients do not lose
  the sum. On global sharded arrays under ``jit`` XLA adds the all-reduce:
  the norm is over all shards. Equals ``optax.tree.norm`` in float32/64.

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> float(jaxpar.train_state.global_norm({'a': jnp.array([3.0, 4.0])}))
    5.0
  """
  squares = [jnp.sum(jnp.square(x.astype(jnp.promote_types(x.dtype,
                                                            jnp.float32))))
             for x in jax.tree.leaves(tree)]
  return jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32)))


def apply_gradients(state: TrainState, grads: PyTree, *, loss: jax.Array,
                    optimizer: optax.GradientTransformation,
                    max_grad_norm: float | None = None,
                    update_specs: PyTree | None = None,
                    model_state: PyTree = None
                    ) -> tuple[TrainState, StepStats]:
  """One optimizer update with global-norm clipping and non-finite skipping.

  The one update rule every jaxpar train step shares, on global arrays
  (``grads`` of the global mean loss)::

    |g| = global_norm(g)                      before clipping (StepStats)
    g  <- optax.clip_by_global_norm(max_grad_norm)(g)      if max_grad_norm
    params, opt_state <- optimizer.update(g, opt_state, params, value=loss)

  so ``max_grad_norm=c`` equals ``optax.chain(optax.clip_by_global_norm(c),
  optimizer)``. ``value=loss`` is optax's convention for the transforms
  whose update takes the loss (``GradientTransformationExtraArgs``:
  ``optax.contrib.reduce_on_plateau``, ``momo``); the others ignore it
  (``optax.with_extra_args_support``). If ``loss`` or ``|g|`` is not finite
  the update is skipped: params, optimizer state, model state and step come
  back unchanged.

  Args:
    state: the ``TrainState`` before the step.
    grads: gradient of the mean loss, shaped like ``state.params``.
    loss: the mean loss: its finiteness gates the update, and it is the
      ``value=`` of the optimizer's update.
    optimizer: any optax ``GradientTransformation``.
    max_grad_norm: clip to this global norm; ``None``: no clipping.
    update_specs: optional ``PartitionSpec`` tree for ``state.params`` under
      which the update runs (ZeRO-1: each device updates the ``1/N`` of the
      params whose optimizer state it holds); only inside ``auto_axes``.
    model_state: the model state the forward pass gave (the new
      ``state.model_state``, kept only if the step is); ``None``: unchanged.

  Returns:
    ``(new_state, StepStats(loss, grad_norm, skipped))``.

  Example:
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> state = jaxpar.TrainState.create({'w': jnp.ones(2)}, optax.sgd(0.5))
    >>> new, stats = jaxpar.train_state.apply_gradients(
    ...     state, {'w': jnp.ones(2)}, loss=jnp.float32(1.0),
    ...     optimizer=optax.sgd(0.5))
    >>> new.params['w'].tolist(), int(new.step)
    ([0.5, 0.5], 1)
  """
  grad_norm = global_norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  new_state = _updated(state, grads, grad_norm, ok, loss, optimizer=optimizer,
                       max_grad_norm=max_grad_norm, update_specs=update_specs,
                       model_state=model_state)
  return _kept(ok, new_state, state), StepStats(loss, grad_norm, ~ok)


def _after_gradients(tree: PyTree, ok: jax.Array) -> PyTree:
  """``tree``'s arrays as values computed from ``ok`` (equal where ``ok``).

  ``ok`` is computed from the gradients (their norm), so everything that
  reads the result -- collectives that reshard the params or take their
  norm -- runs after the whole gradient computation, also on XLA:CPU: its
  runtime orders one device's collectives by launch only, and a loop of
  collectives (the pipeline's tick scan) counts as launched once its first
  iteration goes asynchronous, so a collective that does not depend on the
  loop's result can run beside it, in a different order on each device,
  until the blocked threads exhaust the thread pool and the rendezvous
  aborts (``docs/reliability.md``). An ``optimization_barrier`` orders HLO,
  not XLA:CPU's runtime (it reuses the buffers); a select does. Where ``ok``
  is false the values are zeros: the update is skipped and its result
  discarded (``_kept``). Non-numeric leaves (PRNG keys) pass unchanged.
  """
  def gate(x):
    if not isinstance(x, jax.Array) or not (
        jnp.issubdtype(x.dtype, jnp.number) or x.dtype == jnp.bool_):
      return x
    return jnp.where(ok, x, jnp.zeros_like(x))
  return jax.tree.map(gate, tree)


def _updated(state: TrainState, grads: PyTree, grad_norm: jax.Array,
             ok: jax.Array, loss: jax.Array, *,
             optimizer: optax.GradientTransformation,
             max_grad_norm: float | None, update_specs: PyTree | None,
             model_state: PyTree) -> TrainState:
  """The state after the update, as if ``ok`` (the caller keeps the old one
  where not: ``_kept``); its inputs pass ``_after_gradients`` first."""
  if max_grad_norm is not None:
    # optax.clip_by_global_norm's rule, with the norm computed once.
    grads = jax.tree.map(
        lambda g: jnp.where(grad_norm < max_grad_norm, g,
                            g / grad_norm.astype(g.dtype) * max_grad_norm
                            ).astype(g.dtype), grads)
  params, opt_state = _after_gradients((state.params, state.opt_state), ok)
  if update_specs is not None:
    params = jax.lax.with_sharding_constraint(params, update_specs)
  updates, opt_state = optax.with_extra_args_support(optimizer).update(
      grads, opt_state, params, value=loss)
  new_params = optax.apply_updates(params, updates)
  if update_specs is not None:  # the update's slices, gathered once
    new_params = jax.lax.with_sharding_constraint(new_params, update_specs)
  return TrainState(state.step, new_params, opt_state,
                    state.model_state if model_state is None else model_state)


def _kept(ok: jax.Array, new: TrainState, old: TrainState) -> TrainState:
  """``new`` where ``ok``, else ``old`` (the step counts only if ``ok``); same
  dtypes out as in, never weakly typed, so the next step hits the cache.
  ``new`` and ``old`` are laid out alike: a select, no collective."""
  keep = lambda n, o: jax.lax.convert_element_type(jnp.where(ok, n, o),
                                                  o.dtype)
  return TrainState(old.step + ok.astype(old.step.dtype),
                    *(jax.tree.map(keep, n, o)
                      for n, o in zip(new[1:], old[1:])))


def sharded_update(state: TrainState, grads: PyTree, *, loss: jax.Array,
                   optimizer: optax.GradientTransformation, mesh: Mesh,
                   state_specs: TrainState,
                   max_grad_norm: float | None = None,
                   update_specs: PyTree | None = None,
                   model_state: PyTree = None
                   ) -> tuple[TrainState, StepStats]:
  """``apply_gradients`` on global arrays, partitioned by XLA (inside ``jit``).

  Runs under ``jax.sharding.auto_axes``: inside, the mesh axes are ``Auto``
  and XLA's SPMD partitioner inserts the collectives every transform needs;
  the new state comes out with ``state_specs`` (the shardings it went in
  with). ``model_state`` as ``apply_gradients``'s (laid out as
  ``state_specs.model_state``). Call it inside ``jax.set_mesh(mesh)``.
  """
  def update(state, grads, loss, model_state):
    grad_norm = global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    return _updated(state, grads, grad_norm, ok, loss, optimizer=optimizer,
                    max_grad_norm=max_grad_norm, update_specs=update_specs,
                    model_state=model_state), grad_norm, ok
  replicated = NamedSharding(mesh, P())
  out = (shardings(mesh, state_specs), replicated, replicated)
  new, grad_norm, ok = jax.sharding.auto_axes(update, out_sharding=out)(
      state, grads, loss, model_state)
  # Both laid out as state_specs: the select needs no collective that reads
  # the old state alone (``_after_gradients``).
  return _kept(ok, new, state), StepStats(loss, grad_norm, ~ok)
