"""The training state, step statistics, ``Trainer``, the update, the skip guard.

Every jaxpar train step has one shape, like optax's ``(init, update)`` pair:
``Trainer(init, step, params)``. Every step also ends in the same update,
``apply_gradients``: ``optimizer.update`` on the *global* (sharded) arrays,
under ``jit``, so that XLA's partitioner inserts whatever collectives an
optax transform needs (a global norm, LAMB's per-leaf trust ratios,
Adafactor's factored moments, Muon's matrix products). Any optax
``GradientTransformation`` therefore gives single-device results under any
sharding; the sharding only decides where the bytes live.

**The skip guard.** Every jaxpar train step skips an update whose loss or
gradient is not finite (``StepStats.skipped``): one bad batch costs one step.
Many in a row mean the run has diverged (or the data is broken) and further
steps only burn time. ``count_skipped`` keeps the count in a small NamedTuple
and raises ``TooManySkippedError`` after ``max_skipped`` consecutive skips, so
the loop stops before it saves anything: the last good checkpoint stays the
newest (``jaxpar.checkpoint.save`` also refuses non-finite params).

Example:
  >>> import jaxpar
  >>> count = jaxpar.SkipCount()
  >>> for skipped in [False, True, False]:       # e.g. stats from a step
  ...   count = jaxpar.count_skipped(count, skipped, max_skipped=2)
  >>> count
  SkipCount(consecutive=0, total=1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar._validate import check_int

__all__ = [
    'POLICIES', 'SkipCount', 'StepStats', 'TooManySkippedError', 'TrainState',
    'Trainer', 'apply_gradients', 'cast_params', 'check_remat_policy',
    'check_update_args', 'count_skipped', 'global_norm', 'sharded_update',
]

PyTree = Any


def check_optimizer(optimizer: Any) -> optax.GradientTransformation:
  """``optimizer`` as an optax ``GradientTransformation``, else ``TypeError``.

  ``optax.MultiSteps`` (a wrapper class) gives its
  ``gradient_transformation()``.

  Example:
    >>> import optax, jaxpar
    >>> opt = jaxpar.train_state.check_optimizer(
    ...     optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
    >>> isinstance(opt, optax.GradientTransformation)
    True
  """
  if isinstance(optimizer, optax.MultiSteps):
    optimizer = optimizer.gradient_transformation()
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(
        f'optimizer must be an optax.GradientTransformation (e.g. '
        f'optax.adam(1e-3)), got {type(optimizer).__name__}: {optimizer!r}.')
  return optimizer


def check_max_grad_norm(max_grad_norm: Any) -> None:
  """``TypeError``/``ValueError`` unless ``max_grad_norm`` is None or > 0."""
  if max_grad_norm is None:
    return
  if isinstance(max_grad_norm, bool) or not isinstance(
      max_grad_norm, (int, float)) and not (
          hasattr(max_grad_norm, 'dtype') and jnp.ndim(max_grad_norm) == 0):
    raise TypeError(f'max_grad_norm must be a number or None, got '
                    f'{type(max_grad_norm).__name__}: {max_grad_norm!r}.')
  if not max_grad_norm > 0:
    raise ValueError(
        f'max_grad_norm={max_grad_norm!r} must be > 0, or None for no '
        'clipping.')


def check_update_args(optimizer: optax.GradientTransformation,
                      params: PyTree, opt_state: PyTree) -> None:
  """``TypeError`` if ``optimizer.update`` needs an argument the step lacks.

  The step calls ``optimizer.update(grads, opt_state, params, value=loss)``
  (``apply_gradients``); a transform that requires more keyword arguments
  (``grad`` and ``value_fn`` of optax's line searches, ``optax.lbfgs``)
  cannot run in it. Abstract evaluation only (``jax.eval_shape``) on ``params``-shaped
  gradients.

  Example:
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> params = {'w': jnp.ones(3)}
    >>> opt = optax.contrib.reduce_on_plateau()
    >>> jaxpar.train_state.check_update_args(opt, params, opt.init(params))
  """
  def update(params, opt_state):
    return optax.with_extra_args_support(optimizer).update(
        params, opt_state, params, value=jnp.zeros((), jnp.float32))
  try:
    jax.eval_shape(update, params, opt_state)
  except TypeError as e:
    if 'required keyword-only argument' not in str(e):
      raise
    raise TypeError(
        f"optimizer.update needs an argument a train step cannot give ({e}). "
        'Each step calls optimizer.update(grads, opt_state, params, '
        'value=loss): value= is the mean loss of the batch, nothing else is '
        'passed. Use a transform that needs at most value= (e.g. not a line '
        'search, which also needs value_fn=).') from e


class TrainState(NamedTuple):
  """What a train step carries from one step to the next.

  Attributes:
    step: int32 scalar, the number of updates applied so far (skipped,
      non-finite steps do not count).
    params: the model parameters (any pytree).
    opt_state: the optax optimizer state for ``params``.
    model_state: the model's variables that are not trained params (Flax
      NNX ``nnx.BatchStat`` running statistics, counters): the
      forward pass reads them and gives their new values, which every step
      carries to the next (not differentiated, not seen by the optimizer).
      ``None`` (the default) for a model without any.
  """
  step: jax.Array
  params: PyTree
  opt_state: PyTree
  model_state: PyTree = None

  @classmethod
  def create(cls, params: PyTree, optimizer: optax.GradientTransformation,
             model_state: PyTree = None) -> 'TrainState':
    """A fresh state: ``step=0`` and ``opt_state=optimizer.init(params)``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxpar
      >>> state = jaxpar.TrainState.create({'w': jnp.zeros(3)}, optax.sgd(0.1))
      >>> int(state.step), state.model_state
      (0, None)
    """
    optimizer = check_optimizer(optimizer)
    return cls(jnp.zeros((), jnp.int32), params, optimizer.init(params),
               model_state)


class StepStats(NamedTuple):
  """Statistics of one train step, as device arrays (no host sync).

  Attributes:
    loss: global mean loss over the batch, before the update.
    grad_norm: global L2 norm of the gradient over all shards, before clipping.
    skipped: bool, True when the loss or gradient was non-finite and the
      update was not applied.
    aux: the ``loss_fn`` auxiliary output (``has_aux=True``), averaged over
      microbatches and replicas; ``None`` otherwise.
  """
  loss: jax.Array
  grad_norm: jax.Array
  skipped: jax.Array
  aux: PyTree = None


def stored_opt_state(state: TrainState) -> PyTree:
  """``state.opt_state`` as stored (``Trainer.opt_state``'s default)."""
  return state.opt_state


class Trainer(NamedTuple):
  """The pure functions of a training run, the one shape of every train step.

  Returned by ``jaxpar.data_parallel.trainer`` and
  ``jaxpar.parallel.trainer``.

  Attributes:
    init: ``init(params, model_state=None) -> TrainState``, placed and
      sharded on the mesh as the step expects it (ZeRO shardings included);
      ``model_state`` (``TrainState.model_state``) is stored replicated.
    step: ``step(state, batch) -> (state, StepStats)``, jitted; accepts plain
      (numpy or unplaced) arrays and places them; ``step.lower(state, batch)``
      gives the lowered program (for ``.compile().memory_analysis()``).
    params: ``params(state)`` -> the params in model order, as global arrays
      that keep their sharding (nothing is replicated: ``np.asarray(leaf)``
      gathers one leaf to the host, a jitted function uses them in place).
    opt_state: ``opt_state(state)`` -> the optimizer state laid out like
      ``params(state)`` (model order, logical shapes, the same mesh), as
      ``optimizer.init(params(state))`` would shape it: what optax's helpers
      take with the params, e.g.
      ``optax.contrib.schedule_free_eval_params(trainer.opt_state(state),
      trainer.params(state))``. Default: ``state.opt_state`` as stored.

  Example:
    >>> import jax.numpy as jnp, numpy as np, optax, jaxpar
    >>> loss_fn = lambda p, b: jnp.mean((b['x'] @ p['w'] - b['y']) ** 2)
    >>> trainer = jaxpar.data_parallel.trainer(
    ...     loss_fn, optax.adam(1e-3), mesh=jaxpar.make_mesh(data=8))
    >>> state = trainer.init({'w': jnp.zeros((4, 2))})
    >>> batch = {'x': np.ones((16, 4), np.float32),
    ...          'y': np.ones((16, 2), np.float32)}
    >>> state, stats = trainer.step(state, batch)
    >>> trainer.params(state)['w'].shape, int(state.step)
    ((4, 2), 1)
    >>> trainer.opt_state(state)[0].mu['w'].shape      # Adam's first moment
    (4, 2)
  """
  init: Callable[..., TrainState]
  step: Callable[[TrainState, PyTree], tuple[TrainState, StepStats]]
  params: Callable[[TrainState], PyTree]
  opt_state: Callable[[TrainState], PyTree] = stored_opt_state


def global_norm(tree: PyTree) -> jax.Array:
  """L2 norm over all leaves, accumulated in float32 or wider.

  ``sqrt(sum_leaves sum(x^2))``, each leaf cast to
  ``promote_types(dtype, float32)`` first, so bfloat16 gradients do not lose
  the sum. On global sharded arrays under ``jit`` XLA adds the all-reduce:
  the norm is over all shards. Equals ``optax.tree.norm`` in float32/64.

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> float(jaxpar.train_state.global_norm({'a': jnp.array([3.0, 4.0])}))
    5.0
  """
  squares = [jnp.sum(jnp.square(x.astype(jnp.promote_types(x.dtype,
                                                            jnp.float32))))
             for x in jax.tree.leaves(tree)]
  return jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32)))


