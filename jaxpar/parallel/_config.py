"""A 3D trainer's config: its checked options and the shardings they imply.

``make_config`` checks the arguments of ``trainer`` and ``model_trainer``
once (errors before anything is traced) into a ``TrainerConfig``; the
``PartitionSpec`` s of params, gradients, the optimizer's per-layer view
and whole states (``Specs``,
``specs_of_state``) follow from it and from the params' shapes, memoised
per signature.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import data_parallel
from jaxpar import tensor_parallel as tp
from jaxpar import vma
from jaxpar._validate import check_keywords
from jaxpar.data_parallel import internal as dp_internal
from jaxpar.mesh import axis_size
from jaxpar.parallel._from_nnx import PipelineModel
from jaxpar.parallel._layer_view import LayerView, layerwise, mirror_specs
from jaxpar.parallel._params import LayerParams, PipelineParams
from jaxpar.parallel._placement import padded_spec
from jaxpar.pipeline.executor.internal import check_bool, check_fn
from jaxpar.pipeline.schedules import (Schedule, TickTable, local_stages,
                                       tick_table)
from jaxpar.train_state import TrainState, check_remat_policy
from jaxpar.train_state.internal import (PyTree, check_compute_dtype,
                                         check_key, check_max_grad_norm,
                                         check_optimizer, replicated_specs,
                                         signature)


class Axes(NamedTuple):
  """The mesh axis names."""
  data: str
  stage: str
  tensor: str


class Cache(NamedTuple):
  """A trainer's memos by ``signature``: the ``Specs`` of each params
  signature, the state specs of each state signature (checked once)."""
  specs: dict
  states: dict


class TrainerConfig(NamedTuple):
  """What every part of one trainer uses: its options, checked once.

  Attributes:
    functions: ``(embed_fn, stage_fn, loss_fn)``, lifted (``jaxpar.vma``).
    optimizer: the user's optimizer; it sees the per-layer view.
    schedule: the schedule; ``table`` its tick table.
    mesh: the mesh; ``axes`` its axis names.
    manual: the axes the gradient ``shard_map`` is manual over (empty: all).
    stage_mask: bool ``[num_stages, ...]`` or ``None``; ``mask_ranks`` the
      same in the rank order ``[p, v, ...]``.
    view: where each layer sits in the rank order (the optimizer's view).
    tensor_rules: the tensor rules of the three functions' params.
    tensor_specs: a ``PipelineModel``'s ``tensor_specs`` (its layers run as
      written, XLA partitions ``tensor``), else ``None``.
    tied: a ``PipelineModel``'s ``tied`` (the embed params its head reads
      too), else ``None``.
    model_state: a ``PipelineModel``'s ``model_state`` (the shapes
      ``init`` needs one of), else ``None``.
    zero_stage, max_grad_norm, key, has_aux, compute_dtype, remat_policy,
      w_recompute: the options as ``trainer`` takes them (``key`` replicated on ``mesh``).
    cache: the memos.
  """
  functions: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]
  optimizer: optax.GradientTransformation
  schedule: Schedule
  table: TickTable
  mesh: Mesh
  axes: Axes
  manual: frozenset[str]
  stage_mask: np.ndarray | None
  mask_ranks: np.ndarray | None
  view: LayerView
  tensor_rules: Mapping[str, Any] | None
  tensor_specs: Callable[..., PipelineParams] | None
  tied: Callable[..., tuple] | None
  model_state: PyTree
  zero_stage: int
  max_grad_norm: float | None
  key: jax.Array | None
  has_aux: bool
  compute_dtype: Any
  remat_policy: Any
  w_recompute: bool
  cache: Cache


class Specs(NamedTuple):
  """The ``PartitionSpec``s of one params signature (rank order).

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


class Parts(NamedTuple):
  """What a trainer trains: the three functions, and what a
  ``PipelineModel`` adds to them (``None`` for bare functions).

  Attributes:
    functions: ``(embed_fn, stage_fn, loss_fn)``.
    stage_mask: bool ``[num_stages, ...]`` or ``None``.
    tensor_rules: the rules splitting the functions' params over ``tensor``.
    tensor_specs, tied, model_state: a ``PipelineModel``'s.
  """
  functions: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]
  stage_mask: Any = None
  tensor_rules: Mapping[str, Any] | None = None
  tensor_specs: Callable[..., PipelineParams] | None = None
  tied: Callable[..., tuple] | None = None
  model_state: PyTree = None


# Names and data arguments of the three functions, as the step calls them.
FUNCTIONS = (('embed_fn', 'params, inputs'), ('stage_fn', 'params, x'),
             ('loss_fn', 'params, y, targets'))


def refuse_model(embed_fn: Any) -> None:
  """``TypeError`` for a ``PipelineModel`` given to ``parallel.trainer``."""
  if isinstance(embed_fn, PipelineModel):
    raise TypeError(
        'parallel.trainer takes three functions (embed_fn, stage_fn, '
        'loss_fn); a PipelineModel (parallel.from_nnx) trains with '
        'parallel.model_trainer(model, optimizer, schedule=..., mesh=...).')


