"""Data parallelism: the replica step, placed on a mesh with ``jax.shard_map``.

Every device of the ``axis`` mesh axis holds the full params and ``1/N`` of
the batch; gradients are averaged with one all-reduce (``pmean``), so one step
is exactly single-device optax training on the global batch::

  g = 1/N * sum_d grad(loss_fn)(params, batch_d)      (batch_d: shard d)

With ``num_microbatches=k`` each device further splits its shard into ``k``
microbatches and accumulates gradients with ``lax.scan``: activation memory
is that of one microbatch, the result that of the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import zero
from jaxpar.mesh import axis_size
from jaxpar.train_state import (PyTree, StepStats, TrainState, apply_gradients,
                                check_optimizer)

BACKENDS = ('shard_map', 'pmap')


def _dtype(x) -> np.dtype:
  return x.dtype if hasattr(x, 'dtype') else np.result_type(x)


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
                                batch: PyTree, *, num_microbatches: int = 1,
                                has_aux: bool = False,
                                axis: str | None = None):
  """Mean loss and gradient over ``num_microbatches`` slices of ``batch``.

  ``loss = 1/k sum_i loss_fn(params, batch_i)`` and its gradient; gradients
  accumulate in a ``lax.scan`` so only one microbatch's activations are live
  at a time. Inside ``shard_map``, ``axis`` names the mesh axis the batch
  varies over (the scan's carry must vary over it too).

  Returns:
    ``(loss, grads, aux)``; ``aux`` is the microbatch mean of the auxiliary
    output (``None`` without ``has_aux``).
  """
  vg = jax.value_and_grad(loss_fn, has_aux=has_aux)

  def one(mb):
    out, grads = vg(params, mb)
    loss, aux = out if has_aux else (out, None)
    return loss, grads, aux

  if num_microbatches == 1:
    return one(batch)

  def body(acc, mb):
    return jax.tree.map(jnp.add, acc, one(mb)), None

  mbs = split_microbatches(batch, num_microbatches)
  zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                      jax.eval_shape(one, jax.tree.map(lambda x: x[0], mbs)))
  if axis is not None:
    zero = jax.lax.pcast(zero, axis, to='varying')
  total, _ = jax.lax.scan(body, zero, mbs)
  return jax.tree.map(lambda t: t / num_microbatches, total)


def _check_aux(aux) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise TypeError(
          f'loss_fn aux leaf {jax.tree_util.keystr(path)} has dtype '
          f'{leaf.dtype}; aux is averaged over microbatches and devices, so '
          'return float metrics (e.g. accuracy as float32).')


def check_loss_fn(loss_fn, params, batch, *, has_aux: bool) -> None:
  """``TypeError`` unless ``loss_fn(params, batch)`` gives a float scalar.

  Abstract evaluation only (``jax.eval_shape``): nothing is compiled.
  """
  out = jax.eval_shape(loss_fn, params, batch)
  if has_aux:
    if not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError(
          'has_aux=True needs loss_fn(params, batch) to return (loss, aux), '
          f'got {out}.')
    out, aux = out
    _check_aux(aux)
  if not hasattr(out, 'shape') or out.shape != ():
    raise TypeError(
        f'loss_fn(params, batch) must return a scalar (the mean loss over '
        f'the examples it gets), got {out}. Reduce it, e.g. with .mean()'
        + ('' if has_aux else ', or pass has_aux=True if it returns (loss, aux)')
        + '.')
  if not jnp.issubdtype(out.dtype, jnp.floating):
    raise TypeError(f'loss_fn must return a float scalar, got {out.dtype}.')


def data_parallel_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    axis: str = 'data',
    max_grad_norm: float | None = None,
    num_microbatches: int = 1,
    zero_stage: int = 0,
    has_aux: bool = False,
    backend: str = 'shard_map',
) -> Callable[[TrainState, PyTree], tuple[TrainState, StepStats]]:
  """A data-parallel train step, exactly single-device optax on the global batch.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over the
      examples of ``batch`` (``(scalar, aux)`` with ``has_aux``; aux leaves are
      float and are averaged like the loss).
    optimizer: an optax ``GradientTransformation``.
    mesh: a mesh from ``jaxpar.make_mesh``; the batch is split over ``axis``,
      params are replicated over every axis.
    axis: the data-parallel mesh axis, size ``N``.
    max_grad_norm: clip the gradient to this global L2 norm (as
      ``optax.clip_by_global_norm`` on one device); ``None``: no clipping.
    num_microbatches: ``k``; each device accumulates gradients over ``k``
      microbatches with ``lax.scan``. The global batch size must be divisible
      by ``N * k``.
    zero_stage: 0 (replicated optimizer state); 1 shards the optimizer state
      over ``axis``, 3 the params too (``jaxpar.zero``; the state must come
      from ``jaxpar.zero.shard_state(state, mesh=mesh, stage=zero_stage)``;
      needs ``backend='shard_map'``).
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    backend: ``'shard_map'`` or ``'pmap'`` (legacy; same results).

  Returns:
    ``step(state, batch) -> (state, stats)``: ``state`` a ``TrainState``,
    ``batch`` a pytree of numpy or jax arrays with leading size ``B`` (placed
    on the mesh by the step), ``stats`` a ``StepStats`` whose ``loss`` is the
    global mean before the update and ``grad_norm`` the global norm before
    clipping. ``step.lower(state, batch)`` gives the lowered program (for
    ``.compile().memory_analysis()``). Non-finite loss or gradients skip the
    update (``stats.skipped``).

  Example:
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> step = jaxpar.data_parallel_step(loss_fn, optax.adam(1e-3), mesh=mesh)
    >>> state = jaxpar.TrainState.create(params, optax.adam(1e-3))
    >>> state, stats = step(state, {'x': x, 'y': y})   # x: [B, ...], B % 8 == 0
  """
  if not callable(loss_fn):
    raise TypeError(f'loss_fn must be callable, got {loss_fn!r}.')
  check_optimizer(optimizer)
  n = axis_size(mesh, axis)
  if isinstance(num_microbatches, bool) or not isinstance(
      num_microbatches, int) or num_microbatches < 1:
    raise ValueError(
        f'num_microbatches={num_microbatches!r} must be an int >= 1.')
  if max_grad_norm is not None and not max_grad_norm > 0:
    raise ValueError(
        f'max_grad_norm={max_grad_norm!r} must be > 0, or None for no clipping.')
  if backend not in BACKENDS:
    raise ValueError(f'backend={backend!r}; choose one of {BACKENDS}.')
  if zero_stage not in (0, 1, 3):
    raise ValueError(f'zero_stage={zero_stage!r}; choose 0, 1 or 3.')
  if zero_stage and backend != 'shard_map':
    raise ValueError(f'zero_stage={zero_stage} needs backend=\'shard_map\' '
                     f'(got {backend!r}; pmap is the legacy replicated path).')

  def replica_step(state: TrainState, batch: PyTree):
    if zero_stage == 3:  # params are 1/N flat slices, gathered inside the loss
      params, fn = state.params, zero.gathered_loss(loss_fn, axis=axis)
    else:
      params, fn = jax.lax.pcast(state.params, axis, to='varying'), loss_fn
    loss, grads, aux = microbatched_value_and_grad(
        fn, params, batch, num_microbatches=num_microbatches,
        has_aux=has_aux, axis=axis)
    if zero_stage:
      # Reduce-scatter instead of all-reduce: each device gets the 1/N slice
      # of the mean gradient that it updates (see jaxpar.zero).
      loss, aux = jax.lax.pmean((loss, aux), axis)
      grads = zero.reduce_gradients(grads, axis=axis)
      grad_norm = zero.global_norm(grads, axis=axis)
      state, skipped = zero.apply_gradients(
          state, grads, loss=loss, grad_norm=grad_norm, optimizer=optimizer,
          max_grad_norm=max_grad_norm, axis=axis)
      return state, StepStats(loss, grad_norm, skipped, aux)
    # One all-reduce: the gradient of the global mean is the mean of the
    # per-device gradients (equal shard sizes).
    loss, grads, aux = jax.lax.pmean((loss, grads, aux), axis)
    grad_norm = optax.tree.norm(grads)
    state, skipped = apply_gradients(
        state, grads, loss=loss, grad_norm=grad_norm, optimizer=optimizer,
        max_grad_norm=max_grad_norm)
    return state, StepStats(loss, grad_norm, skipped, aux)

  if backend == 'shard_map':
    def sharded_step(state, batch):
      # ZeRO's FlatLeaf arrays are sharded over axis, everything else (all of
      # a zero_stage=0 state) is replicated.
      specs = zero.state_specs(state, axis=axis)
      return jax.shard_map(replica_step, mesh=mesh, in_specs=(specs, P(axis)),
                           out_specs=(specs, P()))(state, batch)

    compiled = jax.jit(sharded_step)
    sharded = NamedSharding(mesh, P(axis))

    def place(state, batch):
      return (jax.device_put(state, jax.tree.map(
          lambda s: NamedSharding(mesh, s), zero.state_specs(state, axis=axis))),
              jax.device_put(batch, sharded))
  else:
    devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0)
    devices = list(devices.reshape(n, -1)[:, 0])
    compiled = jax.jit(jax.pmap(
        replica_step, axis_name=axis, in_axes=(None, 0), out_axes=None,
        devices=devices))

    def place(state, batch):
      return state, jax.tree.map(
          lambda x: jnp.reshape(x, (n, x.shape[0] // n, *x.shape[1:])), batch)

  checked = set()

  def validate(state, batch):
    if not isinstance(state, TrainState):
      raise TypeError(f'state must be a jaxpar.TrainState (see '
                      f'TrainState.create), got {type(state).__name__}.')
    size = batch_size_of(batch)
    if size % (n * num_microbatches):
      raise ValueError(
          f'batch size {size} is not divisible by {axis} size {n} x '
          f'num_microbatches {num_microbatches} = {n * num_microbatches}; use '
          f'a batch size that is a multiple of {n * num_microbatches} (e.g. '
          f'{max(1, size // (n * num_microbatches)) * n * num_microbatches}).')
    key = (jax.tree.structure((state, batch)), tuple(
        (np.shape(x), _dtype(x)) for x in jax.tree.leaves((state, batch))))
    if key not in checked:
      zero.check_state(state, optimizer, stage=zero_stage, mesh=mesh, axis=axis)
      micro = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(
              (size // (n * num_microbatches), *np.shape(x)[1:]),
              _dtype(x)), batch)
      check_loss_fn(loss_fn, zero.logical_shapes(state.params), micro,
                    has_aux=has_aux)
      checked.add(key)

  def step(state: TrainState, batch: PyTree) -> tuple[TrainState, StepStats]:
    validate(state, batch)
    return compiled(*place(state, batch))

  def lower(state: TrainState, batch: PyTree):
    validate(state, batch)
    return compiled.lower(*place(state, batch))

  step.lower = lower
  return step
