"""ZeRO's spec arithmetic: which dim of each leaf the ``data`` axis splits.

Shapes and ``PartitionSpec``s in, ``PartitionSpec``s out; no array is
touched. ``data_spec`` adds the data axis to one leaf's spec, ``data_specs``
to a tree's, and ``state_specs`` lays out a whole ``TrainState`` for a ZeRO
stage. The package docstring (``jaxpar.data_parallel``) explains ZeRO.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar._validate import check_int
from jaxpar.data_parallel._padding import entry_axes, split_size
from jaxpar.mesh import axis_size
from jaxpar.train_state import TrainState
from jaxpar.train_state.internal import PyTree, replicated_specs

ZERO_STAGES = (0, 1, 3)


def check_zero_stage(zero_stage: Any) -> int:
  """``zero_stage`` as an int; ``TypeError``/``ValueError`` unless 0, 1 or 3.

  NumPy integers are accepted, ``True``/``False`` are not.

  Example:
    >>> import numpy as np
    >>> from jaxpar.data_parallel._specs import check_zero_stage
    >>> check_zero_stage(np.int64(3))
    3
  """
  fix = ('Choose 0 (no ZeRO), 1 (optimizer state split over the data axis) '
         'or 3 (params split too, FSDP).')
  zero_stage = check_int('zero_stage', zero_stage, minimum=0, fix=fix)
  if zero_stage not in ZERO_STAGES:
    raise ValueError(f'zero_stage={zero_stage!r}; {fix[0].lower()}{fix[1:]}')
  return zero_stage


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _normalized(entries: list) -> P:
  while entries and entries[-1] is None:
    entries = entries[:-1]
  return P(*entries)


def data_spec(shape: tuple[int, ...], spec: P = P(), *, mesh: Mesh,
              data_axis: str = 'data', skip: int = 0, pad: bool = False) -> P:
  """``spec`` with ``data_axis`` added to the dim ZeRO splits a leaf along.

  The dim is the largest one (from ``skip`` on) that no mesh axis splits yet
  and whose size divides by ``N = mesh.shape[data_axis]``; failing that, the
  largest split dim whose size divides by (its split) ``x N``, where
  ``data_axis`` goes after the axes already there; failing that, with
  ``pad``, the largest dim no mesh axis splits (stored padded to a multiple
  of ``N``: ``Padded``); else none: the leaf stays replicated over
  ``data_axis``.
  Ties go to the first dim. A zero-size leaf is never split.

  Args:
    shape: the leaf's global shape.
    spec: its ``PartitionSpec`` without ZeRO.
    mesh: the mesh; ``data_axis`` must be one of its axes.
    data_axis: the mesh axis ZeRO splits over.
    skip: leading dims never split (a pipeline stage leaf's ``[p, v]``).
    pad: split a leaf that no dim divides, padded.

  Example:
    >>> import jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh(data=2, tensor=4)
    >>> jaxpar.data_parallel.data_spec((8, 6), mesh=mesh)
    P('data',)
    >>> jaxpar.data_parallel.data_spec((8, 6), P(None, 'tensor'), mesh=mesh)
    P('data', 'tensor')
    >>> jaxpar.data_parallel.data_spec((3, 8), P(None, 'tensor'), mesh=mesh)
    P(None, ('tensor', 'data'))
    >>> (jaxpar.data_parallel.data_spec((3, 5), mesh=mesh),
    ...  jaxpar.data_parallel.data_spec((3, 5), mesh=mesh, pad=True))
    (P(), P(None, 'data'))
  """
  n = axis_size(mesh, data_axis)
  entries = list(spec) + [None] * (len(shape) - len(spec))
  if (n == 1 or math.prod(shape) == 0
      or any(data_axis in entry_axes(e) for e in entries)):
    return _normalized(entries)
  best = None
  for dim in range(skip, len(shape)):
    split = split_size(entries[dim], mesh.shape)
    if shape[dim] % (split * n) == 0:
      key = (entries[dim] is None, shape[dim] // split)
      if best is None or key > best[0]:
        best = (key, dim)
  if best is None and pad:
    free = [d for d in range(skip, len(shape)) if entries[d] is None]
    if free:
      best = (None, max(free, key=lambda d: (shape[d], -d)))
  if best is not None:
    dim = best[1]
    old = entry_axes(entries[dim])
    entries[dim] = (*old, data_axis) if old else data_axis
  return _normalized(entries)


def data_dim(spec: P, data_axis: str = 'data') -> int | None:
  """The dim of ``spec`` that ``data_axis`` splits, or ``None``.

  Example:
    >>> import jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> jaxpar.data_parallel.data_dim(P(None, ('tensor', 'data')))
    1
  """
  for dim, entry in enumerate(spec):
    if data_axis in entry_axes(entry):
      return dim
  return None


def data_specs(params: PyTree, specs: PyTree | None = None, *, mesh: Mesh,
               data_axis: str = 'data', skip: int = 0,
               pad: bool = False) -> PyTree:
  """``data_spec`` of every leaf of ``params`` (``specs``: default all ``P()``).

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> jaxpar.data_parallel.data_specs(
    ...     {'w': jnp.ones((16, 3)), 'b': jnp.ones(3)},
    ...     mesh=jaxpar.make_mesh(data=8))
    {'b': P(), 'w': P('data',)}
  """
  if specs is None:
    specs = jax.tree.map(lambda _: P(), params)
  return jax.tree.map(
      lambda x, s: data_spec(np.shape(x), s, mesh=mesh, data_axis=data_axis,
                             skip=skip, pad=pad), params, specs)


def _mirrors(params: PyTree) -> Callable[[Any], bool]:
  """Is a node a params-shaped subtree (``params``' structure and shapes)?

  ``optax.MaskedNode`` may stand for any leaf (``optax.masked`` and
  ``optax.multi_transform`` states).
  """
  leaves, treedef = jax.tree.flatten(params)
  shapes = [np.shape(x) for x in leaves]

  def mirrors(node) -> bool:
    node_leaves, node_def = jax.tree.flatten(node, is_leaf=_is_masked)
    return node_def == treedef and all(
        _is_masked(x) or np.shape(x) == s for x, s in zip(node_leaves, shapes))
  return mirrors


def _masked_like(node: PyTree, specs: PyTree) -> PyTree:
  """``specs``, with ``MaskedNode`` where ``node`` (params-shaped) has one."""
  return jax.tree.map(lambda x, s: x if _is_masked(x) else s, node, specs,
                      is_leaf=_is_masked)


def state_specs(state: TrainState, *, zero_stage: int, param_specs: PyTree,
                zero_specs: PyTree) -> TrainState:
  """``PartitionSpec``s of a ``TrainState`` in ``zero_stage``'s layout.

  Args:
    state: a ``TrainState`` (arrays or ``jax.ShapeDtypeStruct``s).
    zero_stage: 0, 1 or 3.
    param_specs: the params' specs without ZeRO (``P()`` for pure DP).
    zero_specs: the same with the data axis added (``data_specs``).

  Returns:
    a ``TrainState`` of specs: ``step`` replicated; ``params``
    ``zero_specs`` for stage 3, else ``param_specs``; every params-shaped
    subtree of ``opt_state`` ``zero_specs`` for stages 1 and 3, else
    ``param_specs`` (``optax.MaskedNode`` kept where the state has one);
    other optimizer leaves (counts, Adafactor's factored moments) and
    ``model_state`` replicated. ``state`` holds logical shapes (``Padded``
    leaves at their ``shape``).

  Example:
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> params = {'w': jnp.ones((16, 3))}
    >>> state = jaxpar.TrainState.create(params, optax.adam(0.1))
    >>> specs = jaxpar.data_parallel.state_specs(
    ...     state, zero_stage=1, param_specs={'w': P()},
    ...     zero_specs=jaxpar.data_parallel.data_specs(params, mesh=mesh))
    >>> specs.params['w'], specs.opt_state[0].mu['w'], specs.opt_state[0].count
    (P(), P('data',), P())
  """
  mirrors = _mirrors(state.params)
  opt = zero_specs if zero_stage else param_specs
  opt_state = jax.tree.map(
      lambda node: _masked_like(node, opt) if mirrors(node)
      else jax.tree.map(lambda _: P(), node), state.opt_state, is_leaf=mirrors)
  return TrainState(P(), zero_specs if zero_stage == 3 else param_specs,
                    opt_state, replicated_specs(state.model_state))