def apply_gradients(state: TrainState, grads: PyTree, *, loss: jax.Array,
                    optimizer: optax.GradientTransformation,
                    max_grad_norm: float | None = None,
                    update_specs: PyTree | None = None,
                    model_state: PyTree = None
                    ) -> tuple[TrainState, StepStats]:
  """One optimizer update with global-norm clipping and non-finite skipping.

  The one update rule every jaxpar train step shares, on global arrays
  (``grads`` of the global mean loss)::

    |g| = global_norm(g)                      before clipping (StepStats)
    g  <- optax.clip_by_global_norm(max_grad_norm)(g)      if max_grad_norm
    params, opt_state <- optimizer.update(g, opt_state, params, value=loss)

  so ``max_grad_norm=c`` equals ``optax.chain(optax.clip_by_global_norm(c),
  optimizer)``. ``value=loss`` is optax's convention for the transforms
  whose update takes the loss (``GradientTransformationExtraArgs``:
  ``optax.contrib.reduce_on_plateau``, ``momo``); the others ignore it
  (``optax.with_extra_args_support``). If ``loss`` or ``|g|`` is not finite
  the update is skipped: params, optimizer state, model state and step come
  back unchanged.

  Args:
    state: the ``TrainState`` before the step.
    grads: gradient of the mean loss, shaped like ``state.params``.
    loss: the mean loss: its finiteness gates the update, and it is the
      ``value=`` of the optimizer's update.
    optimizer: any optax ``GradientTransformation``.
    max_grad_norm: clip to this global norm; ``None``: no clipping.
    update_specs: optional ``PartitionSpec`` tree for ``state.params`` under
      which the update runs (ZeRO-1: each device updates the ``1/N`` of the
      params whose optimizer state it holds); only inside ``auto_axes``.
    model_state: the model state the forward pass gave (the new
      ``state.model_state``, kept only if the step is); ``None``: unchanged.

  Returns:
    ``(new_state, StepStats(loss, grad_norm, skipped))``.

  Example:
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> state = jaxpar.TrainState.create({'w': jnp.ones(2)}, optax.sgd(0.5))
    >>> new, stats = jaxpar.train_state.apply_gradients(
    ...     state, {'w': jnp.ones(2)}, loss=jnp.float32(1.0),
    ...     optimizer=optax.sgd(0.5))
    >>> new.params['w'].tolist(), int(new.step)
    ([0.5, 0.5], 1)
  """
  grad_norm = global_norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  new_state = _updated(state, grads, grad_norm, ok, loss, optimizer=optimizer,
                       max_grad_norm=max_grad_norm, update_specs=update_specs,
                       model_state=model_state)
  return _kept(ok, new_state, state), StepStats(loss, grad_norm, ~ok)