def require_model(model: Any) -> None:
  """``TypeError`` unless ``model`` is a ``PipelineModel``."""
  if not isinstance(model, PipelineModel):
    raise TypeError(
        f'parallel.model_trainer takes a PipelineModel (from '
        f'parallel.from_nnx), got {type(model).__name__}; three functions '
        'train with parallel.trainer(embed_fn, stage_fn, loss_fn, optimizer, '
        'schedule=..., mesh=...).')


def function_parts(embed_fn, stage_fn, loss_fn, *, stage_mask,
                   tensor_rules) -> Parts:
  """``parallel.trainer``'s ``Parts``: three functions, checked callable."""
  refuse_model(embed_fn)
  functions = (embed_fn, stage_fn, loss_fn)
  for (name, _), fn in zip(FUNCTIONS, functions):
    check_fn(fn, name)
  return Parts(functions, stage_mask, tensor_rules)


def model_parts(model: Any) -> Parts:
  """``parallel.model_trainer``'s ``Parts``: a ``PipelineModel``'s."""
  require_model(model)
  return Parts(model.functions, model.stage_mask, None, model.tensor_specs,
               model.tied, model.model_state)


def make_config(parts: Parts, optimizer, *, schedule: Schedule, mesh: Mesh,
                max_grad_norm, axes: Axes, zero_stage, key, has_aux,
                compute_dtype, remat_policy, w_recompute) -> TrainerConfig:
  """The checked options (errors before anything is traced)."""
  check_key(key)
  if key is not None:
    for (name, data), fn in zip(FUNCTIONS, parts.functions):
      check_keywords(fn, name, data, ('key',))
  # The user's functions as on one device (jaxpar.vma).
  functions = tuple(vma.lift(fn, axes=(axes.data, axes.stage))
                    for fn in parts.functions)
  tensor_specs = parts.tensor_specs
  optimizer = check_optimizer(optimizer)
  zero_stage = dp_internal.check_zero_stage(zero_stage)
  check_max_grad_norm(max_grad_norm)
  for axis in axes:
    axis_size(mesh, axis)
  # A PipelineModel's layers run as written on full-size arrays: 'tensor'
  # stays an Auto axis that XLA partitions from the params' shardings,
  # inside a shard_map manual over data and stage only (empty: all axes).
  manual = (frozenset() if tensor_specs is None
            else frozenset({axes.data, axes.stage}))
  _check_schedule(schedule, axis_size(mesh, axes.stage), axes.stage)
  stage_mask = _check_mask(parts.stage_mask, schedule)
  compute_dtype = check_compute_dtype(compute_dtype)
  check_remat_policy(remat_policy)
  check_bool(w_recompute, 'w_recompute')
  if key is not None:
    key = jax.device_put(key, NamedSharding(mesh, P()))
  return TrainerConfig(
      functions=functions, optimizer=optimizer, schedule=schedule,
      table=tick_table(schedule), mesh=mesh, axes=axes, manual=manual,
      stage_mask=stage_mask,
      # the mask in the rank order [p, v, ...], in numpy (no op to compile)
      mask_ranks=(None if stage_mask is None
                  else stage_mask[np.array(local_stages(schedule))]),
      view=LayerView.of(schedule, stage_mask),
      tensor_rules=parts.tensor_rules, tensor_specs=tensor_specs,
      tied=parts.tied, model_state=parts.model_state, zero_stage=zero_stage,
      max_grad_norm=max_grad_norm, key=key, has_aux=has_aux,
      compute_dtype=compute_dtype, remat_policy=remat_policy,
      w_recompute=w_recompute, cache=Cache(specs={}, states={}))


# ------------------------------------------------------------------ the specs


def manual_specs(specs: PyTree, axes: frozenset[str]) -> PyTree:
  """``specs`` over the manual ``axes`` of a shard_map only (empty: all)."""
  if not axes:
    return specs

  def keep(entry):
    kept = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,))
                 if a in axes)
    return kept if len(kept) > 1 else (kept[0] if kept else None)
  return jax.tree.map(lambda s: P(*map(keep, s)), specs,
                      is_leaf=lambda x: isinstance(x, P))


def param_specs(config: TrainerConfig, params: PipelineParams) -> Specs:
  """The ``Specs`` of placed params (``Padded`` leaves at their logical
  ``shape``), computed once per signature."""
  params = dp_internal.logical_shapes(params)
  key = signature(params)
  if key not in config.cache.specs:
    base = _base_specs(config, params)
    config.cache.specs[key] = Specs(base, _zero_specs(config, params, base),
                                    _view_specs(config, params, base))
  return config.cache.specs[key]


