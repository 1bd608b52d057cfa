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

**Options** mean what they mean in ``jaxpar.data_parallel.trainer``:
``key`` (dropout; masks a function of the seed, the step, the logical stage
and the global microbatch, so the same on every mesh), ``has_aux`` (metrics
averaged like the loss, in ``StepStats.aux``), ``compute_dtype`` (bf16
compute on float32 params and optimizer state), ``remat_policy`` (what the
backward keeps of each stage's forward; ``None`` is ``'everything'``, the
default is ``'dots'``), ``max_grad_norm`` and ``zero_stage``;
``schedule.num_microbatches`` is its ``num_microbatches``.

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
``zero_stage`` (params in the rank order ``[p, v, ...]``, optimizer state
per layer): ``Trainer.params`` gives them unpadded, ``jaxpar.checkpoint``
saves them unpadded and restores them onto any mesh and any ``zero_stage``,
and a state from one trainer is placed as another trainer stores it by its
``step``. Its ``params`` say their rank order (a ``PipelineParams``
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

from jaxpar.data_parallel import internal as dp_internal
from jaxpar.data_parallel.internal import batch_size_of, check_opt_state
from jaxpar.mesh import axis_size
from jaxpar.parallel._gradients import gradient_program, tied_paths
from jaxpar.parallel._layer_view import in_model_order
from jaxpar.parallel._params import PipelineParams
from jaxpar.parallel._placement import (placed, relaid,
                                        stages_in_model_order)
from jaxpar.parallel._config import (Axes, Parts, TrainerConfig,
                                     function_parts, make_config,
                                     model_parts, optimizer_view,
                                     padded_optimizer, param_specs,
                                     refuse_model, require_model,
                                     specs_of_state)
from jaxpar.parallel._from_nnx import PipelineModel
from jaxpar.pipeline import executor
from jaxpar.pipeline.executor.internal import check_leading
from jaxpar.pipeline.schedules import Schedule
from jaxpar.tensor_parallel import internal as tp_internal
from jaxpar.train_state import (StepStats, Trainer, TrainState,
                                check_update_args, sharded_update)
from jaxpar.train_state.internal import (PyTree, auto_view, placed_init,
                                         signature)


def _first_checked(check: Callable[[Any], None]):
  """``entry`` running ``check`` on its first positional argument before
  Python binds the others: a model given to ``trainer``, or functions to
  ``model_trainer``, then gets the right call, not a missing argument."""
  def wrap(entry):
    @functools.wraps(entry)
    def checked(*args, **kwargs):
      if args:
        check(args[0])
      return entry(*args, **kwargs)
    return checked
  return wrap


def _build(parts: Parts, optimizer: Any, *, data_axis: str, stage_axis: str,
           tensor_axis: str, **options: Any) -> Trainer:
  """The ``Trainer`` of both entries: the checked config, then its parts."""
  config = make_config(parts, optimizer,
                       axes=Axes(data_axis, stage_axis, tensor_axis),
                       **options)
  init = placed_init(functools.partial(_storage, config), mesh=config.mesh)
  return Trainer(functools.partial(_init, config, init), _step(config),
                 functools.partial(_params, config), _opt_state(config))


@_first_checked(refuse_model)
def trainer(
    embed_fn: Callable[..., jax.Array],
    stage_fn: Callable[..., jax.Array],
    loss_fn: Callable[..., jax.Array],
    optimizer: optax.GradientTransformation,
    *,
    schedule: Schedule,
    mesh: Mesh,
    stage_mask: np.ndarray | None = None,
    tensor_rules: Mapping[str, Any] | None = None,
    max_grad_norm: float | None = None,
    data_axis: str = 'data',
    stage_axis: str = 'stage',
    tensor_axis: str = 'tensor',
    zero_stage: int = 0,
    key: jax.Array | None = None,
    has_aux: bool = False,
    compute_dtype: Any = None,
    remat_policy: Any = 'dots',
    w_recompute: bool = False,
) -> Trainer:
  """Data x pipeline x tensor parallel training of a model given as three
  functions.

  The model is ``loss_fn(head, stage_fn(stages[S-1], ... stage_fn(stages[0],
  embed_fn(embed, inputs))), targets)``. Each step splits the batch over
  ``data_axis``, runs the stages through the pipeline ``schedule`` over
  ``stage_axis`` and the functions tensor-parallel over ``tensor_axis``,
  then applies ``optimizer`` to the whole model, one layer at a time as on
  one device. The options mean what they mean in ``data_parallel.trainer``.
  For a Flax NNX model cut with ``parallel.from_nnx`` use ``model_trainer``.

  Args:
    embed_fn: ``embed_fn(embed_params, inputs) -> x``, run per microbatch
      before the first stage (on local tensor shards).
    stage_fn: ``stage_fn(stage_params, x) -> y`` with ``y`` shaped like
      ``x``.
    loss_fn: ``loss_fn(head_params, y, targets) -> scalar``, the mean loss
      of a microbatch (``(scalar, aux)`` with ``has_aux``). With a model
      state (``init``'s ``model_state``, ``PipelineParams(embed, stages,
      head)`` of state that is not trained, e.g. BatchNorm statistics,
      ``None`` parts where there is none) each function with a part gets
      it as ``state=s`` and returns ``(its value, new_state)``, per
      microbatch in order.
    optimizer: any optax ``GradientTransformation``. It sees the per-layer
      view ``LayerParams(embed, [layer_0, ...], head)``: each layer shaped
      as in the dense model, so per-leaf statistics (LAMB, Adafactor, Muon)
      are those of one device.
    schedule: a ``jaxpar.pipeline`` schedule with ``num_ranks`` the size of
      ``stage_axis``; ``schedule.num_microbatches`` microbatches per data
      shard (``data_parallel.trainer``'s ``num_microbatches``).
    mesh: from ``jaxpar.make_mesh(data=..., stage=..., tensor=...)``.
    stage_mask: bool ``[num_stages, ...]`` (a prefix of every stage leaf's
      shape): ``True`` entries are the model's layers, ``False`` ones
      frozen identity slots (``LayerSplit.mask``). ``None``: each stage is
      one layer.
    tensor_rules: ``{regex: spec}`` splitting params over ``tensor_axis``
      (``tensor_parallel.param_specs``; ``gpt.TENSOR_RULES``). ``None``:
      the params' Flax metadata.
    max_grad_norm, zero_stage, has_aux, compute_dtype: as for
      ``data_parallel.trainer``.
    data_axis, stage_axis, tensor_axis: the mesh axis names.
    key: a PRNG key for dropout, or ``None``. The three functions then get
      ``key=`` by keyword, drawn from the step, the microbatch's index in
      the global batch and the logical stage: the same masks on every mesh
      and schedule with the same stages and microbatches.
    remat_policy: what the backward keeps of each stage's forward:
      ``'dots'`` (the default: matmul outputs), ``'everything'``,
      ``'dots_no_batch'``, ``'nothing'`` or a ``jax.checkpoint_policies``
      policy, as in ``data_parallel.trainer``; ``None`` is ``'everything'``.
    w_recompute: a schedule's ``W`` blocks recompute the cotangents its
      ``I`` blocks would keep for them (``pipeline_value_and_grad``): less
      memory for zero-bubble and V schedules, one more matrix product per
      weight in ``W``.

  Returns:
    ``Trainer(init, step, params, opt_state)``: ``init(PipelineParams,
    model_state=None)`` places model-order params (stages ``[num_stages,
    ...]``, ``model_state.stages`` too); ``step(state, (inputs, targets)) -> (state, StepStats)``;
    ``params(state)`` gives them back in model order; ``opt_state(state)``
    the optimizer state laid out like them.

  Example:
    >>> import numpy as np, optax, jaxpar
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
    >>> ids = np.zeros((4, 8), np.int32)
    >>> state, stats = trainer.step(trainer.init(pp), (ids, ids))
    >>> int(state.step), trainer.params(state).stages['ln1']['scale'].shape
    (1, (2, 1, 16))
  """
  return _build(function_parts(embed_fn, stage_fn, loss_fn,
                               stage_mask=stage_mask,
                               tensor_rules=tensor_rules),
                optimizer, schedule=schedule, mesh=mesh,
                max_grad_norm=max_grad_norm, data_axis=data_axis,
                stage_axis=stage_axis, tensor_axis=tensor_axis,
                zero_stage=zero_stage, key=key, has_aux=has_aux,
                compute_dtype=compute_dtype, remat_policy=remat_policy,
                w_recompute=w_recompute)


@_first_checked(require_model)
def model_trainer(
    model: PipelineModel,
    optimizer: optax.GradientTransformation,
    *,
    schedule: Schedule,
    mesh: Mesh,
    max_grad_norm: float | None = None,
    data_axis: str = 'data',
    stage_axis: str = 'stage',
    tensor_axis: str = 'tensor',
    zero_stage: int = 0,
    key: jax.Array | None = None,
    has_aux: bool = False,
    compute_dtype: Any = None,
    remat_policy: Any = 'dots',
    w_recompute: bool = False,
) -> Trainer:
  """Data x pipeline x tensor parallel training of a Flax NNX model cut by
  ``parallel.from_nnx``.

  The same step as ``trainer``, with the model's three functions, its
  ``stage_mask``, its tensor split (``from_nnx(tensor_rules=...)`` or the
  model's Flax annotations; XLA partitions its layers as written), its tied
  params (one param, the gradients of both uses summed) and its model
  state (BatchNorm statistics, carried in ``TrainState.model_state``).

  Args:
    model: a ``PipelineModel`` (``parallel.from_nnx``).
    optimizer, schedule, mesh, max_grad_norm, data_axis, stage_axis,
      tensor_axis, zero_stage, key, has_aux, compute_dtype, remat_policy,
      w_recompute: as for ``trainer``.

  Returns:
    A ``Trainer``; ``init(model.params, model.model_state)`` gives the first
    state, and ``model.update(module, trainer.params(state),
    state.model_state)`` writes the trained values back.

  Example:
    >>> import numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> class Net(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.embed = nnx.Embed(16, 8, rngs=rngs)
    ...     self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs)
    ...                             for _ in range(2)])
    ...     self.out = nnx.Linear(8, 16, rngs=rngs)
    >>> net = Net(nnx.Rngs(0))
    >>> model = jaxpar.parallel.from_nnx(
    ...     net, blocks='layers', num_stages=2,
    ...     embed=lambda m, ids: m.embed(ids),
    ...     head_loss=lambda m, y, t: optax.losses.
    ...         softmax_cross_entropy_with_integer_labels(m.out(y), t).mean())
    >>> trainer = jaxpar.parallel.model_trainer(
    ...     model, optax.sgd(0.1),
    ...     schedule=jaxpar.pipeline.one_f_one_b(2, 2),
    ...     mesh=jaxpar.make_mesh(data=4, stage=2))
    >>> ids = np.zeros((8, 4), np.int32)
    >>> state, stats = trainer.step(trainer.init(model.params), (ids, ids))
    >>> model.update(net, trainer.params(state))
    >>> int(state.step)
    1
  """
  return _build(model_parts(model), optimizer, schedule=schedule, mesh=mesh,
                max_grad_norm=max_grad_norm, data_axis=data_axis,
                stage_axis=stage_axis, tensor_axis=tensor_axis,
                zero_stage=zero_stage, key=key, has_aux=has_aux,
                compute_dtype=compute_dtype, remat_policy=remat_policy,
                w_recompute=w_recompute)


# ------------------------------------------------------ init and params


def _init(config: TrainerConfig, init: Callable[..., TrainState],
          params: PipelineParams, model_state: PyTree = None) -> TrainState:
  """``Trainer.init``: checks model-order ``params`` (and ``model_state``),
  then places them (the state's params typed with the schedule's
  placement: ``_placement``)."""
  _check_model_state(config, model_state)
  if not isinstance(params, PipelineParams):
    raise TypeError('params must be a jaxpar.parallel.PipelineParams(embed, '
                    f'stages, head), got {type(params).__name__}.')
  check_leading(params.stages, config.schedule.num_stages, 'params.stages',
                'schedule.num_stages')
  if config.stage_mask is not None:
    for leaf in jax.tree.leaves(params.stages):
      if leaf.shape[:config.stage_mask.ndim] != config.stage_mask.shape:
        raise ValueError(
            f'stage_mask shape {config.stage_mask.shape} is not a prefix of a '
            f'stage leaf shape {leaf.shape}.')
  if config.tensor_specs is None:   # a PipelineModel's tensor_specs check it
    for part in params:
      tp_internal.check_divisible(part, mesh=config.mesh,
                                  rules=config.tensor_rules,
                                  tensor_axis=config.axes.tensor)
  return _typed(config, init(params, model_state))


def _check_model_state(config: TrainerConfig, model_state: PyTree) -> None:
  """``TypeError`` or ``ValueError`` for a missing or misshapen model
  state."""
  if model_state is None and config.model_state is not None:
    raise ValueError(
        'the PipelineModel has model state (its nnx.BatchStat s: '
        'PipelineModel.model_state); pass it to init, trainer.init('
        'pm.params, pm.model_state), so each step carries and updates it.')
  if model_state is None:
    return
  if not isinstance(model_state, PipelineParams):
    raise TypeError(
        'model_state must be a jaxpar.parallel.PipelineParams(embed, '
        'stages, head) of the state each part carries (None where a part '
        f'has none), e.g. PipelineParams(None, stage_state, None); got '
        f'{type(model_state).__name__}. A PipelineModel gives it: '
        'trainer.init(pm.params, pm.model_state).')
  if model_state.stages is not None:
    check_leading(model_state.stages, config.schedule.num_stages,
                  'model_state.stages', 'schedule.num_stages')


def _typed(config: TrainerConfig, state: TrainState) -> TrainState:
  """``state`` as the user gets it: params typed with the rank order
  (``_placement.placed``), so another trainer re-lays it (``relaid``)."""
  return state._replace(params=placed(state.params, config.schedule))


def _to_ranks(schedule: Schedule, params: PipelineParams) -> PipelineParams:
  return params._replace(
      stages=executor.stages_to_ranks(params.stages, schedule))


def _fresh_state(config: TrainerConfig, params: PipelineParams) -> TrainState:
  return TrainState(jnp.zeros((), jnp.int32), params,
                    config.optimizer.init(config.view.of_params(params)))


def _prepare(config: TrainerConfig, specs: TrainState,
             params: PipelineParams) -> PipelineParams:
  """Model-order params as stored: rank order, padded where ZeRO pads."""
  return dp_internal.pad(_to_ranks(config.schedule, params), specs.params,
                         mesh=config.mesh)


def _storage(config: TrainerConfig, params: PipelineParams):
  """``(prepare, optimizer, state specs)`` of model-order params' shapes
  (``train_state.internal.placed_init``)."""
  params = jax.eval_shape(functools.partial(_to_ranks, config.schedule), params)
  tp_internal.check_axis_used(param_specs(config, params).base,
                              mesh=config.mesh,
                              tensor_axis=config.axes.tensor)
  specs = specs_of_state(config, jax.eval_shape(
      functools.partial(_fresh_state, config), params))
  return (functools.partial(_prepare, config, specs),
          padded_optimizer(config, specs), specs)


def _params(config: TrainerConfig, state: TrainState) -> PipelineParams:
  """``Trainer.params``: stages back in model order ``[num_stages, ...]``, at
  their logical shapes (``dp_internal.unpadded``), shards kept; from the
  placement the state says it has (else the trainer's)."""
  schedule = getattr(type(state.params), 'schedule', config.schedule)
  params = PipelineParams(*dp_internal.unpadded(state.params))
  return auto_view(params._replace(
      stages=stages_in_model_order(params.stages, schedule)))


def _opt_state(config: TrainerConfig) -> Callable[[TrainState], PyTree]:
  """``Trainer.opt_state``: the per-layer optimizer state laid out like
  ``Trainer.params`` (``LayerParams`` -> ``PipelineParams``, stages in model
  order ``[num_stages, ...]``, zeros in identity slots), one jitted program
  on the (``Auto``-axes) global arrays."""
  to_stages = lambda stages: jax.tree.map(
      lambda a: executor.ranks_to_stages(a, config.schedule), stages)
  program = jax.jit(lambda opt_state: in_model_order(opt_state, config.view,
                                                       to_stages))

  def opt_state(state: TrainState) -> PyTree:
    return program(auto_view(dp_internal.unpadded(state.opt_state)))
  return opt_state


# ------------------------------------------------------------------- the step


def _program(config: TrainerConfig, state: TrainState, inputs: Any,
             targets: Any,
             key: jax.Array | None) -> tuple[TrainState, StepStats]:
  """The jitted step: gradients in the ``shard_map``, then the update on
  global arrays (``train_state.sharded_update``)."""
  specs = param_specs(config, state.params)
  state_specs = specs_of_state(config, state)
  if key is not None:  # a fresh key each step, a function of (key, step)
    key = jax.random.fold_in(key, state.step)
  tied = tied_paths(config, state.params, inputs, targets)
  loss, aux, grads, model_state = gradient_program(
      config, specs, state_specs, tied)(state.params, inputs, targets, key,
                                        state.model_state)
  state, stats = sharded_update(
      state, grads, loss=loss,
      optimizer=padded_optimizer(config, state_specs), mesh=config.mesh,
      state_specs=state_specs, max_grad_norm=config.max_grad_norm,
      update_specs=specs.zero if config.zero_stage == 1 else None,
      model_state=model_state)
  return state, stats._replace(aux=aux)


def _validate(config: TrainerConfig, state: Any, batch: Any) -> TrainState:
  """Checks ``(state, batch)``; returns the state's specs."""
  if not isinstance(state, TrainState):
    raise TypeError('state must be a TrainState from Trainer.init, got '
                    f'{type(state).__name__}.')
  if not (isinstance(batch, tuple) and len(batch) == 2):
    raise TypeError('batch must be a tuple (inputs, targets).')
  size = batch_size_of(batch)
  n_data = axis_size(config.mesh, config.axes.data)
  n = n_data * config.schedule.num_microbatches
  if size % n:
    raise ValueError(
        f'batch size {size} is not divisible by {config.axes.data} size '
        f'{n_data} x num_microbatches {config.schedule.num_microbatches} = '
        f'{n}; use a multiple of {n}.')
  key = signature(state)
  if key not in config.cache.states:
    logical = dp_internal.logical_shapes(state)
    view = optimizer_view(config, logical.params)
    check_opt_state(logical._replace(params=view), config.optimizer)
    check_update_args(config.optimizer, view, logical.opt_state)
    config.cache.states[key] = specs_of_state(config, state)
  return config.cache.states[key]


def _place(config: TrainerConfig, state: TrainState, batch: tuple) -> tuple:
  """``(state, inputs, targets)`` placed as the step takes them (a state of
  another schedule's placement re-laid: ``_placement.relaid``)."""
  if isinstance(state, TrainState) and isinstance(state.params,
                                                  PipelineParams):
    state = state._replace(params=relaid(state.params, config.schedule))
  return (dp_internal.place(state, _validate(config, state, batch),
                            mesh=config.mesh),
          *jax.device_put(batch,
                          NamedSharding(config.mesh, P(config.axes.data))))


def _step(config: TrainerConfig) -> Callable[[TrainState, tuple],
                                   tuple[TrainState, StepStats]]:
  """``Trainer.step`` (and ``step.lower``): one jitted program, the state
  and batch placed first."""
  compiled = jax.jit(functools.partial(_program, config))

  def step(state: TrainState, batch: tuple) -> tuple[TrainState, StepStats]:
    with jax.set_mesh(config.mesh):
      state, stats = compiled(*_place(config, state, batch), config.key)
    return _typed(config, state), stats

  def lower(state: TrainState, batch: tuple):
    with jax.set_mesh(config.mesh):
      return compiled.lower(*_place(config, state, batch), config.key)

  step.lower = lower
  return step
