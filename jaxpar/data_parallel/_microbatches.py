"""The batch as microbatches: its size, its split, and gradients
accumulated over the microbatches in order (one microbatch's activations
live at a time)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.train_state.internal import PyTree
from jaxpar.vma import vary


def batch_size_of(batch: PyTree, *, name: str = 'batch') -> int:
  """The shared leading size of ``batch``'s leaves (``ValueError`` if none)."""
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise ValueError(f'{name} has no array leaves.')
  sizes = {}
  for path, leaf in leaves:
    shape = np.shape(leaf)
    if not shape:
      raise ValueError(
          f'{name} leaf {jax.tree_util.keystr(path)} is a scalar; every leaf '
          'needs a leading batch axis.')
    sizes[jax.tree_util.keystr(path)] = shape[0]
  if len(set(sizes.values())) > 1:
    listing = ', '.join(f'{k or "<root>"}: {v}' for k, v in sizes.items())
    raise ValueError(
        f'{name} leaves have different leading (batch) sizes ({listing}); '
        'all leaves must share the batch axis.')
  return next(iter(sizes.values()))


def split_microbatches(batch: PyTree, num_microbatches: int) -> PyTree:
  """``[B, ...] -> [k, B/k, ...]`` for every leaf (microbatch i = rows i*B/k...)."""
  return jax.tree.map(
      lambda x: x.reshape(num_microbatches, x.shape[0] // num_microbatches,
                          *x.shape[1:]), batch)


def microbatched_value_and_grad(loss_fn: Callable[..., Any], params: PyTree,
                                model_state: PyTree, batch: PyTree, *,
                                num_microbatches: int = 1,
                                data_axis: str | None = None,
                                key: jax.Array | None = None):
  """Mean loss and gradient over ``num_microbatches`` slices of ``batch``.

  ``loss_fn(params, model_state, batch_i, key) -> (loss, (aux,
  model_state))`` (``_model_state.stateful``'s form). ``loss = 1/k sum_i
  loss(params, batch_i)`` and its gradient; gradients accumulate in a
  ``lax.scan`` so only one microbatch's activations are live at a time, and
  the model state is threaded through the microbatches in order. Inside
  ``shard_map`` (or ``pmap``), ``data_axis`` names the mesh axis the batch
  is split over (the scan's carry must vary over it too).

  With a ``key``, microbatch ``i`` runs ``loss_fn(params, model_state,
  batch_i, fold_in(key, g))`` with ``g = axis_index(data_axis) * k + i``
  (``g = i`` without ``data_axis``): its index in the global batch.

  Returns:
    ``(loss, grads, aux, model_state)``; ``aux`` is the microbatch mean of
    the auxiliary output, ``model_state`` the one after the last microbatch.
  """
  vg = jax.value_and_grad(loss_fn, has_aux=True)
  first = (0 if data_axis is None or key is None
           else jax.lax.axis_index(data_axis) * num_microbatches)

  def one(state, mb, index):
    k = None if key is None else jax.random.fold_in(key, first + index)
    (loss, (aux, state)), grads = vg(params, state, mb, k)
    return (loss, grads, aux), state

  if num_microbatches == 1:
    out, model_state = one(model_state, batch, 0)
    return (*out, model_state)

  def body(carry, mb_and_index):
    acc, state = carry
    out, state = one(state, *mb_and_index)
    if data_axis is not None:
      state = vary(state, data_axis)
    return (jax.tree.map(jnp.add, acc, out), state), None

  mbs = split_microbatches(batch, num_microbatches)
  zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
      one, model_state, jax.tree.map(lambda x: x[0], mbs), 0)[0])
  if data_axis is not None:
    zero = jax.lax.pcast(zero, data_axis, to='varying')
    model_state = vary(model_state, data_axis)
  (total, model_state), _ = jax.lax.scan(
      body, (zero, model_state), (mbs, jnp.arange(num_microbatches)))
  return (*jax.tree.map(lambda t: t / num_microbatches, total), model_state)
