"""Data parallelism: the replica step, placed on a mesh with ``jax.shard_map``.

Every device of the ``axis`` mesh axis holds the params (or, with ZeRO,
``1/N`` of them) and ``1/N`` of the batch; gradients are averaged with one
all-reduce (``pmean``; ZeRO: a reduce-scatter), so one step is exactly
single-device optax training on the global batch::

  g = 1/N * sum_d grad(loss_fn)(params, batch_d)      (batch_d: shard d)

With ``num_microbatches=k`` each device further splits its shard into ``k``
microbatches and accumulates gradients with ``lax.scan``: activation memory
is that of one microbatch, the result that of the whole batch.

The gradients come out of the ``shard_map`` as global arrays; the optimizer
update then runs on them under ``jit`` (``train_state.sharded_update``), so
any optax transform gives single-device numbers in any ZeRO stage.
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

from jaxpar import vma

from jaxpar.data_parallel import _zero as zero
from jaxpar.mesh import axis_size
from jaxpar.train_state import (PyTree, StepStats, Trainer, TrainState,
                                apply_gradients, auto_view, check_max_grad_norm,
                                check_optimizer, placed_init, sharded_update,
                                signature)

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


def check_count(name: str, value: Any) -> int:
  """``value`` as an int >= 1 (NumPy ints too); ``TypeError``/``ValueError``.

  Example:
    >>> jaxpar.data_parallel.check_count('num_microbatches', np.int32(2))
    2
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, np.integer)):
    raise TypeError(f'{name} must be an int >= 1, got '
                    f'{type(value).__name__}: {value!r}.')
  if value < 1:
    raise ValueError(f'{name}={value!r} must be >= 1.')
  return int(value)


def _check_options(loss_fn, optimizer, max_grad_norm, backend, zero_stage
                   ) -> tuple[optax.GradientTransformation, int]:
  if not callable(loss_fn):
    raise TypeError(f'loss_fn must be callable, got {loss_fn!r}.')
  optimizer = check_optimizer(optimizer)
  check_max_grad_norm(max_grad_norm)
  if backend not in BACKENDS:
    raise ValueError(f'backend={backend!r}; choose one of {BACKENDS}.')
  zero_stage = zero.check_zero_stage(zero_stage)
  if zero_stage and backend != 'shard_map':
    raise ValueError(f'zero_stage={zero_stage} needs backend=\'shard_map\' '
                     f'(got {backend!r}; pmap is the legacy replicated path).')
  return optimizer, zero_stage


