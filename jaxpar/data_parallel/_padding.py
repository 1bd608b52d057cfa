"""Padded leaves: how ZeRO splits a leaf that no mesh size divides.

``NamedSharding`` needs every split dim to divide by its mesh axes. A leaf
ZeRO splits over ``data`` (size ``N``) along a dim of size ``d`` that ``N``
does not divide is stored zero-padded to ``ceil(d/N) * N`` rows, as torch
FSDP and DeepSpeed do, in a ``Padded(value, shape)`` pytree node that keeps
the logical ``shape``. Each device then holds ``ceil(d/N)`` rows: at most
one row more than ``1/N``.

The padding is storage only: ``unpad`` (under ``jit``) and ``unpadded``
(global arrays) give the logical leaves, ``padded_optimizer`` runs any optax
transform on them, ``place`` moves a state between layouts (meshes, data
sizes, ZeRO stages), and ``reduce_gradients`` / ``gather`` (``_blocks``)
pad and cut inside ``shard_map``. Padded entries are zero and stay zero.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Padded:
  """A leaf stored zero-padded so that ZeRO can split it over ``data``.

  A pytree node with one child, ``value`` (the stored array: the logical
  array with zeros appended along the dims whose size the mesh axes that
  split them do not divide), and the logical ``shape`` as static data. Inside
  ``shard_map`` ``value`` is the local slice and ``shape`` stays global.
  ``np.asarray`` gives the logical array; ``unpadded`` gives global ones.

  Example:
    >>> import jax.numpy as jnp, numpy as np, jaxpar
    >>> x = jaxpar.data_parallel.Padded(jnp.array([1., 2., 3., 0.]), (3,))
    >>> x.shape, x.dtype, np.asarray(x).tolist()
    ((3,), dtype('float32'), [1.0, 2.0, 3.0])
  """
  value: Any
  shape: tuple[int, ...]

  @property
  def dtype(self) -> np.dtype:
    return self.value.dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def sharding(self) -> Any:
    return self.value.sharding

  def __array__(self, dtype=None, copy=None):
    return np.asarray(np.asarray(self.value)[_logical_index(self.shape)],
                      dtype)


jax.tree_util.register_dataclass(Padded, data_fields=['value'],
                                 meta_fields=['shape'])


def is_padded(x: Any) -> bool:
  """Is ``x`` a ``Padded`` node (for ``is_leaf=``)?"""
  return isinstance(x, Padded)


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def _logical_index(shape: tuple[int, ...]) -> tuple[slice, ...]:
  return tuple(slice(0, s) for s in shape)


def entry_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes of one ``PartitionSpec`` entry (``None``, a name, a tuple)."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def split_size(entry: Any, sizes: Mapping[str, int]) -> int:
  """How many ways one ``PartitionSpec`` entry splits its dim."""
  return math.prod(sizes[a] for a in entry_axes(entry))


def padded_shape(shape: tuple[int, ...], spec: P, *, mesh: Mesh
                 ) -> tuple[int, ...]:
  """``shape`` with each dim rounded up to a multiple of the axes splitting it.

  Example:
    >>> import jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar.data_parallel._padding import padded_shape
    >>> padded_shape((1003, 64), P('data'), mesh=jaxpar.make_mesh(data=8))
    (1008, 64)
  """
  entries = list(spec) + [None] * (len(shape) - len(spec))
  return tuple(-(-s // k) * k for s, k in
               zip(shape, (split_size(e, mesh.shape) for e in entries)))


def _even_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
  """``spec`` without the axes of the dims they do not divide (no padding)."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  entries = [e if s % split_size(e, mesh.shape) == 0 else None
             for e, s in zip(entries, shape)]
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def pad(tree: PyTree, specs: PyTree, *, mesh: Mesh) -> PyTree:
  """Logical leaves as stored under ``specs``: ``Padded`` where they must be.

  Pure ``jnp`` (works under ``jit``): a leaf whose ``padded_shape`` is its
  shape stays as it is; another becomes ``Padded(zero-padded value, shape)``.
  ``specs`` is a tree prefix of ``tree`` (``optax.MaskedNode`` at the same
  places).

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar.data_parallel._padding import pad
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> pad({'b': jnp.ones(3), 'w': jnp.ones(8)},
    ...     {'b': P('data'), 'w': P('data')}, mesh=mesh)['b']
    Padded(value=Array([1., 1., 1., 0., 0., 0., 0., 0.], dtype=float32), shape=(3,))
  """
  def one(spec, x):
    shape = tuple(np.shape(x))
    full = padded_shape(shape, spec, mesh=mesh)
    if full == shape:
      return x
    return Padded(jnp.pad(x, [(0, f - s) for s, f in zip(shape, full)]), shape)
  return jax.tree.map(one, specs, tree, is_leaf=_is_spec)


def unpad(tree: PyTree) -> PyTree:
  """Every ``Padded`` node of ``tree`` as its logical array (under ``jit``).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpar.data_parallel._padding import Padded, unpad
    >>> unpad([Padded(jnp.arange(4.), (3,))])
    [Array([0., 1., 2.], dtype=float32)]
  """
  return jax.tree.map(
      lambda x: x.value[_logical_index(x.shape)] if is_padded(x) else x,
      tree, is_leaf=is_padded)