def _after_gradients(tree: PyTree, ok: jax.Array) -> PyTree:
  """``tree``'s arrays as values computed from ``ok`` (equal where ``ok``).

  ``ok`` is computed from the gradients (their norm), so everything that
  reads the result -- collectives that reshard the params or take their
  norm -- runs after the whole gradient computation, also on XLA:CPU: its
  runtime orders one device's collectives by launch only, and a loop of
  collectives (the pipeline's tick scan) counts as launched once its first
  iteration goes asynchronous, so a collective that does not depend on the
  loop's result can run beside it, in a different order on each device,
  until the blocked threads exhaust the thread pool and the rendezvous
  aborts (``docs/reliability.md``). An ``optimization_barrier`` orders HLO,
  not XLA:CPU's runtime (it reuses the buffers); a select does. Where ``ok``
  is false the values are zeros: the update is skipped and its result
  discarded (``_kept``). Non-numeric leaves (PRNG keys) pass unchanged.
  """
  def gate(x):
    if not isinstance(x, jax.Array) or not (
        jnp.issubdtype(x.dtype, jnp.number) or x.dtype == jnp.bool_):
      return x
    return jnp.where(ok, x, jnp.zeros_like(x))
  return jax.tree.map(gate, tree)


def _updated(state: TrainState, grads: PyTree, grad_norm: jax.Array,
             ok: jax.Array, loss: jax.Array, *,
             optimizer: optax.GradientTransformation,
             max_grad_norm: float | None, update_specs: PyTree | None,
             model_state: PyTree) -> TrainState:
  """The state after the update, as if ``ok`` (the caller keeps the old one
  where not: ``_kept``); its inputs pass ``_after_gradients`` first."""
  if max_grad_norm is not None:
    # optax.clip_by_global_norm's rule, with the norm computed once.
    grads = jax.tree.map(
        lambda g: jnp.where(grad_norm < max_grad_norm, g,
                            g / grad_norm.astype(g.dtype) * max_grad_norm
                            ).astype(g.dtype), grads)
  params, opt_state = _after_gradients((state.params, state.opt_state), ok)
  if update_specs is not None:
    params = jax.lax.with_sharding_constraint(params, update_specs)
  updates, opt_state = optax.with_extra_args_support(optimizer).update(
      grads, opt_state, params, value=loss)
  new_params = optax.apply_updates(params, updates)
  if update_specs is not None:  # the update's slices, gathered once
    new_params = jax.lax.with_sharding_constraint(new_params, update_specs)
  return TrainState(state.step, new_params, opt_state,
                    state.model_state if model_state is None else model_state)


