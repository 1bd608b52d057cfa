"""ZeRO: optimizer state (stage 1) and params (stage 3) sharded over ``data``.

Plain data parallelism keeps the params and the optimizer state on every
device: for Adam in float32 that is 16 bytes per parameter on each of the
``N`` devices. ZeRO (Rajbhandari et al., 2020) keeps ``1/N`` of them per
device instead, with the same maths.

**Layout.** Every sharded leaf of shape ``s`` (``size = prod(s)``) becomes a
``FlatLeaf``: the leaf raveled and zero-padded to ``L = N * c`` elements,
``c = max(1, ceil(size / N))``, stored as one global ``[L]`` array sharded
``P(axis)``: device ``d`` holds elements ``[d*c, (d+1)*c)``. The original shape
is static pytree metadata, so a ZeRO state is still an ordinary
``TrainState`` pytree (jit, ``device_put``, orbax checkpoints), and
``x.sharding`` says what is sharded.

* stage 1: ``params`` stay replicated; every params-shaped subtree of
  ``opt_state`` (Adam's ``mu`` and ``nu``, momentum traces...) is flat and
  sharded; scalars (Adam's ``count``) stay replicated.
* stage 3: ``params`` are flat and sharded too.

**One step** (``data_parallel_step(..., zero_stage=1|3)``), per device::

  stage 1: g_d = grad(loss_fn)(params, batch_d)           full, local batch
           g   = reduce_scatter(pad(g_d)) / N             my 1/N slice of mean
           |g| = sqrt(psum(sum(g**2)))                    global, unclipped
           p, opt = optimizer.update(clip(g), opt, my slice of params)
           params = all_gather(p)[:size].reshape(s)       replicated again
  stage 3: params_full = all_gather(p)[:size].reshape(s)  inside the loss,
           g = grad(loss_fn o gather)(p, batch_d) / N     transpose of the
                                                          gather: reduce-scatter
           |g|, update as stage 1 on the slice; no final gather.

Communication per step (whole buffers, ``P`` = padded params bytes): DP
all-reduces ``P``; stage 1 reduce-scatters ``P`` and all-gathers ``P`` (the
same ring traffic as one all-reduce); stage 3 all-gathers ``P`` in the forward
and again in the backward pass and reduce-scatters ``P``, per microbatch.

**Stage 3 gathering.** ``gathered_loss`` all-gathers each leaf (one
all-gather per leaf, all of them issued before ``loss_fn`` runs; XLA schedules
them) and wraps gather + ``loss_fn`` in ``jax.checkpoint`` with the
``dots_saveable`` policy: matmul outputs are kept for the backward pass,
everything else -- in particular the gathered params -- is recomputed, so the
backward pass re-gathers each leaf instead of keeping the gathered copy. (A
matmul of two params, e.g. ``w1 @ w2``, is a matmul output and is kept.)
jaxpar does not know the model's layers, so gathering is per leaf, not per
layer. ``jax.ad_checkpoint.print_saved_residuals`` shows that only the
slices are kept; XLA:CPU, however, removes ``jax.checkpoint``'s barriers and
reuses the forward gather (its HLO has one all-gather per leaf).

**Optimizers.** Any optax optimizer whose update is elementwise (``sgd``,
momentum, ``adam``, ``adamw``, ``lion``, ...) works exactly on flat padded
slices. Transforms that look at whole leaves (``adafactor``'s factored
moments, per-leaf norms as in LARS/LAMB, ``optax.clip_by_global_norm``, which
would see only the local slice) are not supported: pass ``max_grad_norm`` to
the step for clipping, which jaxpar computes over all shards. The padding
never leaks: its gradient is exactly zero (the gather drops it), so for these
optimizers its params and moments stay zero (weight decay of zero is zero),
and ``gather_params`` drops it anyway.

**Building blocks** (inside ``jax.shard_map`` over ``axis``, for composed
train steps): ``local_slice``, ``all_gather``, ``gathered_loss``,
``reduce_gradients``, ``global_norm``, ``apply_gradients``. Outside:
``shard_state``, ``unshard_state``, ``gather_params``, ``state_specs``,
``logical_shapes``, ``check_state``.

Example:
  >>> mesh = jaxpar.make_mesh(data=8)
  >>> state = jaxpar.TrainState.create(params, optax.adam(1e-3))
  >>> state = jaxpar.zero.shard_state(state, mesh=mesh, stage=3)
  >>> step = jaxpar.data_parallel_step(loss_fn, optax.adam(1e-3), mesh=mesh,
  ...                                  zero_stage=3)
  >>> state, stats = step(state, batch)
  >>> params = jaxpar.zero.gather_params(state)   # original shapes
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import train_state
from jaxpar.mesh import axis_size
from jaxpar.train_state import PyTree, TrainState

STAGES = (1, 3)


@dataclasses.dataclass(frozen=True)
class FlatLeaf:
  """One pytree leaf raveled and zero-padded to a multiple of ``N`` elements.

  Attributes:
    flat: ``[N * c]`` array, ``c = max(1, ceil(size / N))``: the leaf's
      elements in row-major order, then zeros. Outside ``shard_map`` it is the
      global array sharded ``P(axis)``; inside, a device's ``[c]`` slice.
    shape: the original leaf shape (static pytree metadata).

  Example:
    >>> leaf = state.params['w']              # a stage-3 state on data=8
    >>> leaf.shape, leaf.flat.shape, leaf.flat.sharding.spec
    ((5, 7), (40,), PartitionSpec('data',))
  """
  flat: jax.Array
  shape: tuple[int, ...]

  @property
  def size(self) -> int:
    """Number of real (unpadded) elements, ``prod(shape)``."""
    return math.prod(self.shape)


jax.tree_util.register_dataclass(FlatLeaf, data_fields=['flat'],
                                 meta_fields=['shape'])


def _is_flat(x: Any) -> bool:
  return isinstance(x, FlatLeaf)


def _flat_leaves(tree: PyTree) -> list[FlatLeaf]:
  return [x for x in jax.tree.leaves(tree, is_leaf=_is_flat) if _is_flat(x)]


def padded_size(size: int, n: int) -> int:
  """``N * max(1, ceil(size / N))``: a leaf's flat length, sharded ``N`` ways.

  Example:
    >>> jaxpar.zero.padded_size(35, 8)
    40
  """
  return n * max(1, -(-size // n))


def _pad_flat(x: jax.Array, n: int) -> jax.Array:
  flat = jnp.ravel(x)
  return jnp.pad(flat, (0, padded_size(flat.size, n) - flat.size))


def _unpad(flat: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  return flat[:math.prod(shape)].reshape(shape)


def _mirrors(params: PyTree) -> Callable[[Any], bool]:
  """Is a node a params-shaped subtree (``params``' structure and shapes)?"""
  leaves, treedef = jax.tree.flatten(params)
  shapes = [np.shape(x) for x in leaves]

  def mirrors(node) -> bool:
    node_leaves, node_def = jax.tree.flatten(node)
    return node_def == treedef and [np.shape(x) for x in node_leaves] == shapes
  return mirrors


# -- Outside shard_map: converting states ----------------------------------


def state_specs(state: PyTree, *, axis: str = 'data') -> PyTree:
  """``PartitionSpec`` tree of a (ZeRO or plain) state: what is sharded.

  Returns:
    ``state`` with every ``FlatLeaf``'s ``flat`` replaced by ``P(axis)`` and
    every other leaf by ``P()`` (replicated); usable as ``shard_map``
    ``in_specs``/``out_specs`` and, mapped to ``NamedSharding``, for
    ``jax.device_put``.

  Example:
    >>> specs = jaxpar.zero.state_specs(state)        # a stage-3 state
    >>> specs.params['w'].flat, specs.step
    (PartitionSpec('data',), PartitionSpec())
  """
  return jax.tree.map(
      lambda x: FlatLeaf(P(axis), x.shape) if _is_flat(x) else P(), state,
      is_leaf=_is_flat)


def logical_shapes(tree: PyTree) -> PyTree:
  """``jax.ShapeDtypeStruct`` of every leaf; ``FlatLeaf``s at their own shape.

  Example:
    >>> jaxpar.zero.logical_shapes(state.params)['w']   # a stage-3 state
    ShapeDtypeStruct(shape=(5, 7), dtype=float32)
  """
  def one(x):
    if _is_flat(x):
      return jax.ShapeDtypeStruct(x.shape, x.flat.dtype)
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
  return jax.tree.map(one, tree, is_leaf=_is_flat)


def _check_train_state(state: Any, fn: str) -> None:
  if not isinstance(state, TrainState):
    raise TypeError(f'{fn} needs a jaxpar.TrainState (see TrainState.create), '
                    f'got {type(state).__name__}.')


def shard_state(state: TrainState, *, mesh: Mesh, axis: str = 'data',
                stage: int = 1) -> TrainState:
  """A plain ``TrainState`` in the ZeRO layout of ``stage``, placed on ``mesh``.

  The state to pass to ``data_parallel_step(..., zero_stage=stage)``. The
  params-shaped subtrees of ``opt_state`` (same tree structure and leaf shapes
  as ``params``) and, for stage 3, ``params`` become ``FlatLeaf``s sharded
  ``P(axis)``; every other leaf is replicated.

  Args:
    state: a plain (unsharded) ``TrainState``, e.g. from
      ``TrainState.create`` or ``unshard_state``; float params.
    mesh: the mesh the step runs on.
    axis: the mesh axis to shard over, size ``N``.
    stage: 1 (optimizer state sharded) or 3 (params sharded too).

  Returns:
    the sharded ``TrainState``; each device holds ``c = ceil(size / N)``
    elements of every sharded leaf (``x.sharding.shard_shape(x.shape) ==
    (c,)``).

  Example:
    >>> state = jaxpar.TrainState.create({'w': jnp.ones((5, 7))},
    ...                                  optax.adam(0.1))
    >>> state = jaxpar.zero.shard_state(state, mesh=jaxpar.make_mesh(data=8),
    ...                                 stage=3)
    >>> state.params['w'].flat.shape, state.params['w'].shape
    ((40,), (5, 7))
  """
  _check_train_state(state, 'zero.shard_state')
  n = axis_size(mesh, axis)
  if stage not in STAGES:
    raise ValueError(f'stage={stage!r}; ZeRO stages are {STAGES} (stage 0 is '
                     'the plain replicated state: no sharding needed).')
  if _flat_leaves(state):
    raise ValueError(
        'state is already ZeRO-sharded (it holds FlatLeaf arrays); to change '
        'the stage or the mesh, shard_state(unshard_state(state), ...).')
  for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise TypeError(
          f'params leaf {jax.tree_util.keystr(path)} has dtype '
          f'{jnp.result_type(leaf)}; ZeRO shards trainable float params only.')
  mirrors_params = _mirrors(state.params)

  def flatten(tree):
    return jax.tree.map(
        lambda x: FlatLeaf(_pad_flat(jnp.asarray(x), n), np.shape(x)), tree)

  opt_state = jax.tree.map(
      lambda x: flatten(x) if mirrors_params(x) else x, state.opt_state,
      is_leaf=mirrors_params)
  params = flatten(state.params) if stage == 3 else state.params
  sharded = TrainState(state.step, params, opt_state)
  return jax.device_put(sharded, jax.tree.map(
      lambda s: NamedSharding(mesh, s), state_specs(sharded, axis=axis)))


def _unshard(tree: PyTree) -> PyTree:
  def one(x):
    if not _is_flat(x):
      return x
    flat = x.flat
    if isinstance(flat.sharding, NamedSharding):  # replicate, then drop padding
      flat = jax.device_put(flat, NamedSharding(flat.sharding.mesh, P()))
    return _unpad(flat, x.shape)
  return jax.tree.map(one, tree, is_leaf=_is_flat)


def unshard_state(state: TrainState) -> TrainState:
  """The plain ``TrainState`` of a ZeRO state: original shapes, padding dropped.

  Inverse of ``shard_state`` (exactly: the padding is only dropped); the
  result equals what zero-stage-0 training would hold, replicated on the mesh.
  Use it to re-shard for another mesh or stage, or to train without ZeRO.

  Example:
    >>> plain = jaxpar.zero.unshard_state(state)
    >>> state = jaxpar.zero.shard_state(plain, mesh=mesh4, stage=1)
  """
  _check_train_state(state, 'zero.unshard_state')
  return _unshard(state)


def gather_params(state: TrainState) -> PyTree:
  """The params of a (ZeRO or plain) ``TrainState`` at their original shapes.

  Example:
    >>> loss = loss_fn(jaxpar.zero.gather_params(state), batch)
  """
  _check_train_state(state, 'zero.gather_params')
  return _unshard(state.params)


def check_state(state: TrainState, optimizer: optax.GradientTransformation, *,
                stage: int, mesh: Mesh, axis: str = 'data') -> None:
  """``ValueError`` unless ``state`` has ``stage``'s ZeRO layout for ``mesh``.

  Stage 0 (no ZeRO) accepts only plain states. For stages 1 and 3 the flat
  lengths must fit ``N = mesh.shape[axis]`` and ``opt_state`` must have the
  structure and shapes of ``optimizer.init`` of the flattened params (which
  also rejects optimizers that are not elementwise, e.g. ``adafactor``).
  Abstract evaluation only (``jax.eval_shape``); ``data_parallel_step`` calls
  it before compiling.

  Example:
    >>> jaxpar.zero.check_state(state, optax.adam(1e-3), stage=3, mesh=mesh)
  """
  fix = f'jaxpar.zero.shard_state(state, mesh=mesh, stage={stage})'
  flat = _flat_leaves(state)
  if stage == 0:
    if flat:
      raise ValueError(
          'state is ZeRO-sharded (it holds FlatLeaf arrays) but zero_stage=0; '
          'pass the zero_stage it was sharded for, or '
          'jaxpar.zero.unshard_state(state).')
    return
  n = axis_size(mesh, axis)
  params_flat = _flat_leaves(state.params)
  num_params = len(jax.tree.leaves(state.params, is_leaf=_is_flat))
  if stage == 3 and len(params_flat) != num_params:
    raise ValueError(
        f'zero_stage=3 needs params sharded by zero.shard_state(..., stage=3), '
        f'but {num_params - len(params_flat)} of {num_params} params leaves '
        f'are plain arrays; call {fix}.')
  if stage == 1 and params_flat:
    raise ValueError(
        'zero_stage=1 needs replicated params, but state.params are sharded '
        '(a stage-3 state); use zero_stage=3, or shard_state(unshard_state('
        'state), mesh=mesh, stage=1).')
  for leaf in flat:
    length = leaf.flat.shape[0] if np.ndim(leaf.flat) == 1 else None
    if length != padded_size(leaf.size, n):
      raise ValueError(
          f'state holds a FlatLeaf of shape {leaf.shape} with flat shape '
          f'{np.shape(leaf.flat)}, but {axis} size {n} needs '
          f'({padded_size(leaf.size, n)},): it was sharded for another mesh. '
          'Re-shard: zero.shard_state(zero.unshard_state(state), mesh=mesh, '
          f'stage={stage}).')
  abstract = jax.tree.map(
      lambda x: FlatLeaf(jax.ShapeDtypeStruct(
          (padded_size(math.prod(x.shape), n),), x.dtype), x.shape),
      logical_shapes(state.params))
  want = jax.eval_shape(optimizer.init, abstract)
  shapes = lambda tree: (jax.tree.structure(tree),
                         [np.shape(x) for x in jax.tree.leaves(tree)])
  if shapes(want) != shapes(state.opt_state):
    mirrors = _mirrors(logical_shapes(state.params))
    if any(map(mirrors, jax.tree.leaves(state.opt_state, is_leaf=mirrors))):
      raise ValueError(f'zero_stage={stage} needs the optimizer state sharded '
                       '(state.opt_state holds unsharded params-shaped '
                       f'subtrees); call {fix}.')
    raise ValueError(
        f'state.opt_state does not match optimizer.init of the flattened '
        f'params (got {jax.tree.structure(state.opt_state)}, want '
        f'{jax.tree.structure(want)}). Create the state with this optimizer; '
        'ZeRO supports elementwise optimizers only (sgd, adam, adamw, ...; '
        'not e.g. adafactor).')


# -- Inside shard_map: the building blocks of a ZeRO step ------------------


def local_slice(params: PyTree, *, axis: str) -> PyTree:
  """This device's ``1/N`` flat slice of replicated (full) params.

  Inside ``shard_map`` over ``axis`` (size ``N``, index ``d``): each leaf
  ``x`` becomes ``FlatLeaf(pad(ravel(x))[d*c:(d+1)*c], x.shape)``.

  Example:
    >>> mine = jaxpar.zero.local_slice(params, axis='data')   # in shard_map
  """
  n, d = jax.lax.axis_size(axis), jax.lax.axis_index(axis)

  def one(x):
    flat = _pad_flat(x, n)
    c = flat.size // n
    return FlatLeaf(jax.lax.dynamic_slice_in_dim(flat, d * c, c), x.shape)
  return jax.tree.map(one, params)


def all_gather(params: PyTree, *, axis: str, invariant: bool = False) -> PyTree:
  """Full params from every device's ``FlatLeaf`` slice (padding dropped).

  Inside ``shard_map`` over ``axis``: each ``FlatLeaf`` ``[c]`` is
  all-gathered to ``[N*c]``, cut to ``prod(shape)`` and reshaped; other leaves
  pass through.

  Args:
    params: pytree with ``FlatLeaf`` slices.
    axis: the mesh axis they are sharded over.
    invariant: ``False``: the result is typed varying over ``axis`` and its
      transpose is a reduce-scatter (sum over ``axis``): use inside a loss.
      ``True``: typed invariant, e.g. for outputs with ``out_specs=P()``.

  Example:
    >>> full = jaxpar.zero.all_gather(state.params, axis='data')  # in shard_map
  """
  to = 'invarying' if invariant else 'varying'
  return jax.tree.map(
      lambda x: _unpad(jax.lax.all_gather(x.flat, axis, tiled=True, to=to),
                       x.shape) if _is_flat(x) else x,
      params, is_leaf=_is_flat)


def gathered_loss(loss_fn: Callable[..., Any], *,
                  axis: str) -> Callable[..., Any]:
  """``loss_fn`` on ``FlatLeaf`` slices, gathering params just before use.

  ``fn(slices, *args) = loss_fn(all_gather(slices), *args)`` under
  ``jax.checkpoint(policy=dots_saveable)``: matmul outputs are saved for the
  backward pass, the gathered params are not (they are re-gathered), see the
  module docstring. The gradient w.r.t. ``slices`` is this device's slice of
  the gradient summed over ``axis`` (the all-gather's transpose is a
  reduce-scatter); ``reduce_gradients`` turns it into the mean.

  Example:
    >>> fn = jaxpar.zero.gathered_loss(loss_fn, axis='data')      # in shard_map
    >>> loss, grads = jax.value_and_grad(fn)(state.params, local_batch)
  """
  def fn(params, *args):
    return loss_fn(all_gather(params, axis=axis), *args)
  return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_saveable)


