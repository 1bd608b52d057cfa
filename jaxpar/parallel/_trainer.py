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
``step``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import data_parallel as zero
from jaxpar import tensor_parallel as tp
from jaxpar import vma
from jaxpar.data_parallel import batch_size_of, check_opt_state
from jaxpar.mesh import axis_size
from jaxpar.parallel._from_nnx import PipelineModel
from jaxpar.parallel._layer_view import LayerView, layerwise, mirror_specs
from jaxpar.parallel._params import LayerParams, PipelineParams
from jaxpar.parallel._placement import padded_spec, stages_in_model_order
from jaxpar.pipeline import executor
from jaxpar.pipeline.executor import (check_fn,
                                      check_leading, stash_policy)
from jaxpar.pipeline.schedules import (Schedule, TickTable, local_stages,
                                       tick_table)
from jaxpar.train_state import (PyTree, StepStats, Trainer, TrainState,
                                check_compute_dtype, check_key,
                                auto_view, check_max_grad_norm, check_optimizer,
                                placed_init, sharded_update, signature)


class _Axes(NamedTuple):
  """The mesh axis names."""
  data: str
  stage: str
  tensor: str


class _Cache(NamedTuple):
  """A trainer's memos by ``signature``: the ``_Specs`` of each params
  signature, the state specs of each state signature (checked once)."""
  specs: dict
  states: dict


class _Plan(NamedTuple):
  """What every part of one trainer uses: its options, checked once.

  Attributes:
    functions: ``(embed_fn, stage_fn, loss_fn)``, lifted (``jaxpar.vma``).
    optimizer: the user's optimizer; it sees the per-layer view.
    schedule: the schedule; ``table`` its tick table.
    mesh: the mesh; ``axes`` its axis names.
    manual: the axes the gradient ``shard_map`` is manual over (empty: all).
    stage_mask: bool ``[num_stages, ...]`` or ``None``; ``mask_ranks`` the
      same in the rank placement ``[p, v, ...]``.
    view: where each layer sits in the rank placement (the optimizer's view).
    tensor_rules: the tensor rules of the three functions' params.
    tensor_specs: a ``PipelineModel``'s ``tensor_specs`` (its layers run as
      written, XLA partitions ``tensor``), else ``None``.
    zero_stage, max_grad_norm, key, has_aux, compute_dtype, remat_policy:
      the options as ``trainer`` takes them (``key`` replicated on ``mesh``).
    cache: the memos.
  """
  functions: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]
  optimizer: optax.GradientTransformation
  schedule: Schedule
  table: TickTable
  mesh: Mesh
  axes: _Axes
  manual: frozenset[str]
  stage_mask: np.ndarray | None
  mask_ranks: np.ndarray | None
  view: LayerView
  tensor_rules: Mapping[str, Any] | None
  tensor_specs: Callable[..., PipelineParams] | None
  zero_stage: int
  max_grad_norm: float | None
  key: jax.Array | None
  has_aux: bool
  compute_dtype: Any
  remat_policy: Any
  cache: _Cache


class _Specs(NamedTuple):
  """The ``PartitionSpec``s of one params signature (rank placement).

  Attributes:
    base: over ``tensor`` (the tensor rules) and ``stage`` (a stage leaf's
      rank dim): how params are stored without ZeRO-3.
    zero: ``base`` and ZeRO's ``data`` axis on one more dim: the params
      with ZeRO-3, the gradients with ZeRO-1/3.
    view: ``LayerParams`` specs of the optimizer's per-layer view, also
      split over ``stage`` (and ``data`` with ZeRO).
  """
  base: PipelineParams
  zero: PipelineParams
  view: LayerParams


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
    stage_fn: ``stage_fn(one_stage_params, x) -> y``, ``y`` shaped like ``x``.
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
    ``Trainer(init, step, params)``: ``init(PipelineParams) -> TrainState``
    (stages in model order ``[num_stages, ...]``); ``step(state, (inputs,
    targets)) -> (state, StepStats)`` with leading batch size divisible by
    ``data size x num_microbatches``; ``params(state) -> PipelineParams`` in
    model order, still sharded.

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
  plan = _plan(embed_fn, stage_fn, loss_fn, optimizer, schedule=schedule,
               mesh=mesh, stage_mask=stage_mask, max_grad_norm=max_grad_norm,
               tensor_rules=tensor_rules,
               axes=_Axes(data_axis, stage_axis, tensor_axis),
               zero_stage=zero_stage, key=key, has_aux=has_aux,
               compute_dtype=compute_dtype, remat_policy=remat_policy)
  placed = placed_init(functools.partial(_storage, plan), mesh=mesh)
  return Trainer(functools.partial(_init, plan, placed), _step(plan),
                 functools.partial(_params, plan))


