"""Checks of user input shared by the pipeline steps (``ValueError``/``TypeError``).

Public to the package: ``jaxpar.parallel`` and the executor both use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpar.mesh import axis_size
from jaxpar.pipeline.lower import LoweredSchedule, lower
from jaxpar.pipeline.schedule import Schedule

PyTree = Any
StageFn = Callable[[PyTree, jax.Array], jax.Array]


def check_fn(fn: Any, name: str) -> None:
  if not callable(fn):
    raise TypeError(f'{name} must be callable, got {type(fn).__name__}: '
                    f'{fn!r}.')


def check_float(tree: PyTree, name: str) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      raise TypeError(
          f'{name}{jax.tree_util.keystr(path)} has dtype '
          f'{jnp.result_type(leaf)}; the pipeline differentiates it, so it '
          'must be floating point (cast it, or close over integer data in '
          'stage_fn/loss_fn instead).')


def check_leading(tree: PyTree, size: int, name: str, rule: str) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    shape = np.shape(leaf)
    if not shape or shape[0] != size:
      raise ValueError(
          f'{name}{jax.tree_util.keystr(path)} has shape {shape} but its '
          f'leading axis must be {rule}={size}: stack one slice per stage '
          '(e.g. jax.tree.map(lambda *a: jnp.stack(a), *per_stage)).')


def microbatched(inputs: jax.Array, targets: PyTree, m: int):
  """``inputs`` and every ``targets`` leaf reshaped to ``[m, batch/m, ...]``."""
  if np.ndim(inputs) == 0:
    raise ValueError(f'inputs must have a leading batch axis, got shape '
                     f'{np.shape(inputs)}.')
  batch = np.shape(inputs)[0]
  if batch % m:
    raise ValueError(
        f'inputs batch size {batch} is not divisible by the schedule\'s '
        f'num_microbatches={m}: use a batch that is a multiple of {m} or a '
        f'schedule whose microbatch count divides {batch}.')
  for path, leaf in jax.tree_util.tree_leaves_with_path(targets):
    if not np.shape(leaf) or np.shape(leaf)[0] != batch:
      raise ValueError(
          f'targets{jax.tree_util.keystr(path)} has shape {np.shape(leaf)} but '
          f'inputs has batch size {batch}: inputs and targets must share the '
          'leading batch axis.')
  split = lambda a: jnp.reshape(a, (m, batch // m) + np.shape(a)[1:])
  return split(inputs), jax.tree.map(split, targets)


def check_stage_fn(stage_fn: StageFn, params: PyTree, x: jax.Array) -> None:
  """``ValueError`` unless ``stage_fn`` keeps the activation shape and dtype."""
  out = jax.eval_shape(stage_fn, jax.tree.map(lambda a: a[0], params), x[0])
  if (not isinstance(out, jax.ShapeDtypeStruct) or out.shape != x.shape[1:]
      or out.dtype != x.dtype):
    got = (f'{out.dtype}{list(out.shape)}' if isinstance(
        out, jax.ShapeDtypeStruct) else f'a {type(out).__name__}')
    raise ValueError(
        f'stage_fn maps a microbatch {x.dtype}{list(x.shape[1:])} to {got}; '
        'a pipeline stage must return an array of the same shape and dtype '
        'as its input. Move shape-changing layers (embedding, head) out of '
        'the stages: in front of the pipeline (PipelineGrads.inputs gives '
        'their cotangent) or into loss_fn.')


def check_axis(axis: str, schedule: Schedule) -> None:
  """Inside ``shard_map``: ``axis`` must have ``schedule.num_ranks`` ranks."""
  size = jax.lax.axis_size(axis)
  if size != schedule.num_ranks:
    raise ValueError(
        f'axis {axis!r} has size {size} but schedule {schedule.name!r} has '
        f'num_ranks={schedule.num_ranks}: lower a schedule for {size} ranks.')


def check_lowered(lowered: Any) -> LoweredSchedule:
  if not isinstance(lowered, LoweredSchedule):
    raise TypeError(f'lowered must be a LoweredSchedule from '
                    f'jaxpar.pipeline.lower(schedule), got '
                    f'{type(lowered).__name__}.')
  return lowered


def check_fill(bubble_fill: Any) -> float:
  if isinstance(bubble_fill, bool) or not isinstance(
      bubble_fill, (int, float, np.floating)):
    raise TypeError(f'bubble_fill={bubble_fill!r} must be a float (e.g. 0.0, '
                    "or float('nan') to check that bubbles are inert).")
  return float(bubble_fill)


def lowered_for(schedule: Any, mesh: Mesh, axis: str,
                training: bool) -> LoweredSchedule:
  """Lowers ``schedule`` after checking it against ``mesh`` and the mode."""
  if not isinstance(schedule, Schedule):
    raise TypeError(f'schedule must be a jaxpar.pipeline.Schedule (e.g. '
                    f'jaxpar.pipeline.one_f_one_b(p, m)), got '
                    f'{type(schedule).__name__}.')
  size = axis_size(mesh, axis)
  if size != schedule.num_ranks:
    raise ValueError(
        f'mesh axis {axis!r} has size {size} but schedule {schedule.name!r} '
        f'has num_ranks={schedule.num_ranks}: build the schedule for {size} '
        f'ranks or a mesh with {axis}={schedule.num_ranks}.')
  return lower(schedule, forward_only=not training)
