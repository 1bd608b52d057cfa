"""A 3D trainer's plan: its checked options and the shardings they imply.

``make_plan`` checks ``trainer``'s arguments once (errors before anything
is traced) into a ``Plan``; the ``PartitionSpec`` s of params, gradients,
the optimizer's per-layer view and whole states (``Specs``,
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

from jaxpar import data_parallel as zero
from jaxpar import tensor_parallel as tp
from jaxpar import vma
from jaxpar.mesh import axis_size
from jaxpar.parallel._from_nnx import PipelineModel
from jaxpar.parallel._layer_view import LayerView, layerwise, mirror_specs
from jaxpar.parallel._params import LayerParams, PipelineParams
from jaxpar.parallel._placement import padded_spec
from jaxpar.pipeline.executor import check_fn, stash_policy
from jaxpar.pipeline.schedules import (Schedule, TickTable, local_stages,
                                       tick_table)
from jaxpar.train_state import (PyTree, TrainState, check_compute_dtype,
                                check_key, check_max_grad_norm,
                                check_optimizer, replicated_specs, signature)


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


class Plan(NamedTuple):
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
    tied: a ``PipelineModel``'s ``tied`` (the embed params its head reads
      too), else ``None``.
    model_state: a ``PipelineModel``'s ``model_state`` (the shapes
      ``init`` needs one of), else ``None``.
    zero_stage, max_grad_norm, key, has_aux, compute_dtype, remat_policy:
      the options as ``trainer`` takes them (``key`` replicated on ``mesh``).
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
  cache: Cache


class Specs(NamedTuple):
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
  """``(functions, optimizer, stage_mask, tensor_specs, tied,
  model_state)`` of the arguments:
  the three functions, or a ``PipelineModel`` and the optimizer."""
  if not isinstance(embed_fn, PipelineModel):
    return ((embed_fn, stage_fn, loss_fn), optimizer, stage_mask, None, None,
            None)
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
          pm.tensor_specs, pm.tied, pm.model_state)


def make_plan(embed_fn, stage_fn, loss_fn, optimizer, *, schedule: Schedule,
              mesh: Mesh, stage_mask, max_grad_norm, tensor_rules, axes: Axes,
              zero_stage, key, has_aux, compute_dtype, remat_policy) -> Plan:
  """The checked options (errors before anything is traced)."""
  functions, optimizer, stage_mask, tensor_specs, tied, model_state = _parts(
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
  return Plan(
      functions=functions, optimizer=optimizer, schedule=schedule,
      table=tick_table(schedule), mesh=mesh, axes=axes, manual=manual,
      stage_mask=stage_mask,
      # the mask in the rank placement [p, v, ...], in numpy (no op to compile)
      mask_ranks=(None if stage_mask is None
                  else stage_mask[np.array(local_stages(schedule))]),
      view=LayerView.of(schedule, stage_mask), tensor_rules=tensor_rules,
      tensor_specs=tensor_specs, tied=tied, model_state=model_state,
      zero_stage=zero_stage,
      max_grad_norm=max_grad_norm, key=key, has_aux=has_aux,
      compute_dtype=compute_dtype, remat_policy=remat_policy,
      cache=Cache(specs={}, states={}))


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


def param_specs(plan: Plan, params: PipelineParams) -> Specs:
  """The ``Specs`` of placed params (``Padded`` leaves at their logical
  ``shape``), computed once per signature."""
  params = zero.logical_shapes(params)
  key = signature(params)
  if key not in plan.cache.specs:
    base = _base_specs(plan, params)
    plan.cache.specs[key] = Specs(base, _zero_specs(plan, params, base),
                                   _view_specs(plan, params, base))
  return plan.cache.specs[key]


def _base_specs(plan: Plan, params: PipelineParams) -> PipelineParams:
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


def _zero_specs(plan: Plan, params: PipelineParams,
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


def _view_specs(plan: Plan, params: PipelineParams,
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


def stored_specs(plan: Plan, specs: Specs) -> PipelineParams:
  """How the params are stored: split over ``data`` with ZeRO-3 only."""
  return specs.zero if plan.zero_stage == 3 else specs.base


def gradient_specs(plan: Plan, specs: Specs) -> PipelineParams:
  """How the gradients leave the ``shard_map``: reduce-scattered with ZeRO."""
  return specs.zero if plan.zero_stage else specs.base


def _view_of(plan: Plan, params: PipelineParams) -> LayerParams:
  return param_specs(plan, params).view


def optimizer_view(plan: Plan, params: PipelineParams) -> LayerParams:
  """The optimizer's view of rank-placement params, as shapes."""
  return jax.eval_shape(plan.view.of_params, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params))


def specs_of_state(plan: Plan, state: TrainState) -> TrainState:
  state = zero.logical_shapes(state)
  specs = param_specs(plan, state.params)
  return TrainState(P(), stored_specs(plan, specs), mirror_specs(
      state.opt_state, optimizer_view(plan, state.params), specs.view),
      replicated_specs(state.model_state))


def padded_optimizer(plan: Plan,
                     specs: TrainState) -> optax.GradientTransformation:
  """The optimizer on the per-layer view of logical leaves, its state
  stored padded (``data_parallel.padded_optimizer``) as ``specs`` say."""
  layer_optimizer = layerwise(plan.optimizer, plan.view,
                              specs=functools.partial(_view_of, plan))
  return zero.padded_optimizer(layer_optimizer, specs.opt_state,
                               mesh=plan.mesh)