def _kept(ok: jax.Array, new: TrainState, old: TrainState) -> TrainState:
  """``new`` where ``ok``, else ``old`` (the step counts only if ``ok``); same
  dtypes out as in, never weakly typed, so the next step hits the cache.
  ``new`` and ``old`` are laid out alike: a select, no collective."""
  keep = lambda n, o: jax.lax.convert_element_type(jnp.where(ok, n, o),
                                                  o.dtype)
  return TrainState(old.step + ok.astype(old.step.dtype),
                    *(jax.tree.map(keep, n, o) for n, o in zip(new[1:], old[1:])))


def shardings(mesh: Mesh, specs: PyTree) -> PyTree:
  """``NamedSharding(mesh, spec)`` for every ``PartitionSpec`` of ``specs``."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda s: isinstance(s, P))


def auto_view(tree: PyTree) -> PyTree:
  """``tree``'s arrays with the same shards on their mesh's ``Auto``-axes twin.

  Arrays on ``Explicit`` axes carry their sharding in their type, and
  ``jnp`` code that slices a sharded dim must then say where the result
  goes. The same shards on ``Auto`` axes let any code run (XLA's
  partitioner decides), and nothing is replicated: this is what
  ``Trainer.params`` returns for evaluation and checkpoints.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> x = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(
    ...     jaxpar.make_mesh(data=8), P('data')))
    >>> y = jaxpar.train_state.auto_view(x)
    >>> y.sharding.spec, float(y[3])
    (P('data',), 3.0)
  """
  def one(x):
    sharding = getattr(x, 'sharding', None)
    if not isinstance(sharding, NamedSharding):
      return x
    return jax.device_put(x, NamedSharding(_auto(sharding.mesh),
                                           sharding.spec))
  return jax.tree.map(one, tree)


def _auto(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis ``Auto``."""
  return Mesh(mesh.devices, mesh.axis_names,
              axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def sharded_update(state: TrainState, grads: PyTree, *, loss: jax.Array,
                   optimizer: optax.GradientTransformation, mesh: Mesh,
                   state_specs: TrainState,
                   max_grad_norm: float | None = None,
                   update_specs: PyTree | None = None,
                   model_state: PyTree = None
                   ) -> tuple[TrainState, StepStats]:
  """``apply_gradients`` on global arrays, partitioned by XLA (inside ``jit``).

  Runs under ``jax.sharding.auto_axes``: inside, the mesh axes are ``Auto``
  and XLA's SPMD partitioner inserts the collectives every transform needs;
  the new state comes out with ``state_specs`` (the shardings it went in with).
  ``model_state`` as ``apply_gradients``'s (laid out as
  ``state_specs.model_state``). Call it inside ``jax.set_mesh(mesh)``.
  """
  def update(state, grads, loss, model_state):
    grad_norm = global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    return _updated(state, grads, grad_norm, ok, loss, optimizer=optimizer,
                    max_grad_norm=max_grad_norm, update_specs=update_specs,
                    model_state=model_state), grad_norm, ok
  replicated = NamedSharding(mesh, P())
  out = (shardings(mesh, state_specs), replicated, replicated)
  new, grad_norm, ok = jax.sharding.auto_axes(update, out_sharding=out)(
      state, grads, loss, model_state)
  # Both laid out as state_specs: the select needs no collective that reads
  # the old state alone (``_after_gradients``).
  return _kept(ok, new, state), StepStats(loss, grad_norm, ~ok)


def signature(tree: PyTree) -> tuple:
  """What a tree's shardings and programs depend on: its structure, shapes and
  dtypes (a cache key; the values do not enter it)."""
  return (jax.tree.structure(tree),
          tuple((np.shape(x), x.dtype if hasattr(x, 'dtype')
                 else np.result_type(x)) for x in jax.tree.leaves(tree)))


def _on_mesh(x: Any, mesh: Mesh) -> Any:
  """``x`` as an input of a program on ``mesh``.

  Host values stay as they are (the program copies each device its part);
  an array elsewhere (one device, another mesh) is copied whole to every
  device of ``mesh``: a copy needs no program, while moving it into a split
  sharding compiles one per shape (``jax.device_put``'s ``_multi_slice``).
  """
  if isinstance(x, jax.Array) and not (
      isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh):
    return jax.device_put(x, NamedSharding(mesh, P()))
  return x


def _init_program(prepare: Callable[[PyTree], PyTree],
                  optimizer: optax.GradientTransformation, specs: TrainState,
                  mesh: Mesh) -> Callable[[PyTree, PyTree], TrainState]:
  """One jitted ``(params, model_state) -> TrainState``: ``prepare``, then
  the params split as stored (``specs.params``), then ``optimizer.init`` on
  the sharded params (the optimizer state is born sharded), the state placed
  by ``specs``."""
  out = shardings(mesh, specs)

  def create(params, model_state):
    state = TrainState(jnp.zeros((), jnp.int32), params,
                       optimizer.init(params), model_state)
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, x.dtype),
                        state)  # not weakly typed, as the step's output

  def placed(params, model_state):
    params = jax.device_put(prepare(params), out.params)
    return jax.sharding.auto_axes(create, out_sharding=out)(params,
                                                            model_state)
  return jax.jit(placed)


