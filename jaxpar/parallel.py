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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import tensor_parallel as tp
from jaxpar.data_parallel import batch_size_of
from jaxpar.mesh import axis_size
from jaxpar.pipeline import executor
from jaxpar.pipeline.lower import lower
from jaxpar.pipeline.schedule import Schedule
from jaxpar.train_state import (PyTree, StepStats, TrainState, apply_gradients,
                                check_optimizer)


class PipelineParams(NamedTuple):
  """A pipelined model's params: ``embed`` -> ``stages`` -> ``head``.

  ``stages`` leaves are stacked ``[num_stages, ...]`` in model order (in a
  ``TrainState`` from ``Trainer.init`` they are in the executor's rank
  layout ``[p, v, ...]``; ``Trainer.params`` converts back).
  """
  embed: PyTree
  stages: PyTree
  head: PyTree


class Trainer(NamedTuple):
  """The pure functions of a 3D-parallel training run (like optax's pairs).

  Attributes:
    init: ``init(params: PipelineParams) -> TrainState``, placed and sharded
      on the mesh (stages in rank layout, optimizer state like its params).
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
    # shard_params checks the tensor-parallel sizes and places embed / head.
    embed, stages, head = (tp.shard_params(part, mesh=mesh, axis=tensor_axis,
                                           layout=layout) for part in params)
    stages = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
        executor.stages_to_ranks(stages, schedule), specs.stages)
    params = PipelineParams(embed, stages, head)
    with jax.set_mesh(mesh):
      opt_state = jax.jit(optimizer.init)(params)
    step0 = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
    return TrainState(step0, params, opt_state)

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
    loss, grads = jax.lax.pmean((loss, grads), data_axis)
    grad_norm = global_norm(grads, specs.params)
    state, skipped = apply_gradients(
        state, grads, loss=loss, grad_norm=grad_norm, optimizer=optimizer,
        max_grad_norm=max_grad_norm)
    return state, StepStats(loss, grad_norm, skipped)

  compiled = {}
  batch_sharding = NamedSharding(mesh, P(data_axis))

  def program(state: TrainState):
    # Normalised (P(None,) == P()) so a step's output state hits the cache.
    specs = jax.tree.map(lambda x: _normalized(x.sharding.spec), state)
    key = (jax.tree.structure(state), tuple(jax.tree.leaves(
        specs, is_leaf=lambda s: isinstance(s, P))))
    if key not in compiled:
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
