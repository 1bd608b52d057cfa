"""3D parallelism: data x pipeline x tensor on one ``('data', 'stage', 'tensor')`` mesh.

A model is three parts, ``PipelineParams(embed, stages, head)``::

  x    = embed_fn(embed, inputs)                     # before the pipeline
  y    = stage_fn(stages[S-1], ... stage_fn(stages[0], x))   # the pipeline
  loss = loss_fn(head, y, targets)                   # after the last stage

One train step is one jitted program in two parts:

1. **Gradients**, inside one ``jax.shard_map`` over the whole mesh:

   * **TP** -- the three functions are tensor-parallel
     (``jaxpar.tensor_parallel``) over ``'tensor'``; params are split as
     the tensor rules say (``tensor_parallel.param_specs``);
   * **PP** -- ``stages`` run through ``jaxpar.pipeline``'s executor over
     ``'stage'`` with any schedule; the embedding runs per microbatch
     inside stage 0 (``pipeline_value_and_grad_local``'s ``embed_fn``), the
     head in the last stage, so nothing batch-sized is held; one stage rank
     runs the microbatches in turn, as data parallelism does;
   * **DP** -- the batch is split over ``'data'``; the loss is averaged over
     it and the gradients too: ``pmean``, or with ZeRO a reduce-scatter
     (``data_parallel.reduce_gradients``).

2. **The update** on the global, sharded arrays (``jaxpar.train_state.
   sharded_update``): ``optimizer.update`` under ``jit``, partitioned by XLA,
   on the **per-layer view** ``LayerParams(embed, layers, head)``
   (``_layer_view``): ``layers[i]`` is the model's layer ``i`` in
   model order, with the dense model's shapes (a ``True`` entry of
   ``stage_mask``: identity slots of uneven splits are no layer). So *any*
   optax transform -- global-norm clipping, ``lamb``/``lars`` trust ratios,
   ``adafactor``'s factoring, ``muon``, masks by ``ndim`` -- computes what it
   computes on one device for the dense per-layer model, and
   ``opt_state`` holds ``LayerParams`` (e.g. Adam's ``mu``). The stacked
   gradients and params are resharded to the view (an all-to-all over
   ``stage`` per leaf) and the updates back. Non-finite steps are skipped.

**Options.** ``key`` (dropout; masks a function of the seed, the step, the
logical stage and the global microbatch, so the same on every mesh),
``has_aux`` (metrics averaged like the loss, in ``StepStats.aux``) and
``compute_dtype`` (bf16 compute on float32 params and optimizer state).

**Optimizer state** is split like the params' layers: each per-layer leaf
(and each ``embed``/``head`` leaf) over ``tensor`` as its param, and over
``stage`` on one more dim (``data_parallel.data_spec`` with the stage axis;
a layer is one global array, so the stage axis splits it as ZeRO splits
over ``data``), so it is not replicated over ``stage`` or ``tensor``.
Subtrees with ``optax.MaskedNode`` placeholders (``masked``,
``multi_transform``) are split alike (``mirror_specs``); other leaves
(counts, Adafactor's factored moments) are replicated.

**ZeRO** (``zero_stage``; ``jaxpar.data_parallel``): on top of its
stage/tensor split every leaf gets the ``data`` axis on one more dim
(``data_spec``; a stage leaf's ``[p, v]`` rows are never split). A leaf that
no dim divides by the data size ``N`` is stored zero-padded along its
largest dim not split over ``tensor`` (``data_parallel.Padded``, as torch
FSDP does; the optimizer and the user's functions see it unpadded), so each
device holds ``~1/N`` of every leaf, plus at most one padding row:

* ``zero_stage=1`` -- the optimizer state: gradients are reduce-scattered,
  each data replica updates its ``1/N`` and the params are all-gathered;
* ``zero_stage=3`` (FSDP) -- the params too: each ``embed_fn``, ``stage_fn``
  and ``loss_fn`` call all-gathers its params over ``data`` just before it
  runs (``data_parallel.gathered``: forward, and again in the backward pass
  instead of keeping them), and the gather's transpose reduce-scatters the
  gradients. Per microbatch, so it composes with every schedule, including
  interleaved and V-shaped ones with several stages per rank.

A state is a plain ``TrainState`` of global arrays (``Padded`` where
ZeRO pads) whose logical shapes do not depend on the mesh or on
``zero_stage`` (params in the rank placement ``[p, v, ...]``, optimizer state
per layer): ``Trainer.params`` gives them unpadded, ``jaxpar.checkpoint``
saves them unpadded and restores them onto any mesh and any ``zero_stage``,
and a state from one trainer is placed as another trainer stores it by its
``step``. Its ``params`` say their rank placement (a ``PipelineParams``
subclass with a ``placement`` attribute, ``local_stages(schedule)``), so a
trainer whose schedule places stages differently (interleaved -> ZB-V,
same ``[p, v, ...]`` shapes) re-lays them first (exact; the optimizer state
is per layer in model order already); another ``p`` or ``num_stages`` is
refused (restore through ``jaxpar.checkpoint.restore(schedule=)``).

**Tied weights** (``from_nnx``: ``head_loss`` reads ``embed`` params, e.g.
``m.wte.attend``) are one param of ``embed``: the head runs on
``with_tied(head, embed, tied)`` and the gradients of the two uses are
summed (both are replicated over ``stage``, after the executor's ``psum``),
so the optimizer, the global norm, ZeRO and checkpoints see it once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import data_parallel as zero
from jaxpar import tensor_parallel as tp
from jaxpar.data_parallel import batch_size_of, check_opt_state
from jaxpar.mesh import axis_size
from jaxpar.parallel._gradients import gradient_program, tied_paths
from jaxpar.parallel._layer_view import in_model_order
from jaxpar.parallel._params import PipelineParams
from jaxpar.parallel._placement import (placed, relaid,
                                        stages_in_model_order)
from jaxpar.parallel._plan import (Axes, Plan, make_plan, optimizer_view,
                                   padded_optimizer, param_specs,
                                   specs_of_state)
from jaxpar.pipeline import executor
from jaxpar.pipeline.executor import check_leading
from jaxpar.pipeline.schedules import Schedule
from jaxpar.train_state import (PyTree, StepStats, Trainer, TrainState,
                                auto_view, check_update_args, placed_init,
                                sharded_update, signature)


def trainer(
    embed_fn: Callable[[PyTree, Any], jax.Array],
    stage_fn: Callable[[PyTree, jax.Array], jax.Array],
    loss_fn: Callable[[PyTree, jax.Array, Any], jax.Array] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    *,
    schedule: Schedule,
    mesh: Mesh,
    stage_mask: np.ndarray | None = None,
    max_grad_norm: float | None = None,
    tensor_rules: Mapping[str, Any] | None = None,
    data_axis: str = 'data',
    stage_axis: str = 'stage',
    tensor_axis: str = 'tensor',
    zero_stage: int = 0,
    key: jax.Array | None = None,
    has_aux: bool = False,
    compute_dtype: Any = None,
    remat_policy: Any = None,
) -> Trainer:
  """A DP x PP x TP trainer for a model given as embed / stages / head.

  Args:
    embed_fn: ``embed_fn(embed_params, inputs) -> x [b, ...]`` (local
      shards; may use collectives over ``tensor_axis``). Or a
      ``PipelineModel`` (``from_nnx``) in place of the three functions:
      ``trainer(pm, optimizer, *, schedule, mesh, ...)`` with its
      ``stage_mask``. Its ``tensor_specs`` (``from_nnx(tensor_rules=...)`` or
      the model's Flax annotations) split params over ``tensor_axis``; the
      model's layers run as written and XLA partitions them (the gradient
      ``shard_map`` is manual over ``data_axis`` and ``stage_axis`` only).
    stage_fn: ``stage_fn(one_stage_params, x) -> y``, ``y`` shaped like ``x``;
      with a ``model_state`` (``init(params, model_state)``: state that is
      not a param, e.g. BatchNorm running statistics)
      ``stage_fn(one_stage_params, x, [key,] state) -> (y, new_state)``.
    loss_fn: ``loss_fn(head_params, y, targets) -> scalar``, the mean loss of
      a microbatch.
    optimizer: any optax ``GradientTransformation``; its ``init`` and
      ``update`` see global arrays in the per-layer view
      ``LayerParams(embed, [layer_0, ..., layer_{L-1}], head)``: one tree per
      real layer in model order, shaped like the dense model's layer, so
      per-leaf statistics (LAMB, LARS, Adafactor, Muon) and shape rules see
      what they see on one device. ``state.opt_state`` holds that view.
    schedule: a ``jaxpar.pipeline`` schedule with ``num_ranks`` equal to the
      ``stage_axis`` size; its ``num_microbatches`` split each data shard.
    mesh: a ``('data', 'stage', 'tensor')`` mesh (``jaxpar.make_mesh``).
    stage_mask: optional bool array whose shape ``[num_stages, ...]`` is a
      prefix of every stage leaf's shape; its ``True`` entries are the
      model's layers (in C order), the optimizer's ``layers``; ``False``
      entries are frozen (gradients zeroed, no optimizer state), e.g. the
      identity slots of uneven layer splits (``LayerSplit.mask``).
      ``None``: each logical stage is one layer.
    max_grad_norm: clip by the global norm over all shards, as
      ``optax.chain(optax.clip_by_global_norm(max_grad_norm), optimizer)``;
      ``None``: no clipping.
    tensor_rules: how the three functions' params split over
      ``tensor_axis``: ``{regex: spec}``, the first regex that fully matches
      a leaf's ``'/'``-joined path inside its part (``embed``, ``stages`` or
      ``head``) gives the spec of its trailing dims
      (``tensor_parallel.param_specs``); jaxpar's GPT has
      ``gpt.TENSOR_RULES``. ``None``: the params' Flax metadata. A mesh
      whose ``tensor_axis`` has size > 1 needs a param split over it:
      ``init`` raises ``ValueError`` otherwise. A ``PipelineModel`` has its
      rules from ``from_nnx(tensor_rules=...)``.
    data_axis, stage_axis, tensor_axis: the mesh axis names.
    zero_stage: 0 (optimizer state split like the params, and over
      ``stage_axis``), 1 (also split over ``data_axis``, padded where no dim
      divides: ``data_parallel.Padded``) or 3 (params too, gathered just in
      time); see the module docstring. Same losses, norms and params in
      every stage.
    key: a PRNG key (``jax.random.key(seed)``) for dropout, or ``None``.
      Step ``s`` uses ``fold_in(key, s)`` (``s = state.step``), so a resumed
      run draws the same masks. The three functions then take it as a last
      argument: ``embed_fn`` per microbatch of global index ``g`` (with
      ``fold_in(k_e, g)``), ``stage_fn`` and ``loss_fn`` as
      ``pipeline_value_and_grad_local`` gives it
      (``fold_in(fold_in(k_p, g), stage)``;
      ``k_e, k_p = split(fold_in(key, s))``). Global indices make the result
      the same on every mesh and schedule with the same number of logical
      stages and the same total number of microbatches.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` (float leaves) is
      averaged over microbatches and data like the loss, in
      ``StepStats.aux``.
    compute_dtype: e.g. ``jnp.bfloat16``: the three functions run on params
      cast to it (inside each function, so the pipeline's stash never holds
      a cast copy), so activations, stashes, pipeline messages and
      tensor-parallel all-reduces are in it; params, optimizer state, loss
      and gradient accumulation stay float32. ``None``: the params' dtype.
    remat_policy: what stage forwards stash for the backward
      (``jaxpar.pipeline.stash_policy``): ``'dots'`` (``None``, the
      default), ``'everything'``, ``'dots_no_batch'``, ``'nothing'`` (the
      stage input alone: the whole forward is recomputed) or a
      ``jax.checkpoint_policies`` policy.

  Returns:
    ``Trainer(init, step, params, opt_state)``: ``init(PipelineParams,
    model_state=None) -> TrainState`` (stages in model order
    ``[num_stages, ...]``; ``model_state``: the stages' state, leaves
    ``[num_stages, ...]`` in model order, e.g. ``PipelineModel.
    model_state``); ``step(state, (inputs, targets)) -> (state,
    StepStats)`` with leading batch size divisible by ``data size x
    num_microbatches``; ``params(state) -> PipelineParams`` in model order,
    still sharded; ``opt_state(state)``: the optimizer state with each
    per-layer ``LayerParams`` tree as ``PipelineParams`` like
    ``params(state)`` (``optax.contrib.schedule_free_eval_params(
    trainer.opt_state(state), trainer.params(state))``).

    ``state.model_state`` stays in model order, replicated: each stage
    runs its microbatches in order, its state passed from one to the next
    (running statistics updated once per microbatch, as one device running
    the microbatches in turn); with ``data`` > 1 each data shard updates it
    on its own microbatches and the step averages the results over
    ``data`` (``pmean``). ``optimizer.update`` gets ``value=loss`` (optax's
    ``GradientTransformationExtraArgs``, e.g. ``reduce_on_plateau``).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.models import gpt
    >>> config = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16,
    ...                        num_heads=2, num_layers=2)
    >>> params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0)))
    >>> pp, split = gpt.split_for_pipeline(params, num_stages=2)
    >>> trainer = jaxpar.parallel.trainer(
    ...     gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.adam(1e-3),
    ...     schedule=jaxpar.pipeline.one_f_one_b(2, 2),
    ...     mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
    ...     stage_mask=split.mask, tensor_rules=gpt.TENSOR_RULES,
    ...     zero_stage=3)
    >>> state = trainer.init(pp)
    >>> ids = np.zeros((4, 8), np.int32)
    >>> state, stats = trainer.step(state, (ids, ids))
    >>> int(state.step), trainer.params(state).stages['ln1']['scale'].shape
    (1, (2, 1, 16))
    >>> state.opt_state[0].mu.layers[1]['ln1']['scale'].shape  # layer 1
    (16,)
  """
  plan = make_plan(embed_fn, stage_fn, loss_fn, optimizer, schedule=schedule,
               mesh=mesh, stage_mask=stage_mask, max_grad_norm=max_grad_norm,
               tensor_rules=tensor_rules,
               axes=Axes(data_axis, stage_axis, tensor_axis),
               zero_stage=zero_stage, key=key, has_aux=has_aux,
               compute_dtype=compute_dtype, remat_policy=remat_policy)
  init = placed_init(functools.partial(_storage, plan), mesh=mesh)
  return Trainer(functools.partial(_init, plan, init), _step(plan),
                 functools.partial(_params, plan), _opt_state(plan))


# ------------------------------------------------------ init and params


def _init(plan: Plan, init: Callable[..., TrainState],
          params: PipelineParams, model_state: PyTree = None) -> TrainState:
  """``Trainer.init``: checks model-order ``params`` (and ``model_state``),
  then places them (the state's params typed with the schedule's
  placement: ``_placement``)."""
  _check_model_state(plan, model_state)
  if not isinstance(params, PipelineParams):
    raise TypeError('params must be a jaxpar.parallel.PipelineParams(embed, '
                    f'stages, head), got {type(params).__name__}.')
  check_leading(params.stages, plan.schedule.num_stages, 'params.stages',
                'schedule.num_stages')
  if plan.stage_mask is not None:
    for leaf in jax.tree.leaves(params.stages):
      if leaf.shape[:plan.stage_mask.ndim] != plan.stage_mask.shape:
        raise ValueError(
            f'stage_mask shape {plan.stage_mask.shape} is not a prefix of a '
            f'stage leaf shape {leaf.shape}.')
  if plan.tensor_specs is None:   # a PipelineModel's tensor_specs check it
    for part in params:
      tp.check_divisible(part, mesh=plan.mesh, rules=plan.tensor_rules,
                         axis=plan.axes.tensor)
  return _typed(plan, init(params, model_state))


def _check_model_state(plan: Plan, model_state: PyTree) -> None:
  """``ValueError`` for a missing or misshapen stage state."""
  if model_state is None and plan.model_state is not None:
    raise ValueError(
        'the PipelineModel has model state (its blocks\' nnx.BatchStat s: '
        'PipelineModel.model_state); pass it to init, trainer.init('
        'pm.params, pm.model_state), so each step carries and updates it.')
  if model_state is not None:
    check_leading(model_state, plan.schedule.num_stages, 'model_state',
                  'schedule.num_stages')


def _typed(plan: Plan, state: TrainState) -> TrainState:
  """``state`` as the user gets it: params typed with the rank placement
  (``_placement.placed``), so another trainer re-lays it (``relaid``)."""
  return state._replace(params=placed(state.params, plan.schedule))


def _to_ranks(schedule: Schedule, params: PipelineParams) -> PipelineParams:
  return params._replace(
      stages=executor.stages_to_ranks(params.stages, schedule))


def _fresh_state(plan: Plan, params: PipelineParams) -> TrainState:
  return TrainState(jnp.zeros((), jnp.int32), params,
                    plan.optimizer.init(plan.view.of_params(params)))


def _prepare(plan: Plan, specs: TrainState,
             params: PipelineParams) -> PipelineParams:
  """Model-order params as stored: rank placement, padded where ZeRO pads."""
  return zero.pad(_to_ranks(plan.schedule, params), specs.params,
                  mesh=plan.mesh)


def _storage(plan: Plan, params: PipelineParams):
  """``(prepare, optimizer, state specs)`` of model-order params' shapes
  (``train_state.placed_init``)."""
  params = jax.eval_shape(functools.partial(_to_ranks, plan.schedule), params)
  tp.check_axis_used(param_specs(plan, params).base, mesh=plan.mesh,
                     axis=plan.axes.tensor)
  specs = specs_of_state(plan, jax.eval_shape(
      functools.partial(_fresh_state, plan), params))
  return (functools.partial(_prepare, plan, specs),
          padded_optimizer(plan, specs), specs)


def _params(plan: Plan, state: TrainState) -> PipelineParams:
  """``Trainer.params``: stages back in model order ``[num_stages, ...]``, at
  their logical shapes (``data_parallel.unpadded``), shards kept; from the
  placement the state says it has (else the trainer's)."""
  schedule = getattr(type(state.params), 'schedule', plan.schedule)
  params = PipelineParams(*zero.unpadded(state.params))
  return auto_view(params._replace(
      stages=stages_in_model_order(params.stages, schedule)))


def _opt_state(plan: Plan) -> Callable[[TrainState], PyTree]:
  """``Trainer.opt_state``: the per-layer optimizer state laid out like
  ``Trainer.params`` (``LayerParams`` -> ``PipelineParams``, stages in model
  order ``[num_stages, ...]``, zeros in identity slots), one jitted program
  on the (``Auto``-axes) global arrays."""
  to_stages = lambda stages: jax.tree.map(
      lambda a: executor.ranks_to_stages(a, plan.schedule), stages)
  program = jax.jit(lambda opt_state: in_model_order(opt_state, plan.view,
                                                     to_stages))

  def opt_state(state: TrainState) -> PyTree:
    return program(auto_view(zero.unpadded(state.opt_state)))
  return opt_state


# ------------------------------------------------------------------- the step


def _program(plan: Plan, state: TrainState, inputs: Any, targets: Any,
             key: jax.Array | None) -> tuple[TrainState, StepStats]:
  """The jitted step: gradients in the ``shard_map``, then the update on
  global arrays (``train_state.sharded_update``)."""
  specs = param_specs(plan, state.params)
  state_specs = specs_of_state(plan, state)
  if key is not None:  # a fresh key each step, a function of (key, step)
    key = jax.random.fold_in(key, state.step)
  tied = tied_paths(plan, state.params, inputs, targets)
  loss, aux, grads, model_state = gradient_program(
      plan, specs, state_specs, tied)(state.params, inputs, targets, key,
                                      state.model_state)
  state, stats = sharded_update(
      state, grads, loss=loss,
      optimizer=padded_optimizer(plan, state_specs), mesh=plan.mesh,
      state_specs=state_specs, max_grad_norm=plan.max_grad_norm,
      update_specs=specs.zero if plan.zero_stage == 1 else None,
      model_state=model_state)
  return state, stats._replace(aux=aux)


def _validate(plan: Plan, state: Any, batch: Any) -> TrainState:
  """Checks ``(state, batch)``; returns the state's specs."""
  if not isinstance(state, TrainState):
    raise TypeError('state must be a TrainState from Trainer.init, got '
                    f'{type(state).__name__}.')
  if not (isinstance(batch, tuple) and len(batch) == 2):
    raise TypeError('batch must be a tuple (inputs, targets).')
  size = batch_size_of(batch)
  n_data = axis_size(plan.mesh, plan.axes.data)
  n = n_data * plan.schedule.num_microbatches
  if size % n:
    raise ValueError(
        f'batch size {size} is not divisible by {plan.axes.data} size '
        f'{n_data} x num_microbatches {plan.schedule.num_microbatches} = '
        f'{n}; use a multiple of {n}.')
  key = signature(state)
  if key not in plan.cache.states:
    logical = zero.logical_shapes(state)
    view = optimizer_view(plan, logical.params)
    check_opt_state(logical._replace(params=view), plan.optimizer)
    check_update_args(plan.optimizer, view, logical.opt_state)
    plan.cache.states[key] = specs_of_state(plan, state)
  return plan.cache.states[key]


def _place(plan: Plan, state: TrainState, batch: tuple) -> tuple:
  """``(state, inputs, targets)`` placed as the step takes them (a state of
  another schedule's placement re-laid: ``_placement.relaid``)."""
  if isinstance(state, TrainState) and isinstance(state.params,
                                                  PipelineParams):
    state = state._replace(params=relaid(state.params, plan.schedule))
  return (zero.place(state, _validate(plan, state, batch), mesh=plan.mesh),
          *jax.device_put(batch, NamedSharding(plan.mesh, P(plan.axes.data))))


def _step(plan: Plan) -> Callable[[TrainState, tuple],
                                   tuple[TrainState, StepStats]]:
  """``Trainer.step`` (and ``step.lower``): one jitted program, the state
  and batch placed first."""
  compiled = jax.jit(functools.partial(_program, plan))

  def step(state: TrainState, batch: tuple) -> tuple[TrainState, StepStats]:
    with jax.set_mesh(plan.mesh):
      state, stats = compiled(*_place(plan, state, batch), plan.key)
    return _typed(plan, state), stats

  def lower(state: TrainState, batch: tuple):
    with jax.set_mesh(plan.mesh):
      return compiled.lower(*_place(plan, state, batch), plan.key)

  step.lower = lower
  return step