def reduce_gradients(grads: PyTree, *, axis: str) -> PyTree:
  """This device's ``FlatLeaf`` slice of the per-device grads' mean over ``axis``.

  Inside ``shard_map`` over ``axis`` (size ``N``):

  * a plain leaf is a device's full gradient ``g_d`` (stage 1): it is padded,
    raveled and reduce-scattered, ``sum_d g_d / N``, one ``psum_scatter``;
  * a ``FlatLeaf`` is the gradient w.r.t. this device's slice from
    ``gathered_loss`` (stage 3), already summed over ``axis`` by the
    reduce-scatter of the gather's transpose: it is divided by ``N``.

  Example:
    >>> grads = jaxpar.zero.reduce_gradients(jax.grad(loss_fn)(params, b),
    ...                                      axis='data')   # in shard_map
  """
  n = jax.lax.axis_size(axis)

  def one(g):
    if _is_flat(g):
      return FlatLeaf(g.flat / n, g.shape)
    summed = jax.lax.psum_scatter(_pad_flat(g, n), axis, tiled=True)
    return FlatLeaf(summed / n, np.shape(g))
  return jax.tree.map(one, grads, is_leaf=_is_flat)


def global_norm(grads: PyTree, *, axis: str | Sequence[str]) -> jax.Array:
  """Global L2 norm of a gradient sharded over ``axis``: ``sqrt(psum(sum g^2))``.

  Inside ``shard_map``; ``axis`` is one mesh axis or a tuple of all axes the
  leaves are sharded over. Padding zeros add nothing. Equals
  ``optax.tree.norm`` of the unsharded gradient.

  Example:
    >>> norm = jaxpar.zero.global_norm(grads, axis='data')   # in shard_map
  """
  local = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
  return jnp.sqrt(jax.lax.psum(local, (axis,) if isinstance(axis, str)
                               else tuple(axis)))