def replicated_specs(tree: PyTree) -> PyTree:
  """``P()`` for every leaf of ``tree`` (how ``model_state`` is stored)."""
  return jax.tree.map(lambda _: P(), tree)


def placed_init(
    storage: Callable[[PyTree], tuple[Callable[[PyTree], PyTree],
                                      optax.GradientTransformation,
                                      TrainState]],
    *, mesh: Mesh) -> Callable[..., TrainState]:
  """``init(params, model_state=None) -> TrainState``: a fresh state on ``mesh``.

  ``storage(params) -> (prepare, optimizer, specs)`` (called once per params
  signature, on shapes): ``prepare`` (pure ``jnp``) turns the params as given
  into the params as stored (e.g. padded, in a rank placement), ``optimizer``
  inits them and ``specs`` are the state's ``PartitionSpec``s. The
  ``model_state`` is stored replicated. Each signature is one jitted program
  (``_init_program``), compiled once per trainer: no per-leaf eager op
  compiles.
  """
  programs = {}

  def init(params: PyTree, model_state: PyTree = None) -> TrainState:
    key = signature((params, model_state))
    if key not in programs:
      prepare, optimizer, specs = storage(params)
      specs = specs._replace(model_state=replicated_specs(model_state))
      programs[key] = _init_program(prepare, optimizer, specs, mesh)
    params, model_state = jax.tree.map(lambda x: _on_mesh(x, mesh),
                                       (params, model_state))
    with jax.set_mesh(mesh):
      return programs[key](params, model_state)
  return init


