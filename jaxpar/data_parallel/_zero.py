"""ZeRO: optimizer state (``zero_stage=1``) and params (``3``) split over ``data``.

Plain data parallelism keeps the params and the optimizer state on every
device: for Adam in float32 that is 16 bytes per parameter on each of the
``N`` devices. ZeRO (Rajbhandari et al., 2020) keeps ``1/N`` of them per
device instead, with the same maths.

**Layout = shardings, plus padding.** A ZeRO state is an ordinary
``TrainState`` of global ``jax.Array``s; their ``NamedSharding`` says what
is split. ``data_spec`` adds the ``data`` axis to one dim of each leaf's
``PartitionSpec`` (on top of any tensor/stage split): the largest dim not yet
split whose size divides by ``N``, else the largest split one that still
divides. With ``pad=True`` (what ``data_parallel.trainer`` uses) a leaf that no
dim divides is split too, along its largest unsplit dim, which is stored
zero-padded up to a multiple of ``N`` (as torch FSDP and DeepSpeed do): the
leaf is then a ``Padded(value, shape)`` node, ``value`` the padded array and
``shape`` the logical one. Each device holds ``ceil(d/N)`` rows of it, at
most one row more than ``1/N``. Users see logical shapes: the optimizer
runs on the unpadded leaves (``padded_optimizer``, so padding never enters
a norm, a mean or a factored moment), and ``Trainer.params``,
``gather_params``, ``unshard_state`` and ``jaxpar.checkpoint`` give logical
arrays. So a ZeRO state saves and restores onto any mesh, any data size and
any ``zero_stage``. A zero-size leaf is never split (it holds no bytes).
The 3D step (``jaxpar.parallel``) does not pad yet: there a leaf that no
dim divides stays replicated over ``data``.

* ``zero_stage=1``: the params-shaped subtrees of ``opt_state`` (Adam's
  ``mu`` and ``nu``, momentum traces, ``MultiSteps``' accumulator: subtrees
  with the structure and leaf shapes of ``params``, where ``optax.masked``
  and ``optax.multi_transform`` may hold ``optax.MaskedNode`` for the leaves
  they skip) get ``data_spec``; params and every other leaf stay as they
  are.
* ``zero_stage=3``: the params too.

**One step**, the building blocks below inside ``jax.shard_map``, then the
update on global arrays (``jaxpar.train_state.sharded_update``)::

  stage 1: g_d = grad(loss)(params, batch_d)            full, local batch
           g   = psum_scatter(g_d, data, dim) / N       my 1/N of the mean
  stage 3: g   = grad(loss o all_gather)(p_d, batch_d) / N   (the gather's
                                                        transpose scatters)
  then, on global arrays under jit:
           params, opt = optimizer.update(g, opt, params)  XLA partitions it:
           norms and trust ratios get their all-reduce, elementwise maths
           runs on each device's 1/N; stage 1 all-gathers the new params.

Because the update sees global arrays, *every* optax transform is exact in
every stage -- clipping, ``lamb``, ``lars``, ``adafactor``, ``muon``,
``MultiSteps``, ``inject_hyperparams`` -- and communication stays at ZeRO's
bytes (``P`` = params bytes): stage 1 reduce-scatters ``P`` and all-gathers
``P`` (one all-reduce's worth); stage 3 all-gathers ``P`` per microbatch in
the forward pass (and again in the backward, where XLA does not reuse it)
and reduce-scatters ``P``; the norms add a few scalars.

**Stage 3 gathering.** ``gathered`` all-gathers each leaf just before the
function that uses it and wraps gather + function in ``jax.checkpoint`` with
the ``dots_saveable`` policy: matmul outputs are kept for the backward pass,
the gathered params are not (they are re-gathered), so only the ``1/N``
slices stay alive between forward and backward.

Example:
  >>> mesh = jaxpar.make_mesh(data=8)
  >>> params = {'w': jnp.ones((16, 3)), 'b': jnp.zeros(3)}
  >>> state = jaxpar.TrainState.create(params, optax.adam(0.1))
  >>> state = jaxpar.data_parallel.shard_state(state, mesh=mesh, zero_stage=3)
  >>> state.params['w'].sharding.spec, state.params['w'].sharding.shard_shape(
  ...     (16, 3))
  (P('data',), (2, 3))

  No dim of ``b`` divides by 8: it is stored padded from 3 to 8 entries.

  >>> b = state.params['b']
  >>> b.shape, b.value.shape, b.value.sharding.spec
  ((3,), (8,), P('data',))

  On ``data=6`` no dim of ``w`` divides either: it is padded to 18 rows.

  >>> mesh6 = jaxpar.make_mesh(data=6, devices=jax.devices()[:6])
  >>> state6 = jaxpar.data_parallel.shard_state(state, mesh=mesh6, zero_stage=3)
  >>> w = state6.params['w']
  >>> w.shape, w.value.shape, w.value.addressable_shards[0].data.shape
  ((16, 3), (18, 3), (3, 3))
  >>> jaxpar.data_parallel.gather_params(state6)['w'].shape
  (16, 3)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.mesh import axis_size
# Padded, pad, unpad, unpadded, place, ... are part of jaxpar.zero's API too.
from jaxpar.data_parallel._padding import (Padded, entry_axes, is_padded, logical_shapes,
                            pad, padded_optimizer, padded_shape, place,
                            place_like, split_size, unpad, unpadded)
from jaxpar.tensor_parallel import unshard_params
from jaxpar.train_state import PyTree, TrainState

ZERO_STAGES = (0, 1, 3)


def check_zero_stage(zero_stage: Any) -> int:
  """``zero_stage`` as an int; ``TypeError``/``ValueError`` unless 0, 1 or 3.

  NumPy integers are accepted, ``True``/``False`` are not.

  Example:
    >>> jaxpar.data_parallel.check_zero_stage(np.int64(3))
    3
  """
  if isinstance(zero_stage, (bool, np.bool_)) or not isinstance(
      zero_stage, (int, np.integer)):
    raise TypeError(f'zero_stage must be an int (0, 1 or 3), got '
                    f'{type(zero_stage).__name__}: {zero_stage!r}.')
  if int(zero_stage) not in ZERO_STAGES:
    raise ValueError(
        f'zero_stage={zero_stage!r}; choose 0 (no ZeRO), 1 (optimizer state '
        'split over the data axis) or 3 (params split too, FSDP).')
  return int(zero_stage)


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _normalized(entries: list) -> P:
  while entries and entries[-1] is None:
    entries = entries[:-1]
  return P(*entries)


def data_spec(shape: tuple[int, ...], spec: P = P(), *, mesh: Mesh,
              axis: str = 'data', skip: int = 0, pad: bool = False) -> P:
  """``spec`` with ``axis`` added to the dim ZeRO splits a leaf along.

  The dim is the largest one (from ``skip`` on) that no mesh axis splits yet
  and whose size divides by ``N = mesh.shape[axis]``; failing that, the
  largest split dim whose size divides by (its split) ``x N``, where
  ``axis`` goes after the axes already there; failing that, with ``pad``,
  the largest dim no mesh axis splits (stored padded to a multiple of ``N``:
  ``padded_shape``); else none: the leaf stays replicated over ``axis``.
  Ties go to the first dim. A zero-size leaf is never split.

  Args:
    shape: the leaf's global shape.
    spec: its ``PartitionSpec`` without ZeRO.
    mesh: the mesh; ``axis`` must be one of its axes.
    axis: the data axis.
    skip: leading dims never split (a pipeline stage leaf's ``[p, v]``).
    pad: split a leaf that no dim divides, padded.

  Example:
    >>> mesh = jaxpar.make_mesh(data=2, tensor=4)
    >>> jaxpar.data_parallel.data_spec((8, 6), mesh=mesh)
    P('data',)
    >>> jaxpar.data_parallel.data_spec((8, 6), P(None, 'tensor'), mesh=mesh)
    P('data', 'tensor')
    >>> jaxpar.data_parallel.data_spec((3, 8), P(None, 'tensor'), mesh=mesh)
    P(None, ('tensor', 'data'))
    >>> jaxpar.data_parallel.data_spec((3, 5), mesh=mesh), jaxpar.data_parallel.data_spec(
    ...     (3, 5), mesh=mesh, pad=True)
    (P(), P(None, 'data'))
  """
  n = axis_size(mesh, axis)
  entries = list(spec) + [None] * (len(shape) - len(spec))
  if (n == 1 or math.prod(shape) == 0
      or any(axis in entry_axes(e) for e in entries)):
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
    entries[dim] = (*old, axis) if old else axis
  return _normalized(entries)


def data_dim(spec: P, axis: str = 'data') -> int | None:
  """The dim of ``spec`` that ``axis`` splits, or ``None``.

  Example:
    >>> jaxpar.data_parallel.data_dim(P(None, ('tensor', 'data')))
    1
  """
  for dim, entry in enumerate(spec):
    if axis in entry_axes(entry):
      return dim
  return None


def data_specs(params: PyTree, specs: PyTree | None = None, *, mesh: Mesh,
               axis: str = 'data', skip: int = 0, pad: bool = False) -> PyTree:
  """``data_spec`` of every leaf of ``params`` (``specs``: default all ``P()``).

  Example:
    >>> jaxpar.data_parallel.data_specs({'w': jnp.ones((16, 3)), 'b': jnp.ones(3)},
    ...                        mesh=jaxpar.make_mesh(data=8))
    {'b': P(), 'w': P('data',)}
  """
  if specs is None:
    specs = jax.tree.map(lambda _: P(), params)
  return jax.tree.map(
      lambda x, s: data_spec(np.shape(x), s, mesh=mesh, axis=axis, skip=skip,
                             pad=pad), params, specs)


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
    other optimizer leaves (counts, Adafactor's factored moments)
    replicated. ``state`` holds logical shapes (``logical_shapes``).

  Example:
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
                    opt_state)


def shard_state(state: TrainState, *, mesh: Mesh, axis: str = 'data',
                zero_stage: int | None = None,
                stage: int | None = None) -> TrainState:
  """``state`` placed on ``mesh`` in the ZeRO layout of ``zero_stage``.

  The state ``jaxpar.data_parallel.trainer(..., zero_stage=zero_stage).step``
  keeps (the step also places any state itself; this is for looking at the
  layout, or placing once ahead of time). Works on any state: plain, or in
  another stage's or mesh's layout.

  Args:
    state: a ``TrainState`` (e.g. from ``TrainState.create``).
    mesh: the mesh the step runs on.
    axis: the mesh axis to split over, size ``N``.
    zero_stage: 0, 1 or 3 (default 1).
    stage: the old name of ``zero_stage``.

  Returns:
    the ``TrainState`` sharded as ``state_specs`` says (``pad=True``): each
    device holds ``1/N`` of every split leaf
    (``x.sharding.shard_shape(x.shape)``), or ``ceil(d/N)`` of the ``d``
    rows of a ``Padded`` one.

  Example:
    >>> state = jaxpar.TrainState.create({'w': jnp.ones((16, 3))},
    ...                                  optax.adam(0.1))
    >>> state = jaxpar.data_parallel.shard_state(state, mesh=jaxpar.make_mesh(data=8),
    ...                                 zero_stage=1)
    >>> mu = state.opt_state[0].mu['w']
    >>> mu.shape, mu.sharding.shard_shape(mu.shape)
    ((16, 3), (2, 3))
  """
  _check_train_state(state, 'zero.shard_state')
  if stage is not None and zero_stage is not None:
    raise TypeError('pass zero_stage= only (stage= is its old name).')
  zero_stage = check_zero_stage(1 if zero_stage is None and stage is None
                                else stage if zero_stage is None
                                else zero_stage)
  logical = logical_shapes(state)
  base = jax.tree.map(lambda _: P(), logical.params)
  specs = state_specs(logical, zero_stage=zero_stage, param_specs=base,
                      zero_specs=data_specs(logical.params, mesh=mesh,
                                            axis=axis, pad=True))
  return place(state, specs, mesh=mesh)


def _check_train_state(state: Any, fn: str) -> None:
  if not isinstance(state, TrainState):
    raise TypeError(f'{fn} needs a jaxpar.TrainState (see TrainState.create), '
                    f'got {type(state).__name__}.')


def unshard_state(state: TrainState) -> TrainState:
  """``state`` replicated over its mesh: the layout of ``zero_stage=0``.

  Example:
    >>> state = jaxpar.TrainState.create({'w': jnp.ones((16, 3))},
    ...                                  optax.adam(0.1))
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> plain = jaxpar.data_parallel.unshard_state(
    ...     jaxpar.data_parallel.shard_state(state, mesh=mesh, zero_stage=3))
    >>> plain.params['w'].sharding.spec
    P()
  """
  _check_train_state(state, 'zero.unshard_state')
  return unshard_params(unpadded(state))


def gather_params(state: TrainState) -> PyTree:
  """The params of a ``TrainState`` replicated on every device of its mesh.

  ``unpadded(state.params)`` keeps them sharded (but for ``Padded`` leaves),
  which is what evaluation should use for a model too big for one device;
  this is for small models and tests.

  Example:
    >>> state = jaxpar.data_parallel.shard_state(
    ...     jaxpar.TrainState.create({'w': jnp.ones((16, 3))}, optax.sgd(0.1)),
    ...     mesh=jaxpar.make_mesh(data=8), zero_stage=3)
    >>> jaxpar.data_parallel.gather_params(state)['w'].sharding.spec
    P()
  """
  _check_train_state(state, 'zero.gather_params')
  return unshard_params(unpadded(state.params))


class StateBytes(NamedTuple):
  """Bytes one device holds of a state: the max over devices of each part.

  Attributes:
    params: of ``state.params``.
    opt_state: of ``state.opt_state`` (with ``step``).
  """
  params: int
  opt_state: int


def _max_device_bytes(tree: PyTree) -> int:
  held: dict[Any, int] = {}
  for x in jax.tree.leaves(tree):
    for shard in getattr(x, 'addressable_shards', ()):
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return max(held.values(), default=0)


def bytes_per_device(state: TrainState) -> StateBytes:
  """Bytes of ``state``'s params and optimizer state on the fullest device.

  Read from the arrays' addressable shards (``Padded`` leaves with their
  padding; host numpy leaves count 0). Plain DP holds everything on every
  device; ZeRO-1 ``~1/N`` of the optimizer state, ZeRO-3 of the params too.

  Example:
    >>> state = jaxpar.TrainState.create({'w': jnp.ones((16, 3))},
    ...                                  optax.adam(0.1))
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> jaxpar.data_parallel.bytes_per_device(
    ...     jaxpar.data_parallel.shard_state(state, mesh=mesh, zero_stage=1))
    StateBytes(params=192, opt_state=56)
  """
  _check_train_state(state, 'zero.bytes_per_device')
  return StateBytes(_max_device_bytes(state.params),
                    _max_device_bytes((state.step, state.opt_state)))


# -- Inside shard_map: the building blocks of a ZeRO step ------------------


def vary(params: PyTree, specs: PyTree, *, axis: str) -> PyTree:
  """Leaves not split over ``axis`` made varying over it (``lax.pcast``).

  Inside ``shard_map``: then ``jax.grad`` gives each device its own gradient
  instead of summing over ``axis`` (see ``reduce_gradients``). ``Padded``
  leaves are always split.
  """
  return jax.tree.map(
      lambda s, x: x if data_dim(s, axis) is not None
      else jax.lax.pcast(x, axis, to='varying'), specs, params,
      is_leaf=_is_spec)


def gather(params: PyTree, specs: PyTree, *, axis: str,
           skip: int = 0) -> PyTree:
  """Full leaves from every device's slice: ``all_gather`` along the data dim.

  Inside ``shard_map``. ``specs`` are the leaves' global specs; ``skip``
  leading dims of the global leaf are not in ``params`` (a stage's slice of
  ``[p, v, ...]`` stage leaves: ``skip=2``). A ``Padded`` leaf is cut to its
  logical size after the gather (the cut's transpose pads the gradient with
  zeros). The result is typed varying, so its transpose is a reduce-scatter
  (a sum over ``axis``).
  """
  def one(spec, x):
    dim = data_dim(spec, axis)
    if dim is None:
      return x
    value = x.value if is_padded(x) else x
    full = jax.lax.all_gather(value, axis, axis=dim - skip, tiled=True,
                              to='varying')
    if is_padded(x):
      full = jax.lax.slice_in_dim(full, 0, x.shape[dim], axis=dim - skip)
    return full
  return jax.tree.map(one, specs, params, is_leaf=_is_spec)


def gathered(fn: Callable[..., Any], specs: PyTree, *, axis: str,
             skip: int = 0) -> Callable[..., Any]:
  """``fn(params, *args)`` on ZeRO-3 slices, gathering the params just in time.

  ``g(slices, *args) = fn(gather(slices), *args)`` under
  ``jax.checkpoint(policy=dots_saveable)``: the backward pass re-gathers
  instead of keeping the gathered params. The gradient w.r.t. ``slices`` is
  this device's slice of the gradient *summed* over ``axis`` (``Padded``
  where the slices are, with zero padding).
  """
  def fn_of_slices(params, *args):
    return fn(gather(params, specs, axis=axis, skip=skip), *args)
  return jax.checkpoint(fn_of_slices,
                        policy=jax.checkpoint_policies.dots_saveable)


def reduce_gradients(grads: PyTree, specs: PyTree, *, axis: str,
                     summed: bool = False) -> PyTree:
  """Mean over ``axis`` of per-device gradients, in the layout of ``specs``.

  Inside ``shard_map`` over ``axis`` (size ``N``). A leaf whose spec splits
  a dim over ``axis`` is reduce-scattered along it (``psum_scatter / N``),
  zero-padded first to a multiple of ``N`` when it does not divide (giving a
  ``Padded`` slice); with ``summed=True`` (ZeRO-3 gradients of ``gathered``:
  already summed and scattered) it is only divided by ``N``. All other
  leaves are averaged with one ``pmean``.
  """
  n = jax.lax.axis_size(axis)
  spec_leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
  leaves = treedef.flatten_up_to(grads)
  dims = [data_dim(s, axis) for s in spec_leaves]
  means = iter(jax.lax.pmean([g for g, d in zip(leaves, dims) if d is None],
                             axis))
  out = []
  for g, spec, dim in zip(leaves, spec_leaves, dims):
    if dim is None:
      out.append(next(means))
    elif summed:
      out.append(jax.tree.map(lambda v: v / n, g))
    else:
      out.append(_scatter(g, spec, dim, axis=axis, n=n))
  return treedef.unflatten(out)


def _scatter(g: jax.Array, spec: P, dim: int, *, axis: str, n: int) -> Any:
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
  value = jax.lax.psum_scatter(value, axis, scatter_dimension=dim,
                               tiled=True) / n
  if not short:
    return value
  entries = list(spec) + [None] * (g.ndim - len(spec))
  shape = tuple(s * math.prod(jax.lax.axis_size(a) for a in entry_axes(e)
                              if a != axis) for s, e in zip(g.shape, entries))
  return Padded(value, shape)
