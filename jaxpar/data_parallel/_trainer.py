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

**Options** shared with ``jaxpar.parallel.trainer``, with the same meaning:
``key`` (dropout: masks a function of the seed, the step and the global
microbatch index, so the same on every mesh), ``compute_dtype`` (bf16
compute on float32 params and optimizer state), ``remat_policy`` (what the
forward keeps for the backward), ``max_grad_norm`` and ``zero_stage``.

One step, as the trainer's pieces below build it::

  _check_options      the arguments, eagerly          -> _Options
  _differentiated     loss_fn cast / remat-ed          (per microbatch)
  _ShardMapStep       place -> shard_map(_local_grads) -> sharded_update
  _CheckedStep        batch and state checks, once per signature
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import vma
from jaxpar._validate import check_int
from jaxpar.data_parallel._blocks import gathered, reduce_gradients, vary
from jaxpar.data_parallel._from_nnx import DataParallelModel
from jaxpar.data_parallel._model_state import merged, stateful, varying
from jaxpar.data_parallel._padding import (logical_shapes, pad,
                                           padded_optimizer, place, unpadded)
from jaxpar.data_parallel._specs import (check_zero_stage, data_specs,
                                         state_specs)
from jaxpar.mesh import axis_size
from jaxpar.train_state import (PyTree, StepStats, Trainer, TrainState,
                                cast_params, check_compute_dtype, check_key,
                                check_remat_policy,
                                apply_gradients, auto_view, check_max_grad_norm,
                                check_optimizer, check_update_args,
                                placed_init, sharded_update, signature)

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
                                model_state: PyTree, batch: PyTree, *,
                                num_microbatches: int = 1,
                                axis: str | None = None,
                                key: jax.Array | None = None):
  """Mean loss and gradient over ``num_microbatches`` slices of ``batch``.

  ``loss_fn(params, model_state, batch_i[, key]) -> (loss, (aux,
  model_state))`` (``_model_state.stateful``'s form). ``loss = 1/k sum_i
  loss(params, batch_i)`` and its gradient; gradients accumulate in a
  ``lax.scan`` so only one microbatch's activations are live at a time, and
  the model state is threaded through the microbatches in order. Inside
  ``shard_map`` (or ``pmap``), ``axis`` names the mesh axis the batch is
  split over (the scan's carry must vary over it too).

  With a ``key``, microbatch ``i`` runs ``loss_fn(params, model_state,
  batch_i, fold_in(key, g))`` with ``g = axis_index(axis) * k + i`` (``g =
  i`` without ``axis``): its index in the global batch.

  Returns:
    ``(loss, grads, aux, model_state)``; ``aux`` is the microbatch mean of
    the auxiliary output, ``model_state`` the one after the last microbatch.
  """
  vg = jax.value_and_grad(loss_fn, has_aux=True)
  first = (0 if axis is None or key is None
           else jax.lax.axis_index(axis) * num_microbatches)

  def one(state, mb, index):
    keys = () if key is None else (jax.random.fold_in(key, first + index),)
    (loss, (aux, state)), grads = vg(params, state, mb, *keys)
    return (loss, grads, aux), state

  if num_microbatches == 1:
    out, model_state = one(model_state, batch, 0)
    return (*out, model_state)

  def body(carry, mb_and_index):
    acc, state = carry
    out, state = one(state, *mb_and_index)
    if axis is not None:
      state = varying(state, axis)
    return (jax.tree.map(jnp.add, acc, out), state), None

  mbs = split_microbatches(batch, num_microbatches)
  zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
      one, model_state, jax.tree.map(lambda x: x[0], mbs), 0)[0])
  if axis is not None:
    zero = jax.lax.pcast(zero, axis, to='varying')
    model_state = varying(model_state, axis)
  (total, model_state), _ = jax.lax.scan(
      body, (zero, model_state), (mbs, jnp.arange(num_microbatches)))
  return (*jax.tree.map(lambda t: t / num_microbatches, total), model_state)