# ------------------------------------------------------------------ options
# What every trainer takes (data_parallel, parallel, the pipeline executor),
# checked and meant the same way in each.


# Only jax's policies: one that also saved what collectives produce would
# turn ZeRO-3's gathered params into residuals of the params alone, which
# XLA then hoists out of the pipeline's tick loop and keeps (+55% scratch
# measured).
POLICIES: dict[str, Callable[..., Any] | None] = {
    'everything': None,   # every residual jax.vjp lists: no recompute
    'dots': jax.checkpoint_policies.dots_saveable,
    'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'nothing': jax.checkpoint_policies.nothing_saveable,   # inputs alone
}


def check_remat_policy(remat_policy: Any, *, default: str | None = None
                       ) -> Callable[..., Any] | None:
  """The ``jax.checkpoint`` policy a trainer's ``remat_policy`` names.

  One meaning in every trainer (``data_parallel.trainer``,
  ``parallel.trainer``, the pipeline executor): what the backward pass keeps
  of the forward, the rest being recomputed.

  Args:
    remat_policy: a name of ``POLICIES`` -- ``'everything'`` (keep every
      residual: no recompute), ``'dots'``
      (``jax.checkpoint_policies.dots_saveable``: matmul outputs kept,
      elementwise work recomputed), ``'dots_no_batch'``
      (``dots_with_no_batch_dims_saveable``: attention scores recomputed),
      ``'nothing'`` (keep the inputs, recompute the forward) -- or any
      ``jax.checkpoint_policies`` policy (e.g.
      ``save_only_these_names('ffn')``), or ``None`` for ``default``.
    default: the name ``None`` stands for (``None``: no policy at all).

  Returns:
    The policy function, or ``None`` for ``'everything'``.

  Raises:
    ValueError: an unknown name. TypeError: neither a name nor callable.

  Example:
    >>> import jax
    >>> from jaxpar.train_state import check_remat_policy
    >>> check_remat_policy('dots') is jax.checkpoint_policies.dots_saveable
    True
    >>> check_remat_policy(None) is None
    True
  """
  if remat_policy is None:
    return None if default is None else POLICIES[default]
  if isinstance(remat_policy, str):
    if remat_policy not in POLICIES:
      raise ValueError(f'remat_policy={remat_policy!r} is not one of '
                       f'{sorted(POLICIES)}; pass one of them or a '
                       'jax.checkpoint_policies policy.')
    return POLICIES[remat_policy]
  if callable(remat_policy):
    return remat_policy
  raise TypeError(f'remat_policy={remat_policy!r} must be a name '
                  f'({sorted(POLICIES)}) or a jax.checkpoint policy.')