# ---------------------------------------------------------------- the options


def _check_schedule(schedule: Any, n_stage: int, stage_axis: str) -> None:
  if not isinstance(schedule, Schedule):
    raise TypeError(f'schedule must be a jaxpar.pipeline.Schedule, got '
                    f'{type(schedule).__name__}.')
  if schedule.num_ranks != n_stage:
    raise ValueError(
        f'schedule {schedule.name!r} has num_ranks={schedule.num_ranks} but '
        f'the mesh axis {stage_axis!r} has size {n_stage}; build the schedule '
        f'with num_ranks={n_stage} or change the mesh.')


def _check_mask(stage_mask: Any, schedule: Schedule) -> np.ndarray | None:
  if stage_mask is None:
    return None
  stage_mask = np.asarray(stage_mask, bool)
  if stage_mask.ndim < 1 or stage_mask.shape[0] != schedule.num_stages:
    raise ValueError(
        f'stage_mask has shape {stage_mask.shape}; its leading size must be '
        f'schedule.num_stages={schedule.num_stages}.')
  return stage_mask


def _parts(embed_fn, stage_fn, loss_fn, optimizer, stage_mask, tensor_rules):
  """``(functions, optimizer, stage_mask, tensor_specs)`` of the arguments:
  the three functions, or a ``PipelineModel`` and the optimizer."""
  if not isinstance(embed_fn, PipelineModel):
    return (embed_fn, stage_fn, loss_fn), optimizer, stage_mask, None
  if loss_fn is not None or optimizer is not None:
    raise TypeError('trainer(pm, optimizer, *, schedule, mesh, ...) '
                    'takes a PipelineModel and the optimizer only.')
  if tensor_rules is not None:
    raise TypeError(
        'trainer(pm, optimizer, tensor_rules=...): a PipelineModel splits its '
        'params over tensor as from_nnx says; pass the rules there: '
        'from_nnx(model, ..., tensor_rules=rules), then trainer(pm, '
        'optimizer, schedule=..., mesh=...).')
  pm = embed_fn
  return (pm.functions, stage_fn,
          pm.stage_mask if stage_mask is None else stage_mask,
          pm.tensor_specs)


def _plan(embed_fn, stage_fn, loss_fn, optimizer, *, schedule: Schedule,
          mesh: Mesh, stage_mask, max_grad_norm, tensor_rules, axes: _Axes,
          zero_stage, key, has_aux, compute_dtype, remat_policy) -> _Plan:
  """The checked options (errors before anything is traced)."""
  functions, optimizer, stage_mask, tensor_specs = _parts(
      embed_fn, stage_fn, loss_fn, optimizer, stage_mask, tensor_rules)
  for name, fn in zip(('embed_fn', 'stage_fn', 'loss_fn'), functions):
    check_fn(fn, name)
  # The user's functions as on one device (jaxpar.vma).
  functions = tuple(vma.lift(fn, axes=(axes.data, axes.stage))
                    for fn in functions)
  optimizer = check_optimizer(optimizer)
  zero_stage = zero.check_zero_stage(zero_stage)
  check_max_grad_norm(max_grad_norm)
  for axis in axes:
    axis_size(mesh, axis)
  # A PipelineModel's layers run as written on full-size arrays: 'tensor'
  # stays an Auto axis that XLA partitions from the params' shardings,
  # inside a shard_map manual over data and stage only (empty: all axes).
  manual = (frozenset() if tensor_specs is None
            else frozenset({axes.data, axes.stage}))
  _check_schedule(schedule, axis_size(mesh, axes.stage), axes.stage)
  stage_mask = _check_mask(stage_mask, schedule)
  check_key(key)
  compute_dtype = check_compute_dtype(compute_dtype)
  stash_policy(remat_policy)
  if key is not None:
    key = jax.device_put(key, NamedSharding(mesh, P()))
  return _Plan(
      functions=functions, optimizer=optimizer, schedule=schedule,
      table=tick_table(schedule), mesh=mesh, axes=axes, manual=manual,
      stage_mask=stage_mask,
      # the mask in the rank placement [p, v, ...], in numpy (no op to compile)
      mask_ranks=(None if stage_mask is None
                  else stage_mask[np.array(local_stages(schedule))]),
      view=LayerView.of(schedule, stage_mask), tensor_rules=tensor_rules,
      tensor_specs=tensor_specs, zero_stage=zero_stage,
      max_grad_norm=max_grad_norm, key=key, has_aux=has_aux,
      compute_dtype=compute_dtype, remat_policy=remat_policy,
      cache=_Cache(specs={}, states={}))