def check_float_params(params: PyTree) -> None:
  """``TypeError`` naming the first leaf of ``params`` that is not floating
  point: the step differentiates every leaf (``jax.grad`` fails on integers
  with a message naming none), so say which one and what to do, eagerly."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    dtype = _dtype(leaf)
    if not jnp.issubdtype(dtype, jnp.inexact):
      name = jax.tree_util.keystr(path, simple=True, separator='/')
      raise TypeError(
          f'params leaf {name!r} has dtype {dtype}; the step differentiates '
          'every leaf of params, so each must be floating point: cast it '
          "(e.g. .astype('float32')) if it is a weight, or keep integer data "
          'out of params (in the batch, or closed over in loss_fn).')


def _check_aux(aux) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise TypeError(
          f'loss_fn aux leaf {jax.tree_util.keystr(path)} has dtype '
          f'{leaf.dtype}; aux is averaged over microbatches and devices, so '
          'return float metrics (e.g. accuracy as float32).')


def _under_mesh(fn: Callable[..., Any], mesh: Mesh | None
                ) -> Callable[..., Any]:
  """``fn`` with the mesh's axes bound, for abstract evaluation: a loss may
  use collectives over them (``nnx.BatchNorm(axis_name='data')``)."""
  if mesh is None:
    return fn
  return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(),
                       check_vma=False)


def check_loss_fn(loss_fn, params, batch, *, has_aux: bool, key: Any = None,
                  model_state: PyTree = None, carries_state: bool = False,
                  mesh: Mesh | None = None) -> None:
  """``TypeError`` unless ``loss_fn(params, batch[, key])`` gives a float
  scalar (``carries_state``: ``loss_fn(params, model_state, batch[, key])
  -> (out, model_state)``, the new model state shaped like the old).
  Abstract evaluation only (``jax.eval_shape``), on ``mesh``'s axes when
  given: nothing is compiled.
  """
  call = ('loss(m, batch)' if carries_state else
          'loss_fn(params, batch' + (')' if key is None else ', key)'))
  args = (params, model_state, batch) if carries_state else (params, batch)
  try:
    out = jax.eval_shape(_under_mesh(loss_fn, mesh), *args,
                         *(() if key is None else (key,)))
  except TypeError as e:
    if key is None or carries_state or 'positional argument' not in str(e):
      raise
    raise TypeError(f'with key= the step calls {call}: loss_fn must take '
                    f'the key as its last argument ({e}).') from e
  if carries_state:
    out, new = out
    _check_new_model_state(model_state, new)
  if has_aux:
    if not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError(
          f'has_aux=True needs {call} to return (loss, aux), got {out}.')
    out, aux = out
    _check_aux(aux)
  if not hasattr(out, 'shape') or out.shape != ():
    raise TypeError(
        f'{call} must return a scalar (the mean loss over '
        f'the examples it gets), got {out}. Reduce it, e.g. with .mean()'
        + ('' if has_aux else ', or pass has_aux=True if it returns (loss, aux)')
        + '.')
  if not jnp.issubdtype(out.dtype, jnp.floating):
    raise TypeError(f'{call} must return a float scalar, got {out.dtype}.')


def _check_new_model_state(old: PyTree, new: PyTree) -> None:
  """``ValueError`` unless the forward's model state is shaped like the old
  one (the step carries it from one step to the next)."""
  shapes = lambda tree: jax.tree.map(lambda x: (np.shape(x), _dtype(x)),
                                     tree)
  if shapes(old) != shapes(new):
    raise ValueError(
        f'the model state after the forward pass {shapes(new)} differs from '
        f'the one before {shapes(old)}: the step carries it from one step '
        'to the next, so the forward may update variables but not add, '
        'remove or reshape them (create every variable in __init__).')


# -- The options ------------------------------------------------------------


class _Options(NamedTuple):
  """A trainer's arguments, checked (``_check_options``)."""
  loss_fn: Callable[..., Any]
  optimizer: optax.GradientTransformation
  mesh: Mesh
  axis: str
  max_grad_norm: float | None
  num_microbatches: int
  zero_stage: int
  has_aux: bool
  key: jax.Array | None
  compute_dtype: np.dtype | None
  remat: Callable[..., Any] | None   # a jax.checkpoint policy; None: no remat
  carries_state: bool   # loss_fn is a DataParallelModel's: it takes and
                        # gives the model state


def _remat(remat_policy: Any) -> Callable[..., Any] | None:
  """The ``jax.checkpoint`` policy of the loss, ``None`` for no remat
  (``remat_policy`` ``None`` or ``'everything'``)."""
  if remat_policy is None:
    return None
  return check_remat_policy(remat_policy)


