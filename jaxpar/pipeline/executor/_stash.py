"""What a stage's stash holds: the policy as the stash applies it, and
activations replicated over a mesh axis stored split over it.

``rule(policy)``: a product policy (``'dots'``, ``'dots_no_batch'``) as the
stash applies it, two refinements that change no value:

* a matrix product that widens its operands (``bf16 @ bf16 -> f32``
  attention logits) is not stashed but recomputed from them, so under
  ``compute_dtype=bfloat16`` every stashed activation is bf16;
* the sum over devices that follows a tensor-parallel product (``psum``,
  ``psum_scatter``) is stashed rather than the per-device partial product
  it sums: the backward needs the sum (a layer norm's input), which is then
  not recomputed by a second all-reduce, and, replicated over ``tensor``,
  it is stored split over it (below).

``StashSplit``: inside ``jax.shard_map``, a stashed activation that does not
vary over a mesh axis that the stage's parameters vary over (``tensor``: the
stage input, the summed outputs above) holds the same values on every
device of that axis. ``plan`` splits such a leaf along its largest dim that
the axes' sizes divide; ``store`` keeps this device's slice (``1/t`` of the
bytes, a free ``dynamic_slice``); ``gather`` all-gathers it in the backward
(Megatron's sequence-parallel stash). Exact: the gathered leaf is the
stashed one.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np, jaxpar
  >>> from jax.sharding import PartitionSpec as P
  >>> from jaxpar.pipeline.executor import _stash
  >>> shapes = []
  >>> def body(w, x):   # w varies over 'tensor', x does not
  ...   splits = _stash.plan([x], w)
  ...   stored = _stash.store([x], splits)
  ...   shapes.append(stored[0].shape)   # this device's slice
  ...   return _stash.gather(stored, splits)[0]
  >>> mesh = jaxpar.make_mesh(tensor=2, devices=jax.devices()[:2])
  >>> run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(
  ...     P('tensor'), P()), out_specs=P()))
  >>> w = jax.device_put(np.ones(2), jax.NamedSharding(mesh, P('tensor')))
  >>> x = np.arange(12.0).reshape(3, 4)
  >>> back = run(w, x)
  >>> shapes, bool((back == x).all())
  ([(3, 2)], True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.vma import varying_axes

PyTree = Any

# The named policies that stash matrix products.
_PRODUCTS = (jax.checkpoint_policies.dots_saveable,
             jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
# Sums over devices (all-reduce, reduce-scatter): stashed, not their inputs.
_SUMS = frozenset(('psum', 'psum_invariant', 'reduce_scatter'))


def rule(policy: Callable[..., bool] | None) -> Callable[..., bool] | None:
  """``policy`` as the stash applies it (module doc); policies that are not
  ``'dots'`` or ``'dots_no_batch'`` are applied as given."""
  if policy not in _PRODUCTS:
    return policy

  def refined(prim, *avals, **params):
    if prim.name in _SUMS:
      return True
    if prim.name == 'dot_general' and _widens(avals, params):
      return False
    return policy(prim, *avals, **params)
  return refined


def _widens(avals: Sequence[Any], params: dict) -> bool:
  """Whether a ``dot_general``'s output is wider than its operands."""
  out = params.get('preferred_element_type')
  return out is not None and jnp.dtype(out).itemsize > max(
      jnp.dtype(a.dtype).itemsize for a in avals)


class StashSplit(NamedTuple):
  """A stash leaf stored split: its ``dim`` over ``axes``, in turn."""
  dim: int
  axes: tuple[str, ...]


def plan(stash: Sequence[Any],
         params: PyTree) -> tuple[StashSplit | None, ...]:
  """Per stash leaf (array or aval): how it is stored (``None``: whole).

  StashSplit over the axes (of size > 1) that ``params`` vary over and the leaf
  does not, along the leaf's largest dim their sizes divide.
  """
  over = varying_axes(params)

  def one(leaf):
    axes = tuple(sorted(a for a in over - varying_axes(leaf)
                        if jax.lax.axis_size(a) > 1))
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    dims = [d for d, size in enumerate(leaf.shape) if size % n == 0]
    if not axes or not dims:
      return None
    return StashSplit(max(dims, key=lambda d: leaf.shape[d]), axes)
  return tuple(one(leaf) for leaf in stash)


def store(stash: Sequence[jax.Array],
          splits: Sequence[StashSplit | None]) -> list[jax.Array]:
  """Each leaf, or this device's slice of it (``F``)."""
  def one(leaf, split):
    for axis in split.axes if split else ():
      size = leaf.shape[split.dim] // jax.lax.axis_size(axis)
      leaf = jax.lax.dynamic_slice_in_dim(
          leaf, jax.lax.axis_index(axis) * size, size, axis=split.dim)
    return leaf
  return [one(leaf, split) for leaf, split in zip(stash, splits)]


def gather(stash: Sequence[jax.Array],
           splits: Sequence[StashSplit | None]) -> list[jax.Array]:
  """The stashed leaves whole again (the backward), replicated as they
  were."""
  def one(leaf, split):
    for axis in reversed(split.axes) if split else ():
      leaf = jax.lax.all_gather(leaf, axis, axis=split.dim, tiled=True,
                                to='invarying')
    return leaf
  return [one(leaf, split) for leaf, split in zip(stash, splits)]