def logical_shapes(tree: PyTree) -> PyTree:
  """``jax.ShapeDtypeStruct`` of every leaf, ``Padded`` ones at their logical
  shape: what the optimizer and the user's functions see.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpar.data_parallel._padding import Padded, logical_shapes
    >>> logical_shapes({'b': Padded(jnp.ones(8), (3,))})
    {'b': ShapeDtypeStruct(shape=(3,), dtype=float32)}
  """
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
          tuple(np.shape(x)),
          x.dtype if hasattr(x, 'dtype') else np.result_type(x))
      if not is_padded(x) else jax.ShapeDtypeStruct(x.shape, x.dtype),
      tree, is_leaf=is_padded)


def logical_sharding(x: Padded) -> Any:
  """Where ``x``'s logical array goes: its sharding without the axes of the
  padded dims (``None`` if ``x.value`` has no ``NamedSharding``)."""
  sharding = getattr(x.value, 'sharding', None)
  if not isinstance(sharding, NamedSharding):
    return None
  return NamedSharding(sharding.mesh,
                       _even_spec(sharding.spec, x.shape, sharding.mesh))


@functools.partial(jax.jit, static_argnums=1)
def _moved(values: list, moves: tuple) -> list:
  """Global arrays ``values`` moved as ``moves`` say, in one program.

  ``moves[i] = (shape, cut, pad_to, sharding)``: ``values[i]`` resharded to
  ``cut`` (its padded dims whole) and cut to ``shape`` (its logical shape);
  if ``pad_to`` differs, resharded to ``sharding``'s spec without the
  axes that do not divide ``shape`` and zero-padded to ``pad_to``; then
  stored with ``sharding``. One program per signature, where the eager
  reshard, slice and pad of every leaf compile one program each per shape.
  """
  out = []
  for x, (shape, cut, pad_to, sharding) in zip(values, moves):
    x = jax.device_put(x, cut)[_logical_index(shape)]
    if pad_to != shape:
      x = jax.device_put(x, _even(sharding, shape))
      x = jnp.pad(x, [(0, f - s) for s, f in zip(shape, pad_to)])
    out.append(jax.device_put(x, sharding))
  return out


def _even(sharding: NamedSharding, shape: tuple[int, ...],
          whole: tuple[int, ...] = ()) -> NamedSharding:
  """``sharding`` without the axes of the dims of ``shape`` they do not
  divide, nor those of the dims ``whole``."""
  spec = list(_even_spec(sharding.spec, shape, sharding.mesh))
  spec += [None] * (len(shape) - len(spec))
  return NamedSharding(sharding.mesh, P(*(
      None if d in whole else e for d, e in enumerate(spec))))


def _move(leaves: list, targets: Sequence) -> list:
  """``leaves`` (``Padded`` or not) stored as ``targets`` say: each a
  ``(stored shape, sharding)``, or ``None`` for the logical array (shards
  kept, the padded dims whole).

  The global arrays that change shape go through one jitted program
  (``_moved``); host values and leaves only placed are handled eagerly.
  """
  out, todo = list(leaves), []
  for i, (x, target) in enumerate(zip(leaves, targets)):
    stored = x.value if is_padded(x) else x
    shape = x.shape if is_padded(x) else tuple(np.shape(x))
    if target is None:
      if not is_padded(x):
        continue
      sharding = logical_sharding(x)
      if sharding is None:   # a host value
        out[i] = x.value[_logical_index(x.shape)]
        continue
      pad_to = shape
    else:
      pad_to, sharding = target
      if tuple(np.shape(stored)) == pad_to:   # placed only: no reshaping
        # Already there (a step's own output): as it is. ``device_put`` of
        # each leaf costs ~0.1 ms of host time, per step, even then.
        there = (isinstance(stored, jax.Array) and
                 stored.sharding.is_equivalent_to(sharding, len(pad_to)))
        moved = stored if there else jax.device_put(stored, sharding)
        out[i] = moved if pad_to == shape else Padded(moved, shape)
        continue
    padded_dims = tuple(d for d, (s, f) in enumerate(
        zip(shape, np.shape(stored))) if s != f)
    if not (isinstance(stored, jax.Array)
            and isinstance(stored.sharding, NamedSharding)
            and stored.sharding.mesh == sharding.mesh):
      # host values, other meshes: onto this one first (one program runs
      # on one mesh), the padded dims whole.
      stored = jax.device_put(stored, _even(sharding, np.shape(stored),
                                            padded_dims))
    cut = _even(stored.sharding, shape, padded_dims)
    todo.append((i, stored, (shape, cut, pad_to, sharding)))
  if todo:
    moved = _moved([v for _, v, _ in todo], tuple(m for _, _, m in todo))
    for (i, _, (shape, _, pad_to, _)), value in zip(todo, moved):
      out[i] = value if pad_to == shape else Padded(value, shape)
  return out