def _check_options(loss_fn, optimizer, *, mesh, axis, max_grad_norm,
                   num_microbatches, zero_stage, has_aux, backend, key,
                   compute_dtype, remat_policy) -> _Options:
  carries_state = isinstance(loss_fn, DataParallelModel)
  if carries_state:
    if backend != 'shard_map':
      raise ValueError(f"a DataParallelModel needs backend='shard_map' (got "
                       f'{backend!r}; pmap is the legacy path without a '
                       'model state).')
    loss_fn = loss_fn.loss_fn
  elif not callable(loss_fn):
    raise TypeError(f'loss_fn must be callable (or a DataParallelModel from '
                    f'jaxpar.data_parallel.from_nnx), got {loss_fn!r}.')
  optimizer = check_optimizer(optimizer)
  check_max_grad_norm(max_grad_norm)
  if backend not in BACKENDS:
    raise ValueError(f'backend={backend!r}; choose one of {BACKENDS}.')
  zero_stage = check_zero_stage(zero_stage)
  if zero_stage and backend != 'shard_map':
    raise ValueError(f'zero_stage={zero_stage} needs backend=\'shard_map\' '
                     f'(got {backend!r}; pmap is the legacy replicated path).')
  num_microbatches = check_int(
      'num_microbatches', num_microbatches,
      fix='It is the number of microbatches each device accumulates over.')
  axis_size(mesh, axis)   # the axis is one of the mesh's
  check_key(key)
  return _Options(loss_fn, optimizer, mesh, axis, max_grad_norm,
                  num_microbatches, zero_stage, bool(has_aux), key,
                  check_compute_dtype(compute_dtype), _remat(remat_policy),
                  carries_state)


# -- The loss as the step differentiates it ---------------------------------