# ------------------------------------------------------------------ the specs


def _manual(specs: PyTree, axes: frozenset[str]) -> PyTree:
  """``specs`` over the manual ``axes`` of a shard_map only (empty: all)."""
  if not axes:
    return specs

  def keep(entry):
    kept = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,))
                 if a in axes)
    return kept if len(kept) > 1 else (kept[0] if kept else None)
  return jax.tree.map(lambda s: P(*map(keep, s)), specs,
                      is_leaf=lambda x: isinstance(x, P))


def _specs(plan: _Plan, params: PipelineParams) -> _Specs:
  """The ``_Specs`` of placed params (``Padded`` leaves at their logical
  ``shape``), computed once per signature."""
  params = zero.logical_shapes(params)
  key = signature(params)
  if key not in plan.cache.specs:
    base = _base_specs(plan, params)
    plan.cache.specs[key] = _Specs(base, _zero_specs(plan, params, base),
                                   _view_specs(plan, params, base))
  return plan.cache.specs[key]


def _base_specs(plan: _Plan, params: PipelineParams) -> PipelineParams:
  """Over ``tensor`` as the tensor rules say, over ``stage`` on a stage
  leaf's rank dim."""
  if plan.tensor_specs is not None:
    base = plan.tensor_specs(params, axis_size(plan.mesh, plan.axes.tensor))
  else:
    base = PipelineParams(*(
        tp.param_specs(part, rules=plan.tensor_rules, axis=plan.axes.tensor)
        for part in params))
  return base._replace(stages=jax.tree.map(
      lambda leaf, s: P(plan.axes.stage, *padded_spec(s, np.ndim(leaf))[1:]),
      params.stages, base.stages))


def _zero_specs(plan: _Plan, params: PipelineParams,
                base: PipelineParams) -> PipelineParams:
  """``base`` with ZeRO's ``data`` axis on one more dim of every leaf."""
  # Leading dims ZeRO never splits: a stage leaf's [p, v] and the dims the
  # stage mask covers after them (the mask applies to whole local rows).
  skip = PipelineParams(
      0, 2 if plan.stage_mask is None else 1 + plan.stage_mask.ndim, 0)
  return PipelineParams(*(
      zero.data_specs(part, spec, mesh=plan.mesh, axis=plan.axes.data,
                      skip=lead, pad=True)
      for part, spec, lead in zip(params, base, skip)))


def _view_specs(plan: _Plan, params: PipelineParams,
                base: PipelineParams) -> LayerParams:
  """The per-layer view's specs: each layer's tensor split, and ``stage``
  (and ``data`` with ZeRO) on one more dim."""
  lead = len(plan.view.shape)
  shapes = LayerParams(params.embed, jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(np.shape(leaf)[lead:], leaf.dtype),
      params.stages), params.head)
  specs = LayerParams(base.embed, jax.tree.map(
      lambda leaf, s: P(*padded_spec(s, np.ndim(leaf))[lead:]),
      params.stages, base.stages), base.head)
  for axis in (plan.axes.stage,) + ((plan.axes.data,) if plan.zero_stage
                                    else ()):
    specs = LayerParams(*(zero.data_specs(part, spec, mesh=plan.mesh,
                                          axis=axis,
                                          pad=axis == plan.axes.data)
                          for part, spec in zip(shapes, specs)))
  return specs._replace(layers=[specs.layers] * len(plan.view.positions))


def _stored(plan: _Plan, specs: _Specs) -> PipelineParams:
  """How the params are stored: split over ``data`` with ZeRO-3 only."""
  return specs.zero if plan.zero_stage == 3 else specs.base


def _gradient_specs(plan: _Plan, specs: _Specs) -> PipelineParams:
  """How the gradients leave the ``shard_map``: reduce-scattered with ZeRO."""
  return specs.zero if plan.zero_stage else specs.base


def _view_of(plan: _Plan, params: PipelineParams) -> LayerParams:
  return _specs(plan, params).view


