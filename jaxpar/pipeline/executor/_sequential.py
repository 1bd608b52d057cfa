"""The executor on one pipeline rank: the microbatches in turn, no ticks.

With ``p = 1`` there is nothing to overlap, so ``_tick_scan.run`` hands the
step to ``sequential``: one ``lax.scan`` over the microbatches of
``jax.value_and_grad`` of the whole model, with the results of ``run``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.pipeline.executor._microbatches import (
    LossFn, StageFn, extras, row)
from jaxpar.pipeline.executor._options import Embedding, StepOptions
from jaxpar.pipeline.executor._remat import remat_layers
from jaxpar.pipeline.executor._stage_vjp import stash_policy
from jaxpar.pipeline.executor._tick_state import ModelState, Result
from jaxpar.pipeline.executor._vma import like, stored
from jaxpar.vma import vary, varying_axes

PyTree = Any


def sequential(stage_fn: StageFn, loss_fn: LossFn | None, schedule: Any,
               local_params: PyTree, loss_params: PyTree, inputs: PyTree,
               targets: PyTree, *, options: StepOptions,
               embedding: Embedding | None = None,
               stage_state: PyTree = None, head_state: PyTree = None):
  """``run`` on one rank: the microbatches in turn, no ticks.

  A ``lax.scan`` over the ``m`` microbatches of ``jax.value_and_grad`` of
  the whole model (embedding, the ``num_stages`` stages in order, the loss),
  accumulating as data parallelism's microbatches do and passing the
  model state (the stages', the embedding's, the loss's: a ``ModelState``,
  ``None`` parts where there is none) from each microbatch to the next;
  the same keys,
  results and return values as ``run``. Plain autodiff (XLA fuses the
  backward) under ``remat_policy='everything'`` (or ``None``); under
  another policy each stage runs ``remat_layers``: the policy per layer of
  a scanned stack (each scan's body a ``jax.checkpoint``), else per stage.
  """
  m, num_stages = schedule.num_microbatches, schedule.num_stages
  train = loss_fn is not None
  key, axis = options.key, options.stage_axis
  base = varying_axes(inputs) | {axis}
  embed_params = None if embedding is None else embedding.params
  state = ModelState(stage_state, None if embedding is None
                     else embedding.state, head_state)
  local_params, loss_params, embed_params, state = vary(
      (local_params, loss_params, embed_params, state), base)
  layer = lambda p, x, k, s: stage_fn(p, x, **extras(k, s))
  policy = stash_policy(options.remat_policy)
  if train and policy is not None:
    layer = remat_layers(layer, policy)

  def model(params, lp, ep, x, target, mb, states):
    """The microbatch's share of the mean loss and ``(aux, new states)``,
    or (forward only) its output."""
    g = options.microbatch_offset + mb
    new_embed = new_head = None
    if embedding is not None:
      k = (None if embedding.key is None else
           jax.random.fold_in(embedding.key, g))
      x = embedding.fn(ep, x, **extras(k, states.embed))
      if states.embed is not None:
        x, new_embed = x
    keys = None if key is None else jax.random.fold_in(key, g)
    key_of = lambda k: None if key is None else jax.random.fold_in(keys, k)
    new = []
    for j in range(num_stages):
      x = layer(row(params, j), x, key_of(j), row(states.stages, j))
      if states.stages is not None:
        x, new_state = x
        new.append(new_state)
    if not train:
      return x
    out = loss_fn(lp, x, target, **extras(key_of(num_stages), states.head))
    if states.head is not None:
      out, new_head = out
    loss, aux = jax.tree.map(lambda a: a.astype(jnp.promote_types(
        a.dtype, jnp.float32)) / m, out if options.has_aux else (out, ()))
    return loss, (aux, ModelState(
        jax.tree.map(lambda *a: jnp.stack(a), *new) if new else None,
        new_embed, new_head))

  mbs = jnp.arange(m)
  if not train:
    return jax.lax.psum(jax.lax.map(
        lambda a: model(local_params, None, embed_params, *a, state),
        (inputs, targets, mbs)), axis)
  with_dx = embedding is None and options.input_grads
  grad = jax.value_and_grad(model, (0, 1, 2, 3) if with_dx else (0, 1, 2),
                            has_aux=True, allow_int=True)

  def body(carry, a):
    acc, states = carry
    (loss, (aux, new)), grads = grad(local_params, loss_params, embed_params,
                                     *a, states)
    acc = jax.tree.map(lambda s, d: s + vary(d, varying_axes(s)), acc,
                       ((loss, aux), grads[:3]))
    # Integer input leaves: zeros of their dtype, not float0.
    return (acc, like(new, states)), (stored(grads[3], a[0]) if with_dx
                                      else None)

  first = jax.tree.map(lambda a: a[0], (inputs, targets))
  (loss, (aux, new)), grads = jax.eval_shape(lambda: grad(
      local_params, loss_params, embed_params, *first, mbs[0], state))
  zero = jax.tree.map(
      lambda a: vary(jnp.zeros(a.shape, a.dtype), base | varying_axes(a)),
      ((loss, aux), grads[:3]))
  # The states vary as the new ones do (e.g. over a data axis).
  ((out, (grads, dlp, de)), states), dx = jax.lax.scan(
      body, (zero, vary(state, varying_axes(new))),
      (inputs, targets, mbs))
  # One rank: the sums (the embedding's and the loss's state, too) only
  # type the results as the same on every rank, as ``run``'s.
  out, dlp, de, dx, ends = jax.lax.psum(
      (out, dlp, de, dx, (states.embed, states.head)), axis)
  return Result(out, grads, dlp, dx,
                (de if embedding is not None else None),
                ModelState(states.stages, *ends))