def check_key(key: Any) -> None:
  """``TypeError`` unless ``key`` is ``None`` or one PRNG key."""
  if key is None:
    return
  dtype, shape = getattr(key, 'dtype', None), np.shape(key)
  typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
  raw = dtype == np.uint32 and shape == (2,)
  if not (typed and shape == () or raw):
    raise TypeError(
        f'key must be one PRNG key, e.g. jax.random.key(0), got '
        f'{type(key).__name__} {dtype}{list(shape)}: to train with a fresh '
        'key each step pass the step key (the trainers and the executor fold in the '
        'step, microbatch and stage).')


def check_compute_dtype(compute_dtype: Any) -> np.dtype | None:
  """``None`` or a floating dtype (``'bfloat16'``, ``jnp.bfloat16``, ...)."""
  if compute_dtype is None:
    return None
  try:
    dtype = jnp.dtype(compute_dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f'compute_dtype={compute_dtype!r} must be None (compute in the '
        "params' dtype) or a floating dtype, e.g. jnp.bfloat16 or "
        "'bfloat16'.")
  return dtype


def cast_params(fn: Callable[..., Any], dtype: Any) -> Callable[..., Any]:
  """``fn`` on its first argument (the params) cast to ``dtype``.

  The cast is part of the stage, so ``StageVJP`` finds the cast params to
  depend on the params alone and recomputes them rather than stash them;
  its transpose casts the params' cotangents back to their dtype.
  """
  return lambda params, *args: fn(optax.tree.cast(params, dtype), *args)


# -------------------------------------------------------------- skip guard


class SkipCount(NamedTuple):
  """Skipped steps so far: the current run of consecutive ones, and all."""
  consecutive: int = 0
  total: int = 0


class TooManySkippedError(RuntimeError):
  """``max_skipped`` consecutive steps were skipped as non-finite."""


def count_skipped(count: SkipCount, skipped: StepStats | Any, *,
                  max_skipped: int = 5, step: int | None = None) -> SkipCount:
  """Adds one step to ``count``; raises after ``max_skipped`` skips in a row.

  Args:
    count: the count so far (``SkipCount()`` to start).
    skipped: the step's ``StepStats`` (its ``skipped`` field is read: one
      host sync) or a bool.
    max_skipped: consecutive skipped steps allowed, an int ``>= 1``.
    step: the step number, for the message.

  Returns:
    The new ``SkipCount``.

  Raises:
    TooManySkippedError: the ``max_skipped``-th consecutive skipped step.
    TypeError / ValueError: a bad ``count``, ``skipped`` or ``max_skipped``.

  Example:
    >>> import jaxpar
    >>> c = jaxpar.count_skipped(jaxpar.SkipCount(), True)
    >>> c.consecutive, c.total
    (1, 1)
  """
  if not isinstance(count, SkipCount):
    raise TypeError(f'count must be a jaxpar.SkipCount (start with '
                    f'SkipCount()), got {type(count).__name__}.')
  max_skipped = check_int(
      'max_skipped', max_skipped,
      fix='It counts the consecutive skipped steps allowed.')
  flag = skipped.skipped if isinstance(skipped, StepStats) else skipped
  if np.ndim(flag) != 0 or np.asarray(flag).dtype != bool:
    raise TypeError(f'skipped must be a StepStats or a bool, got '
                    f'{type(skipped).__name__}: {skipped!r}.')
  if not bool(flag):
    return SkipCount(0, count.total)
  count = SkipCount(count.consecutive + 1, count.total + 1)
  if count.consecutive >= max_skipped:
    at = '' if step is None else f', the last at step {step}'
    raise TooManySkippedError(
        f'{count.consecutive} consecutive steps were skipped (non-finite loss '
        f'or gradients){at}; stopped (max_skipped={max_skipped}). The params '
        'are those of the last good step (skipped steps leave them as they '
        'were); lower the learning rate, check the data for NaN/inf, or raise '
        'max_skipped.')
  return count