def apply_gradients(state: TrainState, grads: PyTree, *, loss: jax.Array,
                    grad_norm: jax.Array,
                    optimizer: optax.GradientTransformation, axis: str,
                    max_grad_norm: float | None = None
                    ) -> tuple[TrainState, jax.Array]:
  """The ZeRO update: ``jaxpar.train_state.apply_gradients`` on ``1/N`` slices.

  Inside ``shard_map`` over ``axis``. ``grads`` are ``FlatLeaf`` slices of the
  mean gradient (``reduce_gradients``), ``grad_norm`` their global norm
  (``global_norm``). Stage 1 (replicated ``state.params``): this device
  updates its ``local_slice`` of the params with its slice of the optimizer
  state, then the params are all-gathered (invariant, original shapes).
  Stage 3 (``FlatLeaf`` params): the slices are updated in place. Clipping
  and non-finite skipping are those of ``train_state.apply_gradients``.

  Returns:
    ``(new_state, skipped)``, the state in the same layout as ``state``.

  Example:
    >>> state, skipped = jaxpar.zero.apply_gradients(
    ...     state, grads, loss=loss, grad_norm=norm, optimizer=opt,
    ...     axis='data')   # in shard_map
  """
  stage3 = bool(_flat_leaves(state.params))
  params = state.params if stage3 else local_slice(state.params, axis=axis)
  new, skipped = train_state.apply_gradients(
      state._replace(params=params), grads, loss=loss, grad_norm=grad_norm,
      optimizer=optimizer, max_grad_norm=max_grad_norm)
  if not stage3:
    new = new._replace(params=all_gather(new.params, axis=axis, invariant=True))
  return new, skipped