def trainer(
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
) -> Trainer:
  """Data-parallel training, exactly single-device optax on the global batch.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over the
      examples of ``batch`` (``(scalar, aux)`` with ``has_aux``; aux leaves are
      float and are averaged like the loss).
    optimizer: any optax ``GradientTransformation`` (chains, ``lamb``,
      ``adafactor``, ``MultiSteps``, ...): it runs on global arrays.
    mesh: a mesh from ``jaxpar.make_mesh``; the batch is split over ``axis``,
      params are replicated over every axis (ZeRO-3: split over ``axis``).
    axis: the data-parallel mesh axis, size ``N``.
    max_grad_norm: clip the gradient to this global L2 norm, exactly as
      ``optax.chain(optax.clip_by_global_norm(max_grad_norm), optimizer)``;
      ``None``: no clipping.
    num_microbatches: ``k``; each device accumulates gradients over ``k``
      microbatches with ``lax.scan``. The global batch size must be divisible
      by ``N * k``.
    zero_stage: 0 (replicated optimizer state); 1 splits the optimizer state
      over ``axis``, 3 the params too (FSDP); see ``jaxpar.zero``. Needs
      ``backend='shard_map'``.
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    backend: ``'shard_map'`` or ``'pmap'`` (legacy; same results).

  Returns:
    ``Trainer(init, step, params)``: ``init(params)`` gives a placed
    ``TrainState`` in the ``zero_stage`` layout; ``step(state, batch) ->
    (state, StepStats)`` takes a batch pytree of numpy or jax arrays with
    leading size ``B`` (placed on the mesh by the step; any state is placed
    into the step's layout); ``stats.loss`` is the global mean before the
    update, ``stats.grad_norm`` the global norm before clipping;
    non-finite loss or gradients skip the update (``stats.skipped``).
    ``params(state)`` returns ``state.params`` at their logical shapes as
    they are sharded (``train_state.auto_view``: nothing is replicated but
    the leaves ZeRO pads, ``zero.unpadded``).

  Example:
    >>> loss_fn = lambda p, b: jnp.mean((b['x'] @ p['w'] - b['y']) ** 2)
    >>> trainer = jaxpar.data_parallel.trainer(
    ...     loss_fn, optax.lamb(1e-2), mesh=jaxpar.make_mesh(data=8),
    ...     zero_stage=3, max_grad_norm=1.0)
    >>> state = trainer.init({'w': jnp.ones((8, 2))})
    >>> state.params['w'].sharding.shard_shape((8, 2))   # 1/8 per device
    (1, 2)
    >>> batch = {'x': np.ones((16, 8), np.float32),
    ...          'y': np.zeros((16, 2), np.float32)}
    >>> state, stats = trainer.step(state, batch)
    >>> round(float(stats.loss), 4), bool(stats.skipped)
    (64.0, False)
  """
  optimizer, zero_stage = _check_options(loss_fn, optimizer, max_grad_norm,
                                         backend, zero_stage)
  num_microbatches = check_count('num_microbatches', num_microbatches)
  n = axis_size(mesh, axis)
  if backend == 'pmap':
    step, init = _pmap_step(loss_fn, optimizer, mesh=mesh, axis=axis,
                            max_grad_norm=max_grad_norm,
                            num_microbatches=num_microbatches,
                            has_aux=has_aux)
  else:
    step, init = _shard_map_step(loss_fn, optimizer, mesh=mesh, axis=axis,
                                 max_grad_norm=max_grad_norm,
                                 num_microbatches=num_microbatches,
                                 zero_stage=zero_stage, has_aux=has_aux)
  checked = set()

  def validate(state, batch):
    if not isinstance(state, TrainState):
      raise TypeError(f'state must be a jaxpar.TrainState (see '
                      f'Trainer.init or TrainState.create), got '
                      f'{type(state).__name__}.')
    size = batch_size_of(batch)
    if size % (n * num_microbatches):
      raise ValueError(
          f'batch size {size} is not divisible by {axis} size {n} x '
          f'num_microbatches {num_microbatches} = {n * num_microbatches}; use '
          f'a batch size that is a multiple of {n * num_microbatches} (e.g. '
          f'{max(1, size // (n * num_microbatches)) * n * num_microbatches}).')
    key = signature((state, batch))
    if key not in checked:
      # Logical, unsharded shapes: user code need not be valid under
      # sharding types.
      logical = zero.logical_shapes(state)
      params = logical.params
      check_opt_state(logical, optimizer)
      micro = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(
              (size // (n * num_microbatches), *np.shape(x)[1:]),
              _dtype(x)), batch)
      check_loss_fn(loss_fn, params, micro, has_aux=has_aux)
      checked.add(key)

  def checked_step(state: TrainState, batch: PyTree
                   ) -> tuple[TrainState, StepStats]:
    validate(state, batch)
    return step(state, batch)

  def lower(state: TrainState, batch: PyTree):
    validate(state, batch)
    return step.lower(state, batch)

  checked_step.lower = lower
  return Trainer(init, checked_step,
                 lambda state: auto_view(zero.unpadded(state.params)))


def check_opt_state(state: TrainState,
                    optimizer: optax.GradientTransformation) -> None:
  """``ValueError`` unless ``state.opt_state`` is ``optimizer.init``-shaped.

  Abstract evaluation only; the message says how to make a fitting state.
  """
  want = jax.eval_shape(optimizer.init, state.params)
  shapes = lambda tree: (jax.tree.structure(tree),
                         [np.shape(x) for x in jax.tree.leaves(tree)])
  if shapes(want) != shapes(state.opt_state):
    raise ValueError(
        'state.opt_state does not have the structure and shapes of '
        'optimizer.init(state.params) (got '
        f'{jax.tree.structure(state.opt_state)}, want '
        f'{jax.tree.structure(want)}); create the state with this optimizer: '
        'trainer.init(params) or TrainState.create(params, optimizer).')