def unpadded(tree: PyTree) -> PyTree:
  """Global arrays of ``tree`` at their logical shapes (outside ``jit``).

  Leaves that are not ``Padded`` come back as they are (shards kept); a
  ``Padded`` one is cut to its shape, no longer split along its padded dim
  (which the mesh does not divide). One jitted program for all of them.

  Example:
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> from jaxpar.data_parallel._padding import unpadded
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> state = jaxpar.data_parallel.shard_state(jaxpar.TrainState.create(
    ...     {'b': jnp.ones(3)}, optax.sgd(0.1)), mesh=mesh, zero_stage=3)
    >>> b = unpadded(state.params)['b']
    >>> b.shape, b.sharding.is_fully_replicated
    ((3,), True)
  """
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_padded)
  return treedef.unflatten(_move(leaves, [None] * len(leaves)))


def place(tree: PyTree, specs: PyTree, *, mesh: Mesh) -> PyTree:
  """``tree`` (in any layout, padded or not, any mesh) stored under ``specs``.

  Leaves already stored at their ``padded_shape`` are only placed
  (``jax.device_put``, nothing moves if they are there); others are
  unpadded and padded anew on ``mesh`` (a ``Padded`` leaf of another data
  size, or a logical one that now needs padding), all in one jitted program.

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar.data_parallel._padding import place
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> place({'b': jnp.ones(3)}, {'b': P('data')},
    ...       mesh=mesh)['b'].value.sharding.spec
    P('data',)
  """
  spec_tree = jax.tree.structure(specs, is_leaf=_is_spec)
  leaves = spec_tree.flatten_up_to(tree)
  return spec_tree.unflatten(_move(leaves, _targets(
      tuple(x.shape if is_padded(x) else tuple(np.shape(x)) for x in leaves),
      tuple(spec_tree.flatten_up_to(specs)), mesh)))


@functools.lru_cache(maxsize=64)
def _targets(shapes: tuple, specs: tuple, mesh: Mesh) -> tuple:
  """``place``'s ``(stored shape, sharding)`` of each leaf: built once per
  shapes and specs (a trainer places its state every step)."""
  return tuple((padded_shape(shape, spec, mesh=mesh), NamedSharding(mesh, spec))
               for shape, spec in zip(shapes, specs))


def place_like(tree: PyTree, like: PyTree) -> PyTree:
  """Logical ``tree`` stored as ``like`` is: ``Padded`` where it is, with its
  sharding (other leaves of ``tree`` are returned as they are).

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar.data_parallel._padding import place, place_like
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> like = place({'b': jnp.ones(3)}, {'b': P('data')}, mesh=mesh)
    >>> place_like({'b': jnp.arange(3.)}, like)['b'].value
    Array([0., 1., 2., 0., 0., 0., 0., 0.], dtype=float32)
  """
  like_tree = jax.tree.structure(like, is_leaf=is_padded)
  refs = jax.tree.leaves(like, is_leaf=is_padded)
  return like_tree.unflatten(_move(like_tree.flatten_up_to(tree), [
      (r.value.shape, r.value.sharding) if is_padded(r) else None
      for r in refs]))


def _like(tree: PyTree, ref: PyTree) -> PyTree:
  """Logical ``tree`` padded where ``ref`` (same structure) is ``Padded``."""
  def one(r, x):
    if not is_padded(r):
      return x
    return Padded(jnp.pad(x, [(0, f - s) for s, f in
                              zip(r.shape, r.value.shape)]), r.shape)
  return jax.tree.map(one, ref, tree, is_leaf=is_padded)


def padded_optimizer(optimizer: optax.GradientTransformation,
                     specs: PyTree, *, mesh: Mesh
                     ) -> optax.GradientTransformation:
  """``optimizer`` on logical leaves, its state stored padded under ``specs``.

  ``init(params)`` and ``update(grads, state, params)`` accept ``Padded``
  nodes anywhere: ``optimizer`` gets them ``unpad``-ed (so padding never
  enters a norm, a mean, a factored moment or a trust ratio), and its
  results are padded back like its inputs (updates like ``params``, else
  like ``grads``; the state like ``state``, or under ``specs``, the
  optimizer state's specs, for ``init``). Padded entries stay zero. Extra
  arguments of ``update`` (``value=``) pass through.

  Example:
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar.data_parallel._padding import padded_optimizer
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> params = {'b': jnp.ones(3)}
    >>> state = jaxpar.TrainState.create(params, optax.adam(0.1))
    >>> specs = jaxpar.data_parallel.state_specs(state, zero_stage=1,
    ...     param_specs={'b': P()}, zero_specs={'b': P('data')})
    >>> opt = padded_optimizer(optax.adam(0.1), specs.opt_state, mesh=mesh)
    >>> opt.init(params)[0].mu['b'].value.shape
    (8,)
  """
  def init(params):
    return pad(optimizer.init(unpad(params)), specs, mesh=mesh)

  def update(updates, state, params=None, **extra_args):
    new, new_state = optax.with_extra_args_support(optimizer).update(
        unpad(updates), unpad(state), unpad(params), **extra_args)
    return (_like(new, updates if params is None else params),
            _like(new_state, state))
  return optax.GradientTransformationExtraArgs(init, update)
