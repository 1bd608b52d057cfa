"""The 3D step's gradients: one ``shard_map`` over the mesh around the
pipeline executor (``gradient_program``).

Per device: the embedding, the stages and the head through
``pipeline_value_and_grad_local`` (ZeRO-3: each function gathers each param
at its first use, a scanned stage one layer per iteration:
``data_parallel.gathered``), tied params' gradients summed (``untied``),
the loss and the gradients averaged or reduce-scattered over ``data``, and
the model state (BatchNorm statistics: a ``PipelineParams`` of the
embedding's, the stages', the head's) back in model order, averaged over
``data``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar import data_parallel
from jaxpar.data_parallel import internal as dp_internal
from jaxpar.mesh import axis_size
from jaxpar.parallel._config import (Specs, TrainerConfig, gradient_specs,
                                     manual_specs, stored_specs)
from jaxpar.parallel._params import PipelineParams, untied, with_tied
from jaxpar.pipeline import executor
from jaxpar.pipeline.schedules import local_stages
from jaxpar.train_state import TrainState
from jaxpar.train_state.internal import PyTree


def _masked(config: TrainerConfig, stage_grads: PyTree) -> PyTree:
  """Zero gradients for the slots ``stage_mask`` marks ``False``."""
  if config.stage_mask is None:
    return stage_grads
  mine = jnp.asarray(config.mask_ranks)[jax.lax.axis_index(config.axes.stage)]
  return jax.tree.map(
      lambda g: jnp.where(
          mine.reshape(mine.shape + (1,) * (g.ndim - mine.ndim)), g,
          jnp.zeros((), g.dtype)), stage_grads)


def _functions(config: TrainerConfig, split: PipelineParams,
               tied: tuple) -> tuple:
  """embed/stage/loss functions of local params (ZeRO-3: of slices that
  each call gathers over ``data`` where it uses them, inside the stage's
  scan one layer at a time); the loss function's params are
  ``with_tied(head, embed, tied)``."""
  if config.zero_stage != 3:
    return config.functions
  embed_fn, stage_fn, loss_fn = config.functions
  gathered = functools.partial(data_parallel.gathered,
                               data_axis=config.axes.data)
  return (gathered(embed_fn, split.embed),
          gathered(stage_fn, split.stages, skip=2),
          gathered(loss_fn, with_tied(split.head, split.embed, tied)))


def tied_paths(config: TrainerConfig, params: PipelineParams, inputs: Any,
               targets: Any) -> tuple:
  """The embed params the head reads too (``PipelineModel.tied``), from
  the shapes of the params and of one microbatch."""
  if config.tied is None:
    return ()
  n = (axis_size(config.mesh, config.axes.data)
       * config.schedule.num_microbatches)
  microbatch = lambda a: jax.ShapeDtypeStruct(
      (np.shape(a)[0] // n,) + np.shape(a)[1:], a.dtype)
  found = []
  # Traced as the step runs them, inside a shard_map over the mesh: a
  # function may use collectives over its axes (SyncBatchNorm's pmean over
  # 'data' in a stem).
  jax.eval_shape(jax.shard_map(
      lambda: found.append(config.tied(
          dp_internal.logical_shapes(params),
          jax.tree.map(microbatch, inputs),
          jax.tree.map(microbatch, targets))) or (),
      mesh=config.mesh, in_specs=(), out_specs=()))
  return found[0]


def _local_grads(config: TrainerConfig, specs: Specs, tied: tuple,
                 params: PipelineParams, inputs: Any, targets: Any,
                 key: jax.Array | None, model_state: PyTree):
  """Inside the ``shard_map``: ``(loss, aux, gradients, model_state)`` of one
  device, averaged (or reduce-scattered) over ``data``; ``model_state`` a
  ``PipelineParams`` (or ``None``), each part passed to its function. The
  head runs on ``with_tied(head, embed, tied)``: a tied param's gradient is
  the sum of its two uses (both replicated over ``stage``, summed after the
  executor's ``psum``)."""
  embed, stage, head_loss = _functions(config, specs.zero, tied)
  params = dp_internal.vary_unsplit(params, stored_specs(config, specs),
                                    data_axis=config.axes.data)
  embed_key = None
  if key is not None:
    embed_key, key = jax.random.split(key)
  one_rank = jax.tree.map(lambda a: a[0], params.stages)
  # The embedding runs per microbatch inside stage 0 (with one stage
  # rank, the microbatches run in turn): nothing batch-sized is held.
  result = executor.pipeline_value_and_grad_local(
      stage, head_loss, one_rank,
      with_tied(params.head, params.embed, tied), inputs, targets,
      table=config.table, stage_axis=config.axes.stage, key=key,
      # the global index of this data shard's first microbatch
      microbatch_offset=(jax.lax.axis_index(config.axes.data)
                         * config.schedule.num_microbatches),
      has_aux=config.has_aux, compute_dtype=config.compute_dtype,
      embed_fn=embed, embed_params=params.embed, embed_key=embed_key,
      remat_policy=config.remat_policy, w_recompute=config.w_recompute,
      stage_state=_rank_state(config, model_state), input_grads=False,
      embed_state=None if model_state is None else model_state.embed,
      head_state=None if model_state is None else model_state.head)
  grads = untied(PipelineParams(
      result.grads.embed,
      jax.tree.map(lambda g: g[None], _masked(config, result.grads.stages)),
      result.grads.head), tied)
  loss, aux = jax.lax.pmean((result.loss, result.aux), config.axes.data)
  grads = data_parallel.reduce_gradients(
      grads, gradient_specs(config, specs), data_axis=config.axes.data,
      summed=config.zero_stage == 3)
  return loss, aux, grads, _model_order_state(config, result)


def _rank_state(config: TrainerConfig, model_state: PyTree) -> PyTree:
  """This rank's ``[v, ...]`` rows of the replicated model-order stages'
  state."""
  if model_state is None or model_state.stages is None:
    return None
  rank = jax.lax.axis_index(config.axes.stage)
  return jax.tree.map(
      lambda a: executor.stages_to_ranks(a, config.schedule)[rank],
      model_state.stages)


def _model_order_state(config: TrainerConfig,
                       result: executor.PipelineResult) -> PyTree:
  """The new model state as ``PipelineParams``: every rank's stages in
  model order ``[num_stages, ...]`` (each stage from the rank that holds
  it: a ``psum`` of disjoint rows) and the embedding's and the head's (the
  same on every rank), averaged over ``data``: each data shard updates the
  statistics on its own microbatches."""
  if result.state is None:
    return None
  embed, stages, head = (result.state.embed, result.state.stages,
                         result.state.head)
  rows = jnp.asarray(local_stages(config.schedule))[
      jax.lax.axis_index(config.axes.stage)]
  full = jax.tree.map(lambda a: jnp.zeros(
      (config.schedule.num_stages,) + a.shape[1:], a.dtype).at[rows].set(a),
                      stages)
  return jax.lax.pmean(PipelineParams(
      embed, jax.lax.psum(full, config.axes.stage), head), config.axes.data)


def gradient_program(config: TrainerConfig, specs: Specs,
                     state_specs: TrainState, tied: tuple):
  """``_local_grads`` in its ``shard_map``: ``(params, inputs, targets,
  key, model_state) -> (loss, aux, gradients, model_state)`` of global
  arrays."""
  manual, axes = config.manual, config.axes
  grad_specs = gradient_specs(config, specs)
  gradients = jax.shard_map(
      functools.partial(_local_grads, config, specs, tied),
      mesh=None if manual else config.mesh,   # None: auto_axes' mesh, below
      in_specs=(manual_specs(state_specs.params, manual), P(axes.data),
                P(axes.data), P(), P()),
      out_specs=(P(), P(), manual_specs(grad_specs, manual), P()),
      axis_names=manual)
  if manual:   # 'tensor' Auto inside: XLA partitions the model as written
    gradients = jax.sharding.auto_axes(
        gradients, axes=axes.tensor,
        out_sharding=(P(), P(), grad_specs, P()))
  return gradients
