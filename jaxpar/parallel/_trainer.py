"""3D parallelism: data x pipeline x tensor on one ``('data', 'stage', 'tensor')`` mesh.

A model is three parts, ``PipelineParams(embed, stages, head)``::

  x    = embed_fn(embed, inputs)                     # before the pipeline
  y    = stage_fn(stages[S-1], ... stage_fn(stages[0], x))   # the pipeline
  loss = loss_fn(head, y, targets)                   # after the last stage

One train step is one jitted program in two parts:

1. **Gradients**, inside one ``jax.shard_map`` over the whole mesh:

   * **TP** -- the three functions are tensor-parallel
     (``jaxpar.tensor_parallel``) over ``'tensor'``; params are split as
     ``tensor_parallel.param_specs`` says;
   * **PP** -- ``stages`` run through ``jaxpar.pipeline``'s executor over
     ``'stage'`` with any schedule; the embedding runs per microbatch
     inside stage 0 (``pipeline_value_and_grad_local``'s ``embed_fn``), the head in
     the last stage, so nothing batch-sized is held; one stage rank runs the
     microbatches in turn, as data parallelism does;
   * **DP** -- the batch is split over ``'data'``; the loss is averaged over
     it and the gradients too: ``pmean``, or with ZeRO a reduce-scatter
     (``jaxpar.data_parallel.reduce_gradients``).

2. **The update** on the global, sharded arrays (``jaxpar.train_state.
   sharded_update``): ``optimizer.update`` under ``jit``, partitioned by XLA,
   on the **per-layer view** ``LayerParams(embed, layers, head)``
   (``jaxpar.parallel``): ``layers[i]`` is the model's layer ``i`` in
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
``stage`` on one more dim (``zero.data_spec`` with the stage axis; a layer
is one global array, so the stage axis splits it as ZeRO splits over
``data``), so it is not replicated over ``stage`` or ``tensor``. Subtrees
with ``optax.MaskedNode`` placeholders (``masked``, ``multi_transform``)
are split alike (``pipeline_view.mirror_specs``); other leaves (counts,
Adafactor's factored moments) are replicated.

**ZeRO** (``zero_stage``; ``jaxpar.zero``): on top of its stage/tensor split
every leaf gets the ``data`` axis on one more dim (``zero.data_spec``; a
stage leaf's ``[p, v]`` rows are never split). A leaf that no dim divides
by the data size ``N`` is stored zero-padded along its largest dim not split
over ``tensor`` (``zero.Padded``, as torch FSDP does; the optimizer and the
user's functions see it unpadded), so each device holds ``~1/N`` of every
leaf, plus at most one padding row:

* ``zero_stage=1`` -- the optimizer state: gradients are reduce-scattered,
  each data replica updates its ``1/N`` and the params are all-gathered;
* ``zero_stage=3`` (FSDP) -- the params too: each ``embed_fn``, ``stage_fn``
  and ``loss_fn`` call all-gathers its params over ``data`` just before it
  runs (``zero.gathered``: forward, and again in the backward pass instead
  of keeping them), and the gather's transpose reduce-scatters the
  gradients. Per microbatch, so it composes with every schedule, including
  interleaved and V-shaped ones with several stages per rank.

A state is a plain ``TrainState`` of global arrays (``zero.Padded`` where
ZeRO pads) whose logical shapes do not depend on the mesh or on
``zero_stage`` (params in the rank layout ``[p, v, ...]``, optimizer state
per layer): ``Trainer.params`` gives them unpadded, ``jaxpar.checkpoint``
saves them unpadded and restores them onto any mesh and any ``zero_stage``,
and a state from one trainer is placed into another trainer's layout by its
``step``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import tensor_parallel as tp
from jaxpar import vma
from jaxpar import data_parallel as zero
from jaxpar.data_parallel import batch_size_of, check_opt_state
from jaxpar.mesh import axis_size
from jaxpar.pipeline import executor
from jaxpar.pipeline.executor import (check_compute_dtype, check_fn, check_key, check_leading)
from jaxpar.pipeline.schedules import Schedule, local_stages, tick_table
from jaxpar.pipeline.executor import stash_policy
from jaxpar.parallel._from_nnx import PipelineModel, from_nnx
from jaxpar.parallel._params import LayerParams, PipelineParams
from jaxpar.parallel._layer_view import LayerView, layerwise, mirror_specs
from jaxpar.parallel._placement import (padded_spec, stages_in_model_order,
                                 stages_like)
from jaxpar.train_state import (PyTree, StepStats, Trainer, TrainState,
                                auto_view, check_max_grad_norm, check_optimizer,
                                placed_init, sharded_update, signature)




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
    remat: bool = False,
    layout: dict[str, str] | None = None,
    data_axis: str = 'data',
    stage_axis: str = 'stage',
    tensor_axis: str = 'tensor',
    zero_stage: int = 0,
    key: jax.Array | None = None,
    has_aux: bool = False,
    compute_dtype: Any = None,
    remat_policy: Any = None,
) -> Trainer:
  """A DP x PP x TP train step for a model given as embed / stages / head.

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
      identity slots of uneven layer splits
      (``jaxpar.models.gpt.LayerSplit.mask``). ``None``: each logical
      stage is one layer.
    max_grad_norm: clip by the global norm over all shards, as
      ``optax.chain(optax.clip_by_global_norm(max_grad_norm), optimizer)``;
      ``None``: no clipping.
    remat: recompute stage forwards in the backward (stash stage inputs only).
    remat_policy: what stage forwards stash for the backward
      (``jaxpar.pipeline.stage.stash_policy``; default ``'dots'``).
    layout: tensor-parallel layout: full layer paths in each part ->
      kinds (``tensor_parallel.param_specs``); default
      ``tensor_parallel.DEFAULT_LAYOUT``, the paths of jaxpar's GPT. A mesh
      whose ``tensor_axis`` has size > 1 needs a parameter split over it:
      ``init`` raises ``ValueError`` otherwise.
    data_axis, stage_axis, tensor_axis: the mesh axis names.
    zero_stage: 0 (optimizer state split like the params, and over
      ``stage_axis``), 1 (also split over ``data_axis``, padded where no dim
      divides: ``zero.Padded``) or 3 (params too, gathered just in time);
      see the module docstring. Same losses, norms and params in every stage.
    key: a PRNG key (``jax.random.key(seed)``) for dropout, or ``None``.
      Step ``s`` uses ``fold_in(key, s)`` (``s = state.step``), so a resumed
      run draws the same masks. The three functions then take it as a last
      argument: ``embed_fn`` per microbatch of global index ``g`` (with
      ``fold_in(k_e, g)``), ``stage_fn`` and ``loss_fn`` as
      ``pipeline_value_and_grad_local`` gives it (``fold_in(fold_in(k_p, g), stage)``;
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

  Returns:
    ``Trainer(init, step, params)``: ``init(PipelineParams) -> TrainState``
    placed in this trainer's layout (stages in the executor's rank layout
    ``[p, v, ...]``); ``step(state, (inputs, targets)) -> (state,
    StepStats)`` with leading batch size divisible by ``data size x
    num_microbatches``; ``params(state) -> PipelineParams`` in model order,
    still sharded.

  Example:
    >>> from flax import nnx
    >>> from jaxpar.models import gpt
    >>> config = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16,
    ...                        num_heads=2, num_layers=2)
    >>> params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0)))
    >>> pp, layout = gpt.split_for_pipeline(params, num_stages=2)
    >>> trainer = jaxpar.parallel.trainer(
    ...     gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.adam(1e-3),
    ...     schedule=jaxpar.pipeline.one_f_one_b(2, 2),
    ...     mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
    ...     stage_mask=layout.mask, zero_stage=3)
    >>> state = trainer.init(pp)
    >>> ids = np.zeros((4, 8), np.int32)
    >>> state, stats = trainer.step(state, (ids, ids))
    >>> int(state.step), trainer.params(state).stages['ln1']['scale'].shape
    (1, (2, 1, 16))
    >>> state.opt_state[0].mu.layers[1]['ln1']['scale'].shape  # layer 1
    (16,)
  """
  tensor_specs = None   # a PipelineModel's tensor split, XLA-partitioned
  if isinstance(embed_fn, PipelineModel):  # trainer(pm, optimizer, ...)
    if loss_fn is not None or optimizer is not None:
      raise TypeError('trainer(pm, optimizer, *, schedule, mesh, ...) '
                      'takes a PipelineModel and the optimizer only.')
    pm, optimizer = embed_fn, stage_fn
    embed_fn, stage_fn, loss_fn = pm.functions
    stage_mask = pm.stage_mask if stage_mask is None else stage_mask
    layout = {} if layout is None else layout   # the model's own layers
    tensor_specs = pm.tensor_specs
  for name, fn in (('embed_fn', embed_fn), ('stage_fn', stage_fn),
                   ('loss_fn', loss_fn)):
    check_fn(fn, name)
  # The user's functions as on one device (jaxpar.vma).
  embed_fn, stage_fn, loss_fn = (vma.lift(fn, axes=(data_axis, stage_axis))
                                 for fn in (embed_fn, stage_fn, loss_fn))
  optimizer = check_optimizer(optimizer)
  zero_stage = zero.check_zero_stage(zero_stage)
  check_max_grad_norm(max_grad_norm)
  n_data = axis_size(mesh, data_axis)
  n_stage = axis_size(mesh, stage_axis)
  n_tensor = axis_size(mesh, tensor_axis)
  manual = frozenset()   # shard_map manual over every axis
  if tensor_specs is not None:
    # The model's layers run as written on full-size arrays: 'tensor' stays
    # an Auto axis that XLA partitions from the params' shardings, inside a
    # shard_map manual over data and stage only.
    manual = frozenset({data_axis, stage_axis})
  _check_schedule(schedule, n_stage, stage_axis)
  stage_mask = _check_mask(stage_mask, schedule)
  check_key(key)
  compute_dtype = check_compute_dtype(compute_dtype)
  stash_policy(remat, remat_policy)
  if key is not None:
    key = jax.device_put(key, NamedSharding(mesh, P()))
  lowered = tick_table(schedule)
  m = schedule.num_microbatches
  # Leading dims ZeRO never splits: a stage leaf's [p, v] and the dims the
  # stage mask covers after them (the mask applies to whole local rows).
  skip = PipelineParams(
      0, 2 if stage_mask is None else 1 + stage_mask.ndim, 0)
  if stage_mask is not None:
    # the mask in the rank layout [p, v, ...], in numpy (no op to compile)
    mask_ranks = stage_mask[np.array(local_stages(schedule))]
  view = LayerView.of(schedule, stage_mask)
  layouts = {}

  def specs_of(params: PipelineParams) -> tuple[PipelineParams, PipelineParams,
                                                LayerParams]:
    """Specs of placed params: (tensor/stage, the same with ZeRO's data
    axis, the optimizer's view: also split over stage, and data with ZeRO),
    from the logical shapes (``zero.Padded`` leaves at their ``shape``)."""
    params = zero.logical_shapes(params)
    key = signature(params)
    if key not in layouts:
      base = (tensor_specs(params, n_tensor) if tensor_specs is not None else
              PipelineParams(*(tp.param_specs(part, axis=tensor_axis,
                                              layout=layout) for part in params)))
      base = base._replace(stages=jax.tree.map(
          lambda leaf, s: P(stage_axis, *padded_spec(s, np.ndim(leaf))[1:]),
          params.stages, base.stages))
      split = PipelineParams(*(
          zero.data_specs(part, spec, mesh=mesh, axis=data_axis, skip=lead,
                          pad=True)
          for part, spec, lead in zip(params, base, skip)))
      lead = len(view.shape)
      layer = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(
          np.shape(leaf)[lead:], leaf.dtype), params.stages)
      ops = LayerParams(params.embed, layer, params.head)
      ops_base = LayerParams(base.embed, jax.tree.map(
          lambda leaf, s: P(*padded_spec(s, np.ndim(leaf))[lead:]),
          params.stages, base.stages), base.head)
      for axis in (stage_axis,) + ((data_axis,) if zero_stage else ()):
        ops_base = LayerParams(*(zero.data_specs(part, spec, mesh=mesh,
                                                 axis=axis,
                                                 pad=axis == data_axis)
                                 for part, spec in zip(ops, ops_base)))
      layouts[key] = base, split, ops_base._replace(
          layers=[ops_base.layers] * len(view.positions))
    return layouts[key]

  def optimizer_view(params: PipelineParams) -> LayerParams:
    """The optimizer's view of rank-layout params, as shapes."""
    return jax.eval_shape(view.of_params, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params))

  layer_optimizer = layerwise(optimizer, view,
                              specs=lambda params: specs_of(params)[2])

  def state_specs(state: TrainState) -> TrainState:
    state = zero.logical_shapes(state)
    base, split, ops = specs_of(state.params)
    return TrainState(P(), split if zero_stage == 3 else base, mirror_specs(
        state.opt_state, optimizer_view(state.params), ops))

  def init(params: PipelineParams) -> TrainState:
    if not isinstance(params, PipelineParams):
      raise TypeError('params must be a jaxpar.parallel.PipelineParams(embed, '
                      f'stages, head), got {type(params).__name__}.')
    check_leading(params.stages, schedule.num_stages,
                            'params.stages', 'schedule.num_stages')
    if stage_mask is not None:
      for leaf in jax.tree.leaves(params.stages):
        if leaf.shape[:stage_mask.ndim] != stage_mask.shape:
          raise ValueError(
              f'stage_mask shape {stage_mask.shape} is not a prefix of a stage '
              f'leaf shape {leaf.shape}.')
    for part in params:
      tp.check_divisible(part, mesh=mesh, axis=tensor_axis, layout=layout)
    return placed(params)

  def to_ranks(params: PipelineParams) -> PipelineParams:
    return params._replace(
        stages=executor.stages_to_ranks(params.stages, schedule))

  def init_layout(params: PipelineParams):
    """(prepare, optimizer, state specs) of model-order params' shapes."""
    params = jax.eval_shape(to_ranks, params)
    tp.check_axis_used(specs_of(params)[0], mesh=mesh, axis=tensor_axis)
    specs = state_specs(jax.eval_shape(lambda p: TrainState(
        jnp.zeros((), jnp.int32), p, optimizer.init(view.of_params(p))),
                                       params))
    return (lambda p: zero.pad(to_ranks(p), specs.params, mesh=mesh),
            padded_optimizer(specs), specs)

  placed = placed_init(init_layout, mesh=mesh)

  def padded_optimizer(specs: TrainState) -> optax.GradientTransformation:
    """The per-layer optimizer on logical leaves, its state stored padded
    (``zero.padded_optimizer``) as ``specs.opt_state`` says."""
    return zero.padded_optimizer(layer_optimizer, specs.opt_state, mesh=mesh)

  def to_model_order(state: TrainState) -> PipelineParams:
    """Stages back in model order ``[num_stages, ...]``, at their logical
    shapes (``zero.unpadded``), shards kept."""
    params = zero.unpadded(state.params)
    return auto_view(params._replace(
        stages=stages_in_model_order(params.stages, schedule)))

  def masked(stage_grads: PyTree) -> PyTree:
    if stage_mask is None:
      return stage_grads
    mine = jnp.asarray(mask_ranks)[jax.lax.axis_index(stage_axis)]
    return jax.tree.map(
        lambda g: jnp.where(
            mine.reshape(mine.shape + (1,) * (g.ndim - mine.ndim)), g,
            jnp.zeros((), g.dtype)), stage_grads)

  def functions(split: PipelineParams):
    """embed/stage/loss functions of local params (ZeRO-3: of slices)."""
    if zero_stage != 3:
      return embed_fn, stage_fn, loss_fn
    gathered = functools.partial(zero.gathered, axis=data_axis)
    return (gathered(embed_fn, split.embed),
            gathered(stage_fn, split.stages, skip=2),
            gathered(loss_fn, split.head))

  def offset():
    """Global index of this data shard's first microbatch."""
    return jax.lax.axis_index(data_axis) * m

  def local_grads(params, inputs, targets, key, *, base, split):
    embed, stage, head_loss = functions(split)
    params = zero.vary(params, split if zero_stage == 3 else base,
                       axis=data_axis)
    embed_key = None
    if key is not None:
      embed_key, key = jax.random.split(key)
    local_stages = jax.tree.map(lambda a: a[0], params.stages)
    # The embedding runs per microbatch inside stage 0 (with one stage
    # rank, the microbatches run in turn): nothing batch-sized is held.
    out, grads = executor.pipeline_value_and_grad_local(
        stage, head_loss, local_stages, params.head, inputs, targets,
        lowered=lowered, axis=stage_axis, remat=remat, key=key,
        microbatch_offset=offset(), has_aux=has_aux,
        compute_dtype=compute_dtype, embed_fn=embed,
        embed_params=params.embed, embed_key=embed_key,
        remat_policy=remat_policy)
    grads = PipelineParams(
        grads.embed, jax.tree.map(lambda g: g[None], masked(grads.stages)),
        grads.loss)
    loss, aux = jax.lax.pmean(out if has_aux else (out, None), data_axis)
    grads = zero.reduce_gradients(grads, split if zero_stage else base,
                                  axis=data_axis, summed=zero_stage == 3)
    return loss, aux, grads

  def program(state: TrainState, inputs, targets, key):
    base, split, _ = specs_of(state.params)
    specs = state_specs(state)
    if key is not None:  # a fresh key each step, a function of (key, step)
      key = jax.random.fold_in(key, state.step)
    grad_specs = split if zero_stage else base
    gradients = jax.shard_map(
        functools.partial(local_grads, base=base, split=split),
        mesh=None if manual else mesh,   # None: auto_axes' mesh, below
        in_specs=(_manual(specs.params, manual), P(data_axis), P(data_axis),
                  P()),
        out_specs=(P(), P(), _manual(grad_specs, manual)), axis_names=manual)
    if manual:   # 'tensor' Auto inside: XLA partitions the model as written
      gradients = jax.sharding.auto_axes(
          gradients, axes=tensor_axis, out_sharding=(P(), P(), grad_specs))
    loss, aux, grads = gradients(state.params, inputs, targets, key)
    state, stats = sharded_update(
        state, grads, loss=loss, optimizer=padded_optimizer(specs), mesh=mesh,
        state_specs=specs, max_grad_norm=max_grad_norm,
        update_specs=split if zero_stage == 1 else None)
    return state, stats._replace(aux=aux)

  compiled = jax.jit(program)
  batch_sharding = NamedSharding(mesh, P(data_axis))
  specs_by_signature = {}   # state specs, each state signature checked once

  def validate(state, batch) -> TrainState:
    """Checks ``(state, batch)``; returns the state's specs."""
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
    key = signature(state)
    if key not in specs_by_signature:
      logical = zero.logical_shapes(state)
      check_opt_state(logical._replace(params=optimizer_view(logical.params)),
                      optimizer)
      specs_by_signature[key] = state_specs(state)
    return specs_by_signature[key]

  def place(state, batch):
    return (zero.place(state, validate(state, batch), mesh=mesh),
            *jax.device_put(batch, batch_sharding))

  def step(state: TrainState, batch: tuple) -> tuple[TrainState, StepStats]:
    with jax.set_mesh(mesh):
      return compiled(*place(state, batch), key)

  def lower_step(state: TrainState, batch: tuple):
    with jax.set_mesh(mesh):
      return compiled.lower(*place(state, batch), key)

  step.lower = lower_step
  return Trainer(init, step, to_model_order)
