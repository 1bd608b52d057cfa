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
from jaxpar.data_parallel._checks import (check_float_params, check_loss_fn,
                                          check_opt_state, dtype_of)
from jaxpar.data_parallel._from_nnx import DataParallelModel
from jaxpar.data_parallel._microbatches import (batch_size_of,
                                                microbatched_value_and_grad)
from jaxpar.data_parallel._model_state import merged, stateful
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
      (microbatch, *np.shape(x)[1:]), dtype_of(x)), batch)
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