def _shard_map_step(loss_fn, optimizer, *, mesh, axis, max_grad_norm,
                    num_microbatches, zero_stage, has_aux):
  """The jitted ``shard_map`` step and ``init`` of ``train_step``."""
  layouts = {}

  def layout(state: TrainState) -> tuple[TrainState, PyTree, Any]:
    """(specs of the state, params specs with the data axis, the optimizer
    on its padded state: ``zero.padded_optimizer``), from the logical
    shapes: cached."""
    logical = zero.logical_shapes(state)
    key = signature(logical)
    if key not in layouts:
      base = jax.tree.map(lambda _: P(), logical.params)
      split = zero.data_specs(logical.params, mesh=mesh, axis=axis, pad=True)
      specs = zero.state_specs(logical, zero_stage=zero_stage,
                               param_specs=base, zero_specs=split)
      layouts[key] = (specs, split, zero.padded_optimizer(
          optimizer, specs.opt_state, mesh=mesh))
    return layouts[key]

  # The user's loss as on one device: its constants may meet batch values in
  # loops and branches (jaxpar.vma); ZeRO-3 gathers the params around it.
  lifted = vma.lift(loss_fn, axes=(axis,))

  def local_grads(params, batch, *, specs, split):
    fn = zero.gathered(lifted, split, axis=axis) if zero_stage == 3 else lifted
    params = zero.vary(params, specs, axis=axis)
    loss, grads, aux = microbatched_value_and_grad(
        fn, params, batch, num_microbatches=num_microbatches,
        has_aux=has_aux, axis=axis)
    loss, aux = jax.lax.pmean((loss, aux), axis)
    grads = zero.reduce_gradients(grads, split if zero_stage else specs,
                                  axis=axis, summed=zero_stage == 3)
    return loss, grads, aux

  def program(state: TrainState, batch: PyTree):
    specs, split, padded_optimizer = layout(state)
    loss, grads, aux = jax.shard_map(
        lambda p, b: local_grads(p, b, specs=specs.params, split=split),
        mesh=mesh, in_specs=(specs.params, P(axis)),
        out_specs=(P(), split if zero_stage else specs.params, P()))(
            state.params, batch)
    state, stats = sharded_update(
        state, grads, loss=loss, optimizer=padded_optimizer, mesh=mesh,
        state_specs=specs, max_grad_norm=max_grad_norm,
        update_specs=split if zero_stage == 1 else None)
    return state, stats._replace(aux=aux)

  compiled = jax.jit(program)
  batch_sharding = NamedSharding(mesh, P(axis))

  def place(state, batch):
    return (zero.place(state, layout(state)[0], mesh=mesh),
            jax.device_put(batch, batch_sharding))

  def step(state, batch):
    with jax.set_mesh(mesh):
      return compiled(*place(state, batch))

  def tick_table(state, batch):
    with jax.set_mesh(mesh):
      return compiled.lower(*place(state, batch))

  def init_layout(params: PyTree):
    specs, _, padded_optimizer = layout(jax.eval_shape(
        lambda p: TrainState.create(p, optimizer), params))
    return (lambda p: zero.pad(p, specs.params, mesh=mesh), padded_optimizer,
            specs)

  step.lower = lower
  return step, placed_init(init_layout, mesh=mesh)


def _pmap_step(loss_fn, optimizer, *, mesh, axis, max_grad_norm,
               num_microbatches, has_aux):
  """The legacy ``jax.pmap`` step (replicated state) and ``init``."""
  n = axis_size(mesh, axis)

  def replica_step(state: TrainState, batch: PyTree):
    params = jax.lax.pcast(state.params, axis, to='varying')
    loss, grads, aux = microbatched_value_and_grad(
        loss_fn, params, batch, num_microbatches=num_microbatches,
        has_aux=has_aux, axis=axis)
    loss, grads, aux = jax.lax.pmean((loss, grads, aux), axis)
    state, stats = apply_gradients(state, grads, loss=loss,
                                   optimizer=optimizer,
                                   max_grad_norm=max_grad_norm)
    return state, stats._replace(aux=aux)

  devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0)
  devices = list(devices.reshape(n, -1)[:, 0])
  compiled = jax.jit(jax.pmap(
      replica_step, axis_name=axis, in_axes=(None, 0), out_axes=None,
      devices=devices))

  def split(batch):
    return jax.tree.map(
        lambda x: jnp.reshape(x, (n, x.shape[0] // n, *x.shape[1:])), batch)

  def step(state, batch):
    return compiled(state, split(batch))

  def init(params: PyTree) -> TrainState:
    return TrainState.create(params, optimizer)

  step.lower = lambda state, batch: compiled.lower(state, split(batch))
  return step, init