def _at_least_float32(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` (``stateful``'s form) with its loss and aux promoted to float32
  or wider (the model state keeps its dtypes)."""
  def promoted(*args):
    loss, (aux, model_state) = fn(*args)
    loss, aux = jax.tree.map(
        lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32)),
        (loss, aux))
    return loss, (aux, model_state)
  return promoted


def _differentiated(loss_fn: Callable[..., Any],
                    options: _Options) -> Callable[..., Any]:
  """``loss_fn`` as the step differentiates it, in ``stateful``'s form
  ``f(params, model_state, microbatch[, key]) -> (loss, (aux,
  model_state))``.

  With ``compute_dtype`` it runs on the params cast to it, inside the
  function (``cast_params``: the cast's transpose gives float32 gradients),
  and its loss and aux come back at least float32; with a remat policy the
  whole of it runs under ``jax.checkpoint(policy=...)``.
  """
  fn = stateful(loss_fn, has_aux=options.has_aux,
                carries_state=options.carries_state)
  if options.compute_dtype is not None:
    fn = _at_least_float32(cast_params(fn, options.compute_dtype))
  if options.remat is not None:
    fn = jax.checkpoint(fn, policy=options.remat)
  return fn


# -- The shard_map step -------------------------------------------------------


class _Layout(NamedTuple):
  """Where a state lives in one ZeRO stage (from its logical shapes)."""
  specs: TrainState                          # of the stored state
  split: PyTree                              # params' specs with ZeRO's axis
  optimizer: optax.GradientTransformation    # on the padded state


class _Layouts:
  """``_Layout`` of a state (logical shapes, or stored ones), cached by
  signature."""

  def __init__(self, options: _Options):
    self.options = options
    self.cache: dict[Any, _Layout] = {}

  def __call__(self, state: TrainState) -> _Layout:
    logical = logical_shapes(state)
    key = signature(logical)
    if key not in self.cache:
      self.cache[key] = self._build(logical)
    return self.cache[key]

  def _build(self, logical: TrainState) -> _Layout:
    o = self.options
    base = jax.tree.map(lambda _: P(), logical.params)
    split = data_specs(logical.params, mesh=o.mesh, axis=o.axis, pad=True)
    specs = state_specs(logical, zero_stage=o.zero_stage, param_specs=base,
                        zero_specs=split)
    return _Layout(specs, split,
                   padded_optimizer(o.optimizer, specs.opt_state, mesh=o.mesh))


def _local_grads(loss_fn, params, model_state, batch, *keys,
                 options: _Options, layout: _Layout):
  """One device's part, inside ``shard_map``: the mean loss, the gradients
  in the ZeRO layout (reduced over the data axis), the mean aux and the
  model state (``_model_state.merged``)."""
  axis, zero_stage = options.axis, options.zero_stage
  fn = gathered(loss_fn, layout.split, axis=axis) if zero_stage == 3 else loss_fn
  params = vary(params, layout.specs.params, axis=axis)
  loss, grads, aux, model_state = microbatched_value_and_grad(
      fn, params, model_state, batch,
      num_microbatches=options.num_microbatches, axis=axis,
      key=keys[0] if keys else None)
  loss, aux = jax.lax.pmean((loss, aux), axis)
  grads = reduce_gradients(grads, layout.split if zero_stage
                           else layout.specs.params, axis=axis,
                           summed=zero_stage == 3)
  return loss, grads, aux, merged(model_state, axis)


class _ShardMapStep:
  """The jitted step: place, gradients in one ``shard_map`` over the data
  axis, then the update on global arrays (``sharded_update``)."""

  def __init__(self, options: _Options):
    self.options = options
    self.layouts = _Layouts(options)
    # The user's loss as on one device: its constants may meet batch values
    # in loops and branches (jaxpar.vma).
    self.loss_fn = _differentiated(
        vma.lift(options.loss_fn, axes=(options.axis,)), options)
    self.batch_sharding = NamedSharding(options.mesh, P(options.axis))
    self.keys = () if options.key is None else (jax.device_put(
        options.key, NamedSharding(options.mesh, P())),)
    self.compiled = jax.jit(self._program)
    self.init = placed_init(self._init_layout, mesh=options.mesh)

  def _program(self, state: TrainState, batch: PyTree, *keys):
    o, layout = self.options, self.layouts(state)
    # a fresh key each step, a function of (key, step): resumes draw alike
    keys = tuple(jax.random.fold_in(k, state.step) for k in keys)
    grads_specs = layout.split if o.zero_stage else layout.specs.params
    loss, grads, aux, model_state = jax.shard_map(
        functools.partial(_local_grads, self.loss_fn, options=o,
                          layout=layout), mesh=o.mesh,
        in_specs=(layout.specs.params, P(), P(o.axis), *(P() for _ in keys)),
        out_specs=(P(), grads_specs, P(), P()))(
            state.params, state.model_state, batch, *keys)
    state, stats = sharded_update(
        state, grads, loss=loss, optimizer=layout.optimizer, mesh=o.mesh,
        state_specs=layout.specs, max_grad_norm=o.max_grad_norm,
        update_specs=layout.split if o.zero_stage == 1 else None,
        model_state=model_state)
    return state, stats._replace(aux=aux)

  def _place(self, state: TrainState, batch: PyTree) -> tuple:
    return (place(state, self.layouts(state).specs, mesh=self.options.mesh),
            jax.device_put(batch, self.batch_sharding), *self.keys)

  def __call__(self, state: TrainState, batch: PyTree):
    with jax.set_mesh(self.options.mesh):
      return self.compiled(*self._place(state, batch))

  def lower(self, state: TrainState, batch: PyTree):
    with jax.set_mesh(self.options.mesh):
      return self.compiled.lower(*self._place(state, batch))

  def _init_layout(self, params: PyTree):
    o = self.options
    layout = self.layouts(jax.eval_shape(
        lambda p: TrainState.create(p, o.optimizer), params))
    return (lambda p: pad(p, layout.specs.params, mesh=o.mesh),
            layout.optimizer, layout.specs)


# -- The legacy pmap step -----------------------------------------------------


class _PmapStep:
  """The legacy ``jax.pmap`` step (replicated state) and ``init``."""

  def __init__(self, options: _Options):
    self.options = options
    mesh, axis = options.mesh, options.axis
    self.n = axis_size(mesh, axis)
    self.loss_fn = _differentiated(options.loss_fn, options)
    devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0)
    self.compiled = jax.jit(jax.pmap(
        self._replica_step, axis_name=axis, in_axes=(None, 0, None),
        out_axes=None, devices=list(devices.reshape(self.n, -1)[:, 0])))

  def _replica_step(self, state: TrainState, batch: PyTree, key):
    o = self.options
    if key is not None:
      key = jax.random.fold_in(key, state.step)
    params = jax.lax.pcast(state.params, o.axis, to='varying')
    loss, grads, aux, _ = microbatched_value_and_grad(
        self.loss_fn, params, state.model_state, batch,
        num_microbatches=o.num_microbatches, axis=o.axis, key=key)
    loss, grads, aux = jax.lax.pmean((loss, grads, aux), o.axis)
    state, stats = apply_gradients(state, grads, loss=loss,
                                   optimizer=o.optimizer,
                                   max_grad_norm=o.max_grad_norm)
    return state, stats._replace(aux=aux)

  def _split(self, batch: PyTree) -> PyTree:
    n = self.n
    return jax.tree.map(
        lambda x: jnp.reshape(x, (n, x.shape[0] // n, *x.shape[1:])), batch)

  def __call__(self, state: TrainState, batch: PyTree):
    return self.compiled(state, self._split(batch), self.options.key)

  def lower(self, state: TrainState, batch: PyTree):
    return self.compiled.lower(state, self._split(batch), self.options.key)

  def init(self, params: PyTree, model_state: PyTree = None) -> TrainState:
    return TrainState.create(params, self.options.optimizer, model_state)


# -- The checks of a step's inputs --------------------------------------------


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


def _check_batch_size(batch: PyTree, options: _Options) -> int:
  """The batch size, ``ValueError`` unless ``N x num_microbatches`` divides it."""
  size = batch_size_of(batch)
  per_step = axis_size(options.mesh, options.axis) * options.num_microbatches
  if size % per_step:
    raise ValueError(
        f'batch size {size} is not divisible by {options.axis} size '
        f'{per_step // options.num_microbatches} x num_microbatches '
        f'{options.num_microbatches} = {per_step}; use a batch size that is '
        f'a multiple of {per_step} (e.g. {max(1, size // per_step) * per_step}).')
  return size // per_step


def _check_model(state: TrainState, batch: PyTree, microbatch: int,
                 options: _Options) -> None:
  """The optimizer state and ``loss_fn`` on one microbatch, on logical,
  unsharded shapes (user code need not be valid under sharding types)."""
  logical = logical_shapes(state)
  check_float_params(logical.params)
  check_opt_state(logical, options.optimizer)
  check_update_args(options.optimizer, logical.params, logical.opt_state)
  micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (microbatch, *np.shape(x)[1:]), _dtype(x)), batch)
  loss_fn = options.loss_fn
  if options.compute_dtype is not None:
    loss_fn = cast_params(loss_fn, options.compute_dtype)
  check_loss_fn(loss_fn, logical.params, micro, has_aux=options.has_aux,
                key=options.key, model_state=logical.model_state,
                carries_state=options.carries_state, mesh=options.mesh)


class _CheckedStep:
  """``step(state, batch)`` (and ``.lower``) with the eager checks first:
  the batch every call, the state and ``loss_fn`` once per signature."""

  def __init__(self, step: _ShardMapStep | _PmapStep, options: _Options):
    self.step, self.options = step, options
    self.checked: set = set()

  def _check(self, state: TrainState, batch: PyTree) -> None:
    if not isinstance(state, TrainState):
      raise TypeError(f'state must be a jaxpar.TrainState (see '
                      f'Trainer.init or TrainState.create), got '
                      f'{type(state).__name__}.')
    microbatch = _check_batch_size(batch, self.options)
    key = signature((state, batch))
    if key not in self.checked:
      _check_model(state, batch, microbatch, self.options)
      self.checked.add(key)

  def __call__(self, state: TrainState, batch: PyTree
               ) -> tuple[TrainState, StepStats]:
    self._check(state, batch)
    return self.step(state, batch)

  def lower(self, state: TrainState, batch: PyTree):
    self._check(state, batch)
    return self.step.lower(state, batch)


def _checked_init(init: Callable[..., TrainState], params: PyTree,
                  model_state: PyTree = None) -> TrainState:
  """``Trainer.init``: float params (``check_float_params``), then ``init``."""
  check_float_params(params)
  return init(params, model_state)


def _logical_params(state: TrainState) -> PyTree:
  """``state.params`` at their logical shapes, as sharded (``auto_view``)."""
  return auto_view(unpadded(state.params))


def _logical_opt_state(state: TrainState) -> PyTree:
  """``state.opt_state`` laid out as ``_logical_params``: logical shapes, the
  same mesh (``Trainer.opt_state``)."""
  return auto_view(unpadded(state.opt_state))


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
    key: jax.Array | None = None,
    compute_dtype: Any = None,
    remat_policy: Any = None,
) -> Trainer:
  """Data-parallel training, exactly single-device optax on the global batch.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over the
      examples of ``batch`` (``(scalar, aux)`` with ``has_aux``; aux leaves are
      float and are averaged like the loss); ``loss_fn(params, batch, key)``
      with a ``key``. Or a Flax NNX model's ``DataParallelModel``
      (``from_nnx(model, loss=...)``): its model state (BatchNorm
      statistics) is carried in ``TrainState.model_state``, threaded through
      each device's microbatches in order and merged over ``axis`` as
      ``jaxpar.data_parallel.from_nnx`` says.
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
      over ``axis``, 3 the params too (FSDP); see ``jaxpar.data_parallel``.
      Needs ``backend='shard_map'``.
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    backend: ``'shard_map'`` or ``'pmap'`` (legacy; same results; every
      option but ``zero_stage``).
    key: a PRNG key (``jax.random.key(seed)``) for dropout, or ``None``.
      Step ``s`` (``s = state.step``) uses ``k_s = fold_in(key, s)``, so a
      resumed run draws the same masks. The global batch of ``B`` rows is
      ``M = N * k`` microbatches of ``B/M`` consecutive rows; microbatch
      ``g`` (rows ``g*B/M`` to ``(g+1)*B/M``; device ``d``'s ``i``-th is
      ``g = d*k + i``) runs ``loss_fn(params, batch_g, fold_in(k_s, g))``.
      So the masks depend on the rows and on ``M``, not on the mesh: the
      same for any ``N`` and ``k`` with the same ``N * k``, and those of
      ``mean_g loss_fn(params, batch_g, fold_in(k_s, g))`` on one device.
    compute_dtype: e.g. ``jnp.bfloat16``: ``loss_fn`` runs on params cast
      to it (inside the function, so activations and the backward are in
      it); params, optimizer state, loss, aux and gradient accumulation stay
      float32 (at least). ``None``: the params' dtype.
    remat_policy: ``None`` (default): no remat, the backward keeps what JAX
      keeps. Else ``loss_fn`` runs under ``jax.checkpoint`` with this
      policy, named as ``jaxpar.train_state.POLICIES``
      (``stash_policy``): ``'nothing'`` (recompute the forward in the
      backward), ``'dots'``, ``'dots_no_batch'``, ``'everything'`` (no
      remat), or a ``jax.checkpoint_policies`` policy. ZeRO-3 still
      re-gathers the params in the backward whatever the policy.

  Returns:
    ``Trainer(init, step, params, opt_state)``: ``init(params,
    model_state=None)`` gives a placed ``TrainState`` in the ``zero_stage``
    layout (the model state replicated); ``step(state, batch) ->
    (state, StepStats)`` takes a batch pytree of numpy or jax arrays with
    leading size ``B`` (placed on the mesh by the step; any state is placed
    into the step's layout); ``stats.loss`` is the global mean before the
    update, ``stats.grad_norm`` the global norm before clipping;
    non-finite loss or gradients skip the update (``stats.skipped``).
    ``params(state)`` returns ``state.params`` at their logical shapes as
    they are sharded (``train_state.auto_view``: nothing is replicated but
    the leaves ZeRO pads): the one way to read a state's params;
    ``opt_state(state)`` the optimizer state likewise. The optimizer's
    update gets the loss as ``value=`` (``train_state.apply_gradients``).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxpar
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
    >>> trainer.params(state)['w'].shape
    (8, 2)

    Dropout, computed in bfloat16:

    >>> def dropout_loss(p, b, key):
    ...   h = b['x'] * jax.random.bernoulli(key, 0.9, b['x'].shape) / 0.9
    ...   return jnp.mean((h @ p['w'] - b['y']) ** 2)
    >>> trainer = jaxpar.data_parallel.trainer(
    ...     dropout_loss, optax.sgd(0.1), mesh=jaxpar.make_mesh(data=8),
    ...     key=jax.random.key(0), compute_dtype=jnp.bfloat16)
    >>> state, stats = trainer.step(trainer.init({'w': jnp.ones((8, 2))}),
    ...                             batch)
    >>> stats.loss.dtype, state.params['w'].dtype
    (dtype('float32'), dtype('float32'))
  """
  options = _check_options(
      loss_fn, optimizer, mesh=mesh, axis=axis, max_grad_norm=max_grad_norm,
      num_microbatches=num_microbatches, zero_stage=zero_stage,
      has_aux=has_aux, backend=backend, key=key, compute_dtype=compute_dtype,
      remat_policy=remat_policy)
  step = (_PmapStep if backend == 'pmap' else _ShardMapStep)(options)
  return Trainer(functools.partial(_checked_init, step.init),
                 _CheckedStep(step, options), _logical_params,
                 _logical_opt_state)