def _base_specs(config: TrainerConfig,
                params: PipelineParams) -> PipelineParams:
  """Over ``tensor`` as the tensor rules say, over ``stage`` on a stage
  leaf's rank dim."""
  if config.tensor_specs is not None:
    base = config.tensor_specs(params,
                               axis_size(config.mesh, config.axes.tensor))
  else:
    base = PipelineParams(*(
        tp.param_specs(part, rules=config.tensor_rules,
                       tensor_axis=config.axes.tensor)
        for part in params))
  return base._replace(stages=jax.tree.map(
      lambda leaf, s: P(config.axes.stage, *padded_spec(s, np.ndim(leaf))[1:]),
      params.stages, base.stages))


def _zero_specs(config: TrainerConfig, params: PipelineParams,
                base: PipelineParams) -> PipelineParams:
  """``base`` with ZeRO's ``data`` axis on one more dim of every leaf."""
  # Leading dims ZeRO never splits: a stage leaf's [p, v] and the dims the
  # stage mask covers after them (the mask applies to whole local rows).
  skip = PipelineParams(
      0, 2 if config.stage_mask is None else 1 + config.stage_mask.ndim, 0)
  return PipelineParams(*(
      data_parallel.data_specs(part, spec, mesh=config.mesh,
                               data_axis=config.axes.data, skip=lead, pad=True)
      for part, spec, lead in zip(params, base, skip)))


def _view_specs(config: TrainerConfig, params: PipelineParams,
                base: PipelineParams) -> LayerParams:
  """The per-layer view's specs: each layer's tensor split, and ``stage``
  (and ``data`` with ZeRO) on one more dim."""
  lead = len(config.view.shape)
  shapes = LayerParams(params.embed, jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(np.shape(leaf)[lead:], leaf.dtype),
      params.stages), params.head)
  specs = LayerParams(base.embed, jax.tree.map(
      lambda leaf, s: P(*padded_spec(s, np.ndim(leaf))[lead:]),
      params.stages, base.stages), base.head)
  for axis in (config.axes.stage,) + ((config.axes.data,) if config.zero_stage
                                    else ()):
    specs = LayerParams(*(jax.tree.map(
        lambda leaf, spec, axis=axis: _view_spec(
            config.mesh, leaf, spec, axis, axis == config.axes.data,
            config.axes.tensor),
        part, spec) for part, spec in zip(shapes, specs)))
  return specs._replace(layers=[specs.layers] * len(config.view.positions))


def _view_spec(mesh: Mesh, leaf: Any, spec: P, axis: str, pad: bool,
               tensor: str) -> P:
  """``data_parallel.data_spec`` of a view leaf, where a dim split only by
  a ``tensor`` axis of size 1 counts as free: ZeRO pads a leaf that
  ``axis`` divides no dim of on such a dim (``('tensor', 'data')``)
  instead of leaving it whole on every ``data`` rank."""
  shape = np.shape(leaf)
  out = data_parallel.data_spec(shape, spec, mesh=mesh, data_axis=axis,
                                pad=pad)
  if (not pad or axis_size(mesh, axis) == 1 or axis_size(mesh, tensor) > 1
      or data_parallel.data_dim(out, axis) is not None):
    return out
  entries = list(spec) + [None] * (len(shape) - len(spec))
  free = [d for d, e in enumerate(entries) if e in (tensor, (tensor,))]
  if not free:
    return out
  dim = max(free, key=lambda d: (shape[d], -d))
  entries[dim] = (tensor, axis)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def stored_specs(config: TrainerConfig, specs: Specs) -> PipelineParams:
  """How the params are stored: split over ``data`` with ZeRO-3 only."""
  return specs.zero if config.zero_stage == 3 else specs.base


def gradient_specs(config: TrainerConfig, specs: Specs) -> PipelineParams:
  """How the gradients leave the ``shard_map``: reduce-scattered with ZeRO."""
  return specs.zero if config.zero_stage else specs.base


def _view_of(config: TrainerConfig, params: PipelineParams) -> LayerParams:
  return param_specs(config, params).view


def optimizer_view(config: TrainerConfig,
                   params: PipelineParams) -> LayerParams:
  """The optimizer's view of rank-order params, as shapes."""
  return jax.eval_shape(config.view.of_params, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params))


def specs_of_state(config: TrainerConfig, state: TrainState) -> TrainState:
  state = dp_internal.logical_shapes(state)
  specs = param_specs(config, state.params)
  return TrainState(P(), stored_specs(config, specs), mirror_specs(
      state.opt_state, optimizer_view(config, state.params), specs.view),
      replicated_specs(state.model_state))


def padded_optimizer(config: TrainerConfig,
                     specs: TrainState) -> optax.GradientTransformation:
  """The optimizer on the per-layer view of logical leaves, its state
  stored padded (``data_parallel.internal.padded_optimizer``) as ``specs``
  say."""
  layer_optimizer = layerwise(config.optimizer, config.view,
                              specs=functools.partial(_view_of, config))
  return dp_internal.padded_optimizer(layer_optimizer, specs.opt_state,
                                      mesh=config.mesh)
