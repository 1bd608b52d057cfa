"""ZeRO's building blocks inside ``jax.shard_map``: the collectives of a step.

Each runs on one device's shards, with ``specs`` the leaves' global
``PartitionSpec``s (``data_specs``): ``vary_unsplit`` types replicated params
as per-device, ``gather`` all-gathers ZeRO-3 slices, ``gathered`` runs a
function on them gathering each param at its first use (``_layer_gather``),
``reduce_gradients`` averages gradients over the data axis into the ZeRO
layout. ``jaxpar.data_parallel.trainer`` and ``jaxpar.parallel.trainer``
compose them; the package docstring shows one step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.data_parallel._layer_gather import Slice, at_first_use
from jaxpar.data_parallel._padding import Padded, entry_axes, is_padded
from jaxpar.data_parallel._specs import data_dim
from jaxpar.train_state.internal import PyTree


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def vary_unsplit(params: PyTree, specs: PyTree, *, data_axis: str) -> PyTree:
  """Leaves not split over ``data_axis`` made varying over it (``lax.pcast``).

  Inside ``shard_map``: then ``jax.grad`` gives each device its own gradient
  instead of summing over ``data_axis`` (see ``reduce_gradients``).
  ``Padded`` leaves are always split.
  """
  return jax.tree.map(
      lambda s, x: x if data_dim(s, data_axis) is not None
      else jax.lax.pcast(x, data_axis, to='varying'), specs, params,
      is_leaf=_is_spec)


def gather(params: PyTree, specs: PyTree, *, data_axis: str,
           skip: int = 0) -> PyTree:
  """Full leaves from every device's slice: ``all_gather`` along the data dim.

  Inside ``shard_map``. ``specs`` are the leaves' global specs; ``skip``
  leading dims of the global leaf are not in ``params`` (a stage's slice of
  ``[p, v, ...]`` stage leaves: ``skip=2``). A ``Padded`` leaf is cut to its
  logical size after the gather (the cut's transpose pads the gradient with
  zeros). The result is typed varying, so its transpose is a reduce-scatter
  (a sum over ``data_axis``).
  """
  def one(spec, x):
    dim = data_dim(spec, data_axis)
    if dim is None:
      return x
    value = x.value if is_padded(x) else x
    full = jax.lax.all_gather(value, data_axis, axis=dim - skip, tiled=True,
                              to='varying')
    if is_padded(x):
      full = jax.lax.slice_in_dim(full, 0, x.shape[dim], axis=dim - skip)
    return full
  return jax.tree.map(one, specs, params, is_leaf=_is_spec)


def gathered(fn: Callable[..., Any], specs: PyTree, *, data_axis: str,
             skip: int = 0) -> Callable[..., Any]:
  """``fn(params, *args, **kwargs)`` on ZeRO-3 slices, each param gathered
  at its first use.

  ``g(slices, *args, **kwargs)`` equals ``fn(gather(slices), *args,
  **kwargs)``, but no param is gathered before ``fn`` needs it
  (``_layer_gather``): casts run on the slices, a ``lax.scan`` over stacked
  leaves gathers one layer per iteration (and its gradient is
  reduce-scattered per layer in the backward), and every gather sits in a
  ``jax.checkpoint`` that keeps no gathered param for the backward pass,
  which gathers again. The gradient w.r.t. ``slices`` is this device's
  slice of the gradient *summed* over ``data_axis`` (``Padded`` where the
  slices are, with zero padding).

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> params = {'w': jnp.ones((4, 8, 16)) / 8}      # 4 layers, stacked
    >>> specs = jaxpar.data_parallel.data_specs(params, mesh=mesh)
    >>> def loss(p, x):
    ...   step = lambda h, w: (jnp.tanh(h @ w[:, :8]), None)
    ...   return jax.lax.scan(step, x, p['w'])[0].sum()
    >>> fn = jaxpar.data_parallel.gathered(loss, specs, data_axis='data')
    >>> x = jax.device_put(jnp.ones((8, 8)), jax.NamedSharding(mesh, P('data')))
    >>> slices = jax.device_put(params, jax.tree.map(
    ...     lambda s: jax.NamedSharding(mesh, s), specs))
    >>> grad = jax.jit(jax.shard_map(
    ...     jax.grad(fn), mesh=mesh, in_specs=(specs, P('data')),
    ...     out_specs=specs))(slices, x)
    >>> want = jax.grad(loss)(params, jnp.ones((8, 8)))   # summed over data
    >>> specs['w'], bool(jnp.allclose(grad['w'], want['w']))
    (P(None, None, 'data'), True)
  """
  def held(spec, x):
    dim = data_dim(spec, data_axis)
    if dim is None:
      return x
    if is_padded(x):
      return Slice(x.value, dim - skip, x.shape[dim])
    return Slice(x, dim - skip)

  def fn_of_slices(params, *args, **kwargs):
    return at_first_use(
        fn, jax.tree.map(held, specs, params, is_leaf=_is_spec), *args,
        data_axis=data_axis, **kwargs)
  return fn_of_slices


def reduce_gradients(grads: PyTree, specs: PyTree, *, data_axis: str,
                     summed: bool = False) -> PyTree:
  """Mean over ``data_axis`` of per-device gradients, in the layout of
  ``specs``.

  Inside ``shard_map`` over ``data_axis`` (size ``N``). A leaf whose spec
  splits a dim over ``data_axis`` is reduce-scattered along it
  (``psum_scatter / N``),
  zero-padded first to a multiple of ``N`` when it does not divide (giving a
  ``Padded`` slice); with ``summed=True`` (ZeRO-3 gradients of ``gathered``:
  already summed and scattered) it is only divided by ``N``. All other
  leaves are averaged with one ``pmean``.
  """
  n = jax.lax.axis_size(data_axis)
  spec_leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
  leaves = treedef.flatten_up_to(grads)
  dims = [data_dim(s, data_axis) for s in spec_leaves]
  means = iter(jax.lax.pmean([g for g, d in zip(leaves, dims) if d is None],
                             data_axis))
  out = []
  for g, spec, dim in zip(leaves, spec_leaves, dims):
    if dim is None:
      out.append(next(means))
    elif summed:
      out.append(jax.tree.map(lambda v: v / n, g))
    else:
      out.append(_scatter(g, spec, dim, data_axis=data_axis, n=n))
  return treedef.unflatten(out)


def _scatter(g: jax.Array, spec: P, dim: int, *, data_axis: str,
             n: int) -> Any:
  """``psum_scatter(g) / N`` along ``dim``, padded first if ``N`` does not
  divide it (``Padded`` with ``g``'s global shape: local dims times the
  other axes that split them)."""
  short = -g.shape[dim] % n
  if short:
    padding = [(0, 0)] * g.ndim
    padding[dim] = (0, short)
    value = jnp.pad(g, padding)
  else:
    value = g
  value = jax.lax.psum_scatter(value, data_axis, scatter_dimension=dim,
                               tiled=True) / n
  if not short:
    return value
  entries = list(spec) + [None] * (g.ndim - len(spec))
  # Only this shard_map's other manual axes shrink a local dim; an axis XLA
  # partitions itself (an NNX model's 'tensor') leaves it whole here.
  manual = set(jax.sharding.get_abstract_mesh().manual_axes) - {data_axis}
  shape = tuple(s * math.prod(jax.lax.axis_size(a) for a in entry_axes(e)
                              if a in manual)
                for s, e in zip(g.shape, entries))
  return Padded(value, shape)