def _optimizer_view(plan: _Plan, params: PipelineParams) -> LayerParams:
  """The optimizer's view of rank-placement params, as shapes."""
  return jax.eval_shape(plan.view.of_params, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params))


def _state_specs(plan: _Plan, state: TrainState) -> TrainState:
  state = zero.logical_shapes(state)
  specs = _specs(plan, state.params)
  return TrainState(P(), _stored(plan, specs), mirror_specs(
      state.opt_state, _optimizer_view(plan, state.params), specs.view))


def _padded_optimizer(plan: _Plan,
                      specs: TrainState) -> optax.GradientTransformation:
  """The optimizer on the per-layer view of logical leaves, its state
  stored padded (``data_parallel.padded_optimizer``) as ``specs`` say."""
  layer_optimizer = layerwise(plan.optimizer, plan.view,
                              specs=functools.partial(_view_of, plan))
  return zero.padded_optimizer(layer_optimizer, specs.opt_state,
                               mesh=plan.mesh)


# ------------------------------------------------------ init and params


def _init(plan: _Plan, placed: Callable[[PipelineParams], TrainState],
          params: PipelineParams) -> TrainState:
  """``Trainer.init``: checks model-order ``params``, then places them."""
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
  return placed(params)


def _to_ranks(schedule: Schedule, params: PipelineParams) -> PipelineParams:
  return params._replace(
      stages=executor.stages_to_ranks(params.stages, schedule))


def _fresh_state(plan: _Plan, params: PipelineParams) -> TrainState:
  return TrainState(jnp.zeros((), jnp.int32), params,
                    plan.optimizer.init(plan.view.of_params(params)))


def _prepare(plan: _Plan, specs: TrainState,
             params: PipelineParams) -> PipelineParams:
  """Model-order params as stored: rank placement, padded where ZeRO pads."""
  return zero.pad(_to_ranks(plan.schedule, params), specs.params,
                  mesh=plan.mesh)


def _storage(plan: _Plan, params: PipelineParams):
  """``(prepare, optimizer, state specs)`` of model-order params' shapes
  (``train_state.placed_init``)."""
  params = jax.eval_shape(functools.partial(_to_ranks, plan.schedule), params)
  tp.check_axis_used(_specs(plan, params).base, mesh=plan.mesh,
                     axis=plan.axes.tensor)
  specs = _state_specs(plan, jax.eval_shape(
      functools.partial(_fresh_state, plan), params))
  return (functools.partial(_prepare, plan, specs),
          _padded_optimizer(plan, specs), specs)


def _params(plan: _Plan, state: TrainState) -> PipelineParams:
  """``Trainer.params``: stages back in model order ``[num_stages, ...]``, at
  their logical shapes (``data_parallel.unpadded``), shards kept."""
  params = zero.unpadded(state.params)
  return auto_view(params._replace(
      stages=stages_in_model_order(params.stages, plan.schedule)))


# ------------------------------------------------------------------- the step


def _masked(plan: _Plan, stage_grads: PyTree) -> PyTree:
  """Zero gradients for the slots ``stage_mask`` marks ``False``."""
  if plan.stage_mask is None:
    return stage_grads
  mine = jnp.asarray(plan.mask_ranks)[jax.lax.axis_index(plan.axes.stage)]
  return jax.tree.map(
      lambda g: jnp.where(
          mine.reshape(mine.shape + (1,) * (g.ndim - mine.ndim)), g,
          jnp.zeros((), g.dtype)), stage_grads)


def _functions(plan: _Plan, split: PipelineParams) -> tuple:
  """embed/stage/loss functions of local params (ZeRO-3: of slices that
  each call gathers over ``data`` just in time)."""
  if plan.zero_stage != 3:
    return plan.functions
  embed_fn, stage_fn, loss_fn = plan.functions
  gathered = functools.partial(zero.gathered, axis=plan.axes.data)
  return (gathered(embed_fn, split.embed),
          gathered(stage_fn, split.stages, skip=2),
          gathered(loss_fn, split.head))


