"""3D parallelism: data x pipeline x tensor on one ``('data', 'stage', 'tensor')`` mesh.

A model is three parts, ``PipelineParams(embed, stages, head)``::

  x    = embed_fn(embed, inputs)                     # before the pipeline
  y    = stage_fn(stages[S-1], ... stage_fn(stages[0], x))   # the pipeline
  loss = loss_fn(head, y, targets)                   # after the last stage

and one train step runs all of it inside a single ``jax.shard_map`` over the
whole mesh:

* **TP** -- the three functions are tensor-parallel (``jaxpar.tensor_parallel``)
  over ``'tensor'``; params are split as ``tensor_parallel.param_specs`` says.
* **PP** -- ``stages`` run through ``jaxpar.pipeline``'s executor over
  ``'stage'`` with any schedule; the embedding is trained through
  ``PipelineGrads.inputs`` (its VJP).
* **DP** -- the batch is split over ``'data'``; loss and gradients are
  ``pmean``-ed over it (params are made data-varying first, so nothing is
  summed implicitly: no N-times gradients).

Then one optax update on the local shards (the optimizer must be elementwise,
as sgd/adam/adamw are) with clipping by the global norm over all shards::

  ||g||^2 = sum_leaves psum_{axes the leaf is split over}(sum(g_leaf^2))

and non-finite steps skipped (``jaxpar.train_state.apply_gradients``). Any
mesh shape computes the same losses and gradients as one device.

**ZeRO-1** (``zero_stage=1``, as ``jaxpar.zero`` does for plain data
parallelism, but on each device's *local* stage/tensor shard): the optimizer
state is also split over ``'data'``, so each data replica keeps ``~1/N`` of it.
A param leaf of global shape ``lead + rest`` (``lead = (p, v)`` for stage
leaves, ``()`` for embed / head) whose local shard has ``r`` elements in
``rest`` gets optimizer-state leaves of shape::

  lead + (size of each mesh axis splitting rest, in order) + (N * c,)
  c = max(1, ceil(r / N)),   spec  P(*lead spec, *those axes, 'data')

e.g. a ``[p, v, d, h]`` stage leaf split ``P('stage', None, None, 'tensor')``
has ``[p, v, T, N*c]`` moments split ``P('stage', None, 'tensor', 'data')``:
each device holds ``[1, v, 1, c]``, its ``rest`` flattened, zero-padded to
``N*c`` and cut into ``N`` pieces. Stage leaves keep their ``[p, v]`` rows, so
``jaxpar.checkpoint.save(..., schedule=)`` reorders them like the params (the
checkpoint then restores onto any schedule with the same ``num_stages`` and
the same data and tensor sizes). Per step and device::

  g = psum_scatter(pad(flat(local grad)), 'data') / N   my [c] slice of the mean
  |g| = sqrt(sum_leaves psum_{leaf axes, 'data'}(sum(g^2)))   padding adds 0
  p, opt = optimizer.update(clip(g), opt, my [c] slice of the local params)
  params = all_gather(p, 'data')[:r].reshape(local shard)

Communication equals the all-reduce of ``zero_stage=0`` (a reduce-scatter
plus an all-gather); the loss, norm, clipping and skipping are the same.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import tensor_parallel as tp
from jaxpar import zero
from jaxpar.data_parallel import batch_size_of
from jaxpar.mesh import axis_size
from jaxpar.pipeline import executor
from jaxpar.pipeline.lower import lower
from jaxpar.pipeline.schedule import Schedule
from jaxpar.pipeline_params import PipelineParams
from jaxpar.train_state import (PyTree, StepStats, TrainState, apply_gradients,
                                check_optimizer)


class Trainer(NamedTuple):
  """The pure functions of a 3D-parallel training run (like optax's pairs).

  Attributes:
    init: ``init(params: PipelineParams) -> TrainState``, placed and sharded
      on the mesh (stages in rank layout, optimizer state like its params,
      or with ``zero_stage=1`` in the ZeRO-1 layout of the module docstring).
    step: ``step(state, (inputs, targets)) -> (state, StepStats)``, jitted;
      ``step.lower(state, batch)`` gives the lowered program.
    params: ``params(state) -> PipelineParams`` in model order (for
      checkpoints, evaluation, ``merge_from_pipeline``).
  """
  init: Callable[[PipelineParams], TrainState]
  step: Callable[[TrainState, tuple], tuple[TrainState, StepStats]]
  params: Callable[[TrainState], PipelineParams]


def _axes(spec: P) -> tuple[str, ...]:
  out = []
  for entry in spec:
    if entry is None:
      continue
    out.extend(entry if isinstance(entry, tuple) else (entry,))
  return tuple(out)


def _normalized(spec: P) -> P:
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def _padded(spec: P, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(spec))


def global_norm(grads: PyTree, specs: PyTree) -> jax.Array:
  """Global L2 norm of sharded ``grads`` inside ``shard_map``.

  Each leaf's squared norm is ``psum``-ed over the mesh axes its
  ``PartitionSpec`` splits it over; replicated leaves count once.
  """
  total = 0.0
  for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(
      specs, is_leaf=lambda s: isinstance(s, P))):
    sq = jnp.sum(jnp.square(g.astype(jnp.promote_types(g.dtype, jnp.float32))))
    axes = _axes(spec)
    total = total + (jax.lax.psum(sq, axes) if axes else sq)
  return jnp.sqrt(total)


ZERO_STAGES = (0, 1)

# Leading dims of each PipelineParams part that ZeRO-1 keeps as they are (a
# stage leaf's [p, v] rank rows); the rest of each local shard is flattened.
_LEAD = PipelineParams(embed=0, stages=2, head=0)


def _map_parts(fn: Callable[..., Any], params: PipelineParams,
               specs: PipelineParams, *rest: PipelineParams) -> PipelineParams:
  """``fn(leaf, spec, lead, *rest_leaves)`` on every leaf of ``params``."""
  return PipelineParams(*(
      jax.tree.map(lambda x, s, *r, lead=lead: fn(x, s, lead, *r),
                   part, spec, *(tree[i] for tree in rest))
      for i, (part, spec, lead) in enumerate(zip(params, specs, _LEAD))))


def _rest_axes(spec: P, ndim: int, lead: int) -> tuple[str, ...]:
  """Mesh axes that split a leaf's dims after its ``lead`` leading ones."""
  return _axes(P(*_padded(spec, ndim)[lead:]))


def _zero_spec(spec: P, ndim: int, lead: int, data_axis: str) -> P:
  """Spec of a leaf's ZeRO-1 optimizer-state leaf (module docstring)."""
  return P(*_padded(spec, ndim)[:lead], *_rest_axes(spec, ndim, lead),
           data_axis)


def _flat_padded(x: jax.Array, lead: int, n: int) -> jax.Array:
  """``x`` as ``[*lead dims, N*c]``: the rest raveled, then zero-padded."""
  flat = x.reshape(x.shape[:lead] + (-1,))
  pad = zero.padded_size(flat.shape[-1], n) - flat.shape[-1]
  return jnp.pad(flat, [(0, 0)] * lead + [(0, pad)])


def _zero_slice(x: jax.Array, spec: P, lead: int, *, axis: str) -> jax.Array:
  """This device's ``[*lead, 1, .., 1, c]`` ZeRO-1 slice of a local shard."""
  n, d = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  flat = _flat_padded(x, lead, n)
  c = flat.shape[-1] // n
  ones = (1,) * len(_rest_axes(spec, x.ndim, lead))
  return jax.lax.dynamic_slice_in_dim(flat, d * c, c, axis=lead).reshape(
      x.shape[:lead] + ones + (c,))


def _scatter_mean(g: jax.Array, spec: P, lead: int, *,
                  axis: str) -> jax.Array:
  """This device's ZeRO-1 slice of the mean over ``axis`` of local grads."""
  n = jax.lax.axis_size(axis)
  mine = jax.lax.psum_scatter(_flat_padded(g, lead, n), axis,
                              scatter_dimension=lead, tiled=True) / n
  ones = (1,) * len(_rest_axes(spec, g.ndim, lead))
  return mine.reshape(g.shape[:lead] + ones + mine.shape[-1:])


def _gather_shard(mine: jax.Array, lead: int, shape: tuple[int, ...], *,
                  axis: str) -> jax.Array:
  """The local shard of ``shape`` from every device's ZeRO-1 slice."""
  flat = mine.reshape(mine.shape[:lead] + mine.shape[-1:])
  full = jax.lax.all_gather(flat, axis, axis=lead, tiled=True, to='invarying')
  return full[..., :math.prod(shape[lead:])].reshape(shape)


def train_step(
    embed_fn: Callable[[PyTree, Any], jax.Array],
    stage_fn: Callable[[PyTree, jax.Array], jax.Array],
    loss_fn: Callable[[PyTree, jax.Array, Any], jax.Array],
    optimizer: optax.GradientTransformation,
    *,
    schedule: Schedule,
    mesh: Mesh,
    stage_mask: np.ndarray | None = None,
    max_grad_norm: float | None = None,
    remat: bool = False,
    layout: dict[str, str] | None = None,
    data_axis: str = 'data',
    stage_axis: str = 'stage',
    tensor_axis: str = 'tensor',
    zero_stage: int = 0,
) -> Trainer:
  """A DP x PP x TP train step for a model given as embed / stages / head.

  Args:
    embed_fn: ``embed_fn(embed_params, inputs) -> x [b, ...]`` (local
      shards; may use collectives over ``tensor_axis``).
    stage_fn: ``stage_fn(one_stage_params, x) -> y``, ``y`` shaped like ``x``.
    loss_fn: ``loss_fn(head_params, y, targets) -> scalar``, the mean loss of
      a microbatch.
    optimizer: an elementwise optax ``GradientTransformation``.
    schedule: a ``jaxpar.pipeline`` schedule with ``num_ranks`` equal to the
      ``stage_axis`` size; its ``num_microbatches`` split each data shard.
    mesh: a ``('data', 'stage', 'tensor')`` mesh (``jaxpar.make_mesh``).
    stage_mask: optional bool array whose shape ``[num_stages, ...]`` is a
      prefix of every stage leaf's shape; ``False`` entries are frozen (their
      gradients are zeroed), e.g. the identity slots of uneven layer splits
      (``jaxpar.models.gpt.PipelineLayout.mask``).
    max_grad_norm: clip by the global norm over all shards; ``None``: no clip.
    remat: recompute stage forwards in the backward (stash stage inputs only).
    layout: tensor-parallel layout of layer names (``tensor_parallel.
      param_specs``); default ``tensor_parallel.DEFAULT_LAYOUT``.
    data_axis, stage_axis, tensor_axis: the mesh axis names.
    zero_stage: 0 (optimizer state sharded like the params) or 1 (ZeRO-1:
      also split over ``data_axis``, ``~1/N`` per data replica; gradients are
      reduce-scattered and params all-gathered, see the module docstring).
      Same losses, norms and params either way; a state only fits the
      ``zero_stage`` of the ``Trainer`` whose ``init`` made it.

  Returns:
    a ``Trainer(init, step, params)``. The batch is ``(inputs, targets)`` with
    leading size ``B`` divisible by ``data size x num_microbatches``.

  Example:
    >>> pp, layout = gpt.split_for_pipeline(gpt.gpt_params(model), num_stages=2)
    >>> trainer = jaxpar.parallel.train_step(
    ...     gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.adam(1e-3),
    ...     schedule=jaxpar.pipeline.one_f_one_b(2, 4), mesh=mesh,
    ...     stage_mask=layout.mask)
    >>> state = trainer.init(pp)
    >>> state, stats = trainer.step(state, (ids, targets))
  """
  for name, fn in (('embed_fn', embed_fn), ('stage_fn', stage_fn),
                   ('loss_fn', loss_fn)):
    if not callable(fn):
      raise TypeError(f'{name} must be callable, got {fn!r}.')
  check_optimizer(optimizer)
  if zero_stage == 3:
    raise NotImplementedError(
        'zero_stage=3 (params sharded over data too) is not implemented for '
        'the 3D train step; use zero_stage=1 (optimizer state sharded), or '
        'jaxpar.data_parallel_step(..., zero_stage=3) without pipeline and '
        'tensor parallelism.')
  if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
    raise ValueError(f'zero_stage={zero_stage!r}; choose 0 (no ZeRO) or 1 '
                     '(optimizer state sharded over the data axis).')
  n_data = axis_size(mesh, data_axis)
  n_stage = axis_size(mesh, stage_axis)
  axis_size(mesh, tensor_axis)
  if not isinstance(schedule, Schedule):
    raise TypeError(f'schedule must be a jaxpar.pipeline.Schedule, got '
                    f'{type(schedule).__name__}.')
  if schedule.num_ranks != n_stage:
    raise ValueError(
        f'schedule {schedule.name!r} has num_ranks={schedule.num_ranks} but '
        f'the mesh axis {stage_axis!r} has size {n_stage}; build the schedule '
        f'with num_ranks={n_stage} or change the mesh.')
  if max_grad_norm is not None and not max_grad_norm > 0:
    raise ValueError(
        f'max_grad_norm={max_grad_norm!r} must be > 0, or None for no clipping.')
  lowered = lower(schedule)
  m = schedule.num_microbatches
  if stage_mask is not None:
    stage_mask = np.asarray(stage_mask, bool)
    if stage_mask.ndim < 1 or stage_mask.shape[0] != schedule.num_stages:
      raise ValueError(
          f'stage_mask has shape {stage_mask.shape}; its leading size must be '
          f'schedule.num_stages={schedule.num_stages}.')
    mask_ranks = np.asarray(executor.stages_to_ranks(stage_mask, schedule))

  def tp_specs(params: PipelineParams) -> PipelineParams:
    """PartitionSpecs of the placed state: stages get the stage axis."""
    specs = PipelineParams(*(tp.param_specs(part, axis=tensor_axis,
                                            layout=layout) for part in params))
    stages = jax.tree.map(
        lambda leaf, s: P(stage_axis, *_padded(s, np.ndim(leaf))),
        params.stages, specs.stages)
    return specs._replace(stages=stages)

  def init(params: PipelineParams) -> TrainState:
    if not isinstance(params, PipelineParams):
      raise TypeError('params must be a jaxpar.parallel.PipelineParams(embed, '
                      f'stages, head), got {type(params).__name__}.')
    executor._check_leading(params.stages, schedule.num_stages,  # pylint: disable=protected-access
                            'params.stages', 'schedule.num_stages')
    if stage_mask is not None:
      for leaf in jax.tree.leaves(params.stages):
        if leaf.shape[:stage_mask.ndim] != stage_mask.shape:
          raise ValueError(
              f'stage_mask shape {stage_mask.shape} is not a prefix of a stage '
              f'leaf shape {leaf.shape}.')
    specs = tp_specs(params)
    for part in params:
      tp.check_divisible(part, mesh=mesh, axis=tensor_axis, layout=layout)
    params = params._replace(
        stages=executor.stages_to_ranks(params.stages, schedule))
    params = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    with jax.set_mesh(mesh):
      opt_state = jax.jit(optimizer.init)(
          zero_slices(params, specs) if zero_stage else params)
    step0 = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
    return TrainState(step0, params, opt_state)

  def zero_specs(params: PipelineParams, specs: PipelineParams
                 ) -> PipelineParams:
    """Specs of the ZeRO-1 slices of ``params`` (placed with ``specs``)."""
    return _map_parts(lambda x, s, lead: _zero_spec(s, np.ndim(x), lead,
                                                    data_axis), params, specs)

  def zero_slices(params: PipelineParams, specs: PipelineParams
                  ) -> PipelineParams:
    """The ZeRO-1 slices of placed ``params``: what the optimizer sees."""
    slices = jax.shard_map(
        lambda p: _map_parts(functools.partial(_zero_slice, axis=data_axis),
                             p, specs),
        mesh=mesh, in_specs=(specs,), out_specs=zero_specs(params, specs))
    return jax.jit(slices)(params)

  def check_opt_state(state: TrainState, specs: PipelineParams) -> None:
    """``ValueError`` unless ``state.opt_state`` has this trainer's layout."""
    like = (jax.eval_shape(lambda p: zero_slices(p, specs), state.params)
            if zero_stage else state.params)
    want = jax.eval_shape(optimizer.init, like)
    shapes = lambda tree: (jax.tree.structure(tree),
                           [np.shape(x) for x in jax.tree.leaves(tree)])
    if shapes(want) != shapes(state.opt_state):
      raise ValueError(
          f'state.opt_state does not have the layout this Trainer '
          f'(zero_stage={zero_stage}) gives optimizer.init: its structure or '
          f'leaf shapes differ. States from a Trainer with another zero_stage, '
          f'mesh or optimizer do not fit; create the state with this '
          f'trainer\'s init (checkpoint.restore onto trainer.init(params)).')

  def to_model_order(state: TrainState) -> PipelineParams:
    params = jax.device_put(state.params, NamedSharding(mesh, P()))
    return params._replace(
        stages=executor.ranks_to_stages(params.stages, schedule))

  def local_step(state: TrainState, inputs, targets, *, specs):
    # Data-varying params: each replica's gradient is its own; pmean below.
    params = jax.lax.pcast(state.params, data_axis, to='varying')
    x, embed_vjp = jax.vjp(embed_fn, params.embed, inputs)
    local_stages = jax.tree.map(lambda a: a[0], params.stages)
    loss, grads = executor.pipeline_step_local(
        stage_fn, loss_fn, local_stages, params.head, x, targets,
        lowered=lowered, axis=stage_axis, remat=remat)
    embed_grads = embed_vjp(grads.inputs)[0]
    stage_grads = grads.stages
    if stage_mask is not None:
      mine = jnp.asarray(mask_ranks)[jax.lax.axis_index(stage_axis)]
      stage_grads = jax.tree.map(
          lambda g: jnp.where(
              mine.reshape(mine.shape + (1,) * (g.ndim - mine.ndim)), g,
              jnp.zeros((), g.dtype)), stage_grads)
    grads = PipelineParams(embed_grads,
                           jax.tree.map(lambda g: g[None], stage_grads),
                           grads.loss)
    if not zero_stage:
      loss, grads = jax.lax.pmean((loss, grads), data_axis)
      grad_norm = global_norm(grads, specs.params)
      state, skipped = apply_gradients(
          state, grads, loss=loss, grad_norm=grad_norm, optimizer=optimizer,
          max_grad_norm=max_grad_norm)
      return state, StepStats(loss, grad_norm, skipped)
    # ZeRO-1: reduce-scatter instead of all-reduce; update my 1/N slice of
    # the local shard, then all-gather the params over the data axis.
    loss = jax.lax.pmean(loss, data_axis)
    grads = _map_parts(functools.partial(_scatter_mean, axis=data_axis),
                       grads, specs.params)
    grad_norm = global_norm(grads, zero_specs(state.params, specs.params))
    mine = _map_parts(functools.partial(_zero_slice, axis=data_axis),
                      state.params, specs.params)
    new, skipped = apply_gradients(
        state._replace(params=mine), grads, loss=loss, grad_norm=grad_norm,
        optimizer=optimizer, max_grad_norm=max_grad_norm)
    params = _map_parts(
        lambda p, _, lead, old: _gather_shard(p, lead, old.shape,
                                              axis=data_axis),
        new.params, specs.params, state.params)
    return new._replace(params=params), StepStats(loss, grad_norm, skipped)

  compiled = {}
  batch_sharding = NamedSharding(mesh, P(data_axis))

  def program(state: TrainState):
    # Normalised (P(None,) == P()) so a step's output state hits the cache.
    specs = jax.tree.map(lambda x: _normalized(x.sharding.spec), state)
    key = (jax.tree.structure(state), tuple(jax.tree.leaves(
        specs, is_leaf=lambda s: isinstance(s, P))))
    if key not in compiled:
      check_opt_state(state, specs.params)
      fn = jax.shard_map(
          lambda s, i, t: local_step(s, i, t, specs=specs), mesh=mesh,
          in_specs=(specs, P(data_axis), P(data_axis)),
          out_specs=(specs, P()))
      compiled[key] = jax.jit(fn)
    return compiled[key]

  def validate(state, batch):
    if not isinstance(state, TrainState):
      raise TypeError('state must be a TrainState from Trainer.init, got '
                      f'{type(state).__name__}.')
    if not (isinstance(batch, tuple) and len(batch) == 2):
      raise TypeError('batch must be a tuple (inputs, targets).')
    size = batch_size_of(batch)
    if size % (n_data * m):
      raise ValueError(
          f'batch size {size} is not divisible by {data_axis} size {n_data} x '
          f'num_microbatches {m} = {n_data * m}; use a multiple of '
          f'{n_data * m}.')

  def place(batch):
    return jax.device_put(batch, batch_sharding)

  def step(state: TrainState, batch: tuple) -> tuple[TrainState, StepStats]:
    validate(state, batch)
    return program(state)(state, *place(batch))

  def lower_step(state: TrainState, batch: tuple):
    validate(state, batch)
    return program(state).lower(state, *place(batch))

  step.lower = lower_step
  return Trainer(init, step, to_model_order)