def _local_grads(plan: _Plan, specs: _Specs, params: PipelineParams,
                 inputs: Any, targets: Any, key: jax.Array | None):
  """Inside the ``shard_map``: ``(loss, aux, gradients)`` of one device,
  averaged (or reduce-scattered) over ``data``."""
  embed, stage, head_loss = _functions(plan, specs.zero)
  params = zero.vary(params, _stored(plan, specs), axis=plan.axes.data)
  embed_key = None
  if key is not None:
    embed_key, key = jax.random.split(key)
  one_rank = jax.tree.map(lambda a: a[0], params.stages)
  # The embedding runs per microbatch inside stage 0 (with one stage
  # rank, the microbatches run in turn): nothing batch-sized is held.
  out, grads = executor.pipeline_value_and_grad_local(
      stage, head_loss, one_rank, params.head, inputs, targets,
      table=plan.table, axis=plan.axes.stage, key=key,
      # the global index of this data shard's first microbatch
      microbatch_offset=(jax.lax.axis_index(plan.axes.data)
                         * plan.schedule.num_microbatches),
      has_aux=plan.has_aux, compute_dtype=plan.compute_dtype, embed_fn=embed,
      embed_params=params.embed, embed_key=embed_key,
      remat_policy=plan.remat_policy)
  grads = PipelineParams(
      grads.embed,
      jax.tree.map(lambda g: g[None], _masked(plan, grads.stages)),
      grads.head)
  loss, aux = jax.lax.pmean(out if plan.has_aux else (out, None),
                            plan.axes.data)
  grads = zero.reduce_gradients(grads, _gradient_specs(plan, specs),
                                axis=plan.axes.data,
                                summed=plan.zero_stage == 3)
  return loss, aux, grads


def _gradients(plan: _Plan, specs: _Specs, state_specs: TrainState):
  """``_local_grads`` in its ``shard_map``: ``(params, inputs, targets,
  key) -> (loss, aux, gradients)`` of global arrays."""
  manual, axes = plan.manual, plan.axes
  grad_specs = _gradient_specs(plan, specs)
  gradients = jax.shard_map(
      functools.partial(_local_grads, plan, specs),
      mesh=None if manual else plan.mesh,   # None: auto_axes' mesh, below
      in_specs=(_manual(state_specs.params, manual), P(axes.data),
                P(axes.data), P()),
      out_specs=(P(), P(), _manual(grad_specs, manual)), axis_names=manual)
  if manual:   # 'tensor' Auto inside: XLA partitions the model as written
    gradients = jax.sharding.auto_axes(
        gradients, axes=axes.tensor, out_sharding=(P(), P(), grad_specs))
  return gradients


def _program(plan: _Plan, state: TrainState, inputs: Any, targets: Any,
             key: jax.Array | None) -> tuple[TrainState, StepStats]:
  """The jitted step: gradients in the ``shard_map``, then the update on
  global arrays (``train_state.sharded_update``)."""
  specs = _specs(plan, state.params)
  state_specs = _state_specs(plan, state)
  if key is not None:  # a fresh key each step, a function of (key, step)
    key = jax.random.fold_in(key, state.step)
  loss, aux, grads = _gradients(plan, specs, state_specs)(
      state.params, inputs, targets, key)
  state, stats = sharded_update(
      state, grads, loss=loss,
      optimizer=_padded_optimizer(plan, state_specs), mesh=plan.mesh,
      state_specs=state_specs, max_grad_norm=plan.max_grad_norm,
      update_specs=specs.zero if plan.zero_stage == 1 else None)
  return state, stats._replace(aux=aux)


def _validate(plan: _Plan, state: Any, batch: Any) -> TrainState:
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
    check_opt_state(logical._replace(
        params=_optimizer_view(plan, logical.params)), plan.optimizer)
    plan.cache.states[key] = _state_specs(plan, state)
  return plan.cache.states[key]


def _place(plan: _Plan, state: TrainState, batch: tuple) -> tuple:
  """``(state, inputs, targets)`` placed as the step takes them."""
  return (zero.place(state, _validate(plan, state, batch), mesh=plan.mesh),
          *jax.device_put(batch, NamedSharding(plan.mesh, P(plan.axes.data))))


def _step(plan: _Plan) -> Callable[[TrainState, tuple],
                                   tuple[TrainState, StepStats]]:
  """``Trainer.step`` (and ``step.lower``): one jitted program, the state
  and batch placed first."""
  compiled = jax.jit(functools.partial(_program, plan))

  def step(state: TrainState, batch: tuple) -> tuple[TrainState, StepStats]:
    with jax.set_mesh(plan.mesh):
      return compiled(*_place(plan, state, batch), plan.key)

  def lower(state: TrainState, batch: tuple):
    with jax.set_mesh(plan.mesh):
      return compiled.lower(*_place(plan, state, batch), plan.key)

  step.lower = lower
  return step
