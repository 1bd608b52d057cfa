"""Checks of user input shared by the pipeline steps (``ValueError``/``TypeError``).

jaxpar-internal: the executor uses them, and ``jaxpar.parallel`` some of them
(through ``jaxpar.pipeline.executor.internal``). They run before the user's
functions are traced, except those that trace a function on one
microbatch's shapes (``check_stage_fn``, ``check_loss_fn``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpar._validate import check_keywords  # re-exported
from jaxpar.mesh import axis_size
from jaxpar.pipeline.executor._microbatches import extras
from jaxpar.pipeline.schedules import KIND_CODES, Schedule, TickTable

PyTree = Any
F = KIND_CODES['F']


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
  """``ValueError`` listing every leaf whose leading axis is not ``size``."""
  wrong = [f'{name}{jax.tree_util.keystr(path)} has shape {np.shape(leaf)}'
           for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
           if not np.shape(leaf) or np.shape(leaf)[0] != size]
  if wrong:
    raise ValueError(
        f'{"; ".join(wrong)} but the leading axis must be {rule}={size}: '
        'stack one slice per stage (e.g. jax.tree.map(lambda *a: '
        'jnp.stack(a), *per_stage)).')


def check_stage_fn(stage_fn: Callable[..., Any], params: PyTree, x: Any,
                   key: Any = None, state: PyTree = None) -> None:
  """``ValueError`` unless ``stage_fn`` maps ``x`` (one microbatch's
  activation: an array or any pytree of arrays, or their avals) to the same
  structure, shapes and dtypes and, given a ``state`` (``[v, ...]``),
  returns ``(y, new_state)`` with ``new_state`` shaped like one stage's
  state."""
  first = lambda tree: jax.tree.map(lambda a: a[0], tree)
  out = jax.eval_shape(
      lambda p, x, k, s: stage_fn(p, x, **extras(k, s)), first(params), x,
      key, None if state is None else first(state))
  if state is not None:
    out = check_new_state(out, first(state))
  if _types(out) != _types(x):
    raise ValueError(
        f'stage_fn maps a microbatch {_show(x)} to {_show(out)}; a pipeline '
        'stage must return what it takes: the same structure, shapes and '
        'dtypes (values it only passes on, e.g. an encoder output or a '
        'mask, returned unchanged). Move shape-changing layers (embedding, '
        'head) out of the stages: in front of the pipeline (embed_fn of '
        'pipeline_value_and_grad_local, or chain PipelineGrads.inputs, their '
        'cotangent) or into loss_fn.')


def _types(tree: PyTree) -> tuple:
  """``tree``'s structure and its leaves' shapes and dtypes."""
  return jax.tree.structure(tree), [
      (tuple(np.shape(a)), jnp.result_type(a)) for a in jax.tree.leaves(tree)]


def _show(tree: PyTree) -> str:
  """``float32[2, 8]`` for an array; its key paths too for a pytree."""
  one = lambda a: f'{jnp.result_type(a)}{list(np.shape(a))}'
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  if len(leaves) == 1 and not leaves[0][0]:
    return one(leaves[0][1])
  return '{' + ', '.join(f'{jax.tree_util.keystr(path) or "()"}: {one(a)}'
                         for path, a in leaves) + f'}} ({type(tree).__name__})'


def check_new_state(out: Any, state: PyTree,
                    call: str = 'stage_fn(params, x, state=s)',
                    given: str = 'stage_state') -> Any:
  """``y`` of a stateful function's ``(y, new_state)`` (``stage_fn``'s by
  default; ``call`` and ``given`` name another's); ``ValueError`` unless
  ``new_state`` has the structure, shapes and dtypes of ``state``."""
  types = lambda tree: jax.tree.map(
      lambda a: (np.shape(a), jnp.result_type(a)), tree)
  if not (isinstance(out, tuple) and len(out) == 2) or (
      jax.tree.structure(out[1]) != jax.tree.structure(state)
      or types(out[1]) != types(state)):
    raise ValueError(
        f'with {given}, {call} must return '
        '(y, new_state), new_state of the structure, shapes and dtypes of '
        f'the state s {jax.tree.map(jax.typeof, state)}; got '
        f'{jax.tree.map(jax.typeof, out)}. Return the updated state (e.g. '
        'BatchNorm running statistics, cast back to its dtype) with y.')
  return out[0]


def check_state_order(table: TickTable) -> None:
  """``ValueError`` unless every stage runs its ``F`` actions in increasing
  microbatch order: a stage's state then passes from each microbatch to
  the next, as on one device."""
  for stage in range(table.schedule.num_stages):
    at = (table.kind == F) & (table.stage == stage)
    ticks, ranks = np.nonzero(at)
    order = table.microbatch[ticks, ranks][np.argsort(ticks, kind='stable')]
    if np.any(np.diff(order) <= 0):
      raise ValueError(
          f'schedule {table.schedule.name!r} runs stage {stage}\'s forwards '
          f'in microbatch order {order.tolist()}; with model state '
          '(stage_state, embed_state, head_state) each stage must run its '
          'microbatches in increasing order (the state after microbatch i '
          'is the input of microbatch i + 1). Use a schedule that does '
          '(every built-in one), or pass no state.')


def check_loss_fn(loss_fn: Callable[..., Any], loss_params: PyTree,
                  y: jax.Array, target: PyTree, key: Any,
                  has_aux: bool, state: PyTree = None) -> None:
  """``TypeError`` unless ``loss_fn`` gives a float scalar (and float aux);
  with a ``state`` (``head_state``), ``ValueError`` unless it returns
  ``(that, new_state)`` (``check_new_state``)."""
  out = jax.eval_shape(
      lambda lp, y, t, k, s: loss_fn(lp, y, t, **extras(k, s)),
      loss_params, y, target, key, state)
  if state is not None:
    out = check_new_state(out, state,
                          'loss_fn(loss_params, y, target, state=s)',
                          'head_state')
  if has_aux:
    if not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError('has_aux=True needs loss_fn to return a pair (loss, '
                      f'aux), got {out}.')
    out, aux = out
    for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
      if not jnp.issubdtype(leaf.dtype, jnp.inexact):
        raise TypeError(
            f'loss_fn aux{jax.tree_util.keystr(path)} has dtype {leaf.dtype}; '
            'aux is averaged over microbatches like the loss, so return '
            'float metrics (e.g. accuracy as float32).')
  if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()
          and jnp.issubdtype(out.dtype, jnp.floating)):
    hint = ('' if has_aux else
            '; if it returns (loss, aux), pass has_aux=True')
    raise TypeError(f'loss_fn must return a float scalar, the mean loss of '
                    f'one microbatch, got {out}{hint}.')


def check_microbatch_offset(microbatch_offset: Any) -> None:
  """``TypeError`` unless ``microbatch_offset`` is one integer (NumPy and JAX
  integers too)."""
  value = microbatch_offset
  if (isinstance(value, bool) or np.ndim(value)
      or not jnp.issubdtype(jnp.result_type(value), jnp.integer)):
    raise TypeError(f'microbatch_offset={value!r} must be one integer, the '
                    "global index of this shard's first microbatch (e.g. "
                    "jax.lax.axis_index('data') * num_microbatches).")


def check_stage_axis(stage_axis: str, schedule: Schedule) -> None:
  """Inside ``shard_map``: ``stage_axis`` must have ``schedule.num_ranks``
  ranks."""
  size = jax.lax.axis_size(stage_axis)
  if size != schedule.num_ranks:
    raise ValueError(
        f'stage_axis {stage_axis!r} has size {size} but schedule '
        f'{schedule.name!r} has num_ranks={schedule.num_ranks}: build the '
        f'schedule for {size} ranks.')


def check_table(table: Any) -> TickTable:
  """``TypeError`` unless ``table`` is a ``TickTable``; ``ValueError`` if it
  holds a block kind the executor does not run (``KIND_CODES``)."""
  if not isinstance(table, TickTable):
    raise TypeError(f'table must be a TickTable from '
                    f'jaxpar.pipeline.tick_table(schedule), got '
                    f'{type(table).__name__}.')
  unknown = sorted(set(np.unique(table.kind).tolist())
                   - {0, *KIND_CODES.values()})
  if unknown:
    raise ValueError(
        f'table (schedule {table.schedule.name!r}) holds block kind codes '
        f'{unknown}; the executor runs 0 (idle) and {KIND_CODES}. Build it '
        'with jaxpar.pipeline.tick_table(schedule).')
  return table


def check_bool(value: Any, name: str) -> None:
  """``TypeError`` unless ``value`` is a bool."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f'{name}={value!r} must be True or False.')


def check_fill(bubble_fill: Any) -> float:
  if isinstance(bubble_fill, bool) or not isinstance(
      bubble_fill, (int, float, np.floating)):
    raise TypeError(f'bubble_fill={bubble_fill!r} must be a float (e.g. 0.0, '
                    "or float('nan') to check that bubbles are inert).")
  return float(bubble_fill)


def check_schedule(schedule: Any, mesh: Mesh, stage_axis: str) -> None:
  """``TypeError`` unless ``schedule`` is a ``Schedule``; ``ValueError``
  unless it has as many ranks as ``mesh``'s ``stage_axis``."""
  if not isinstance(schedule, Schedule):
    raise TypeError(f'schedule must be a jaxpar.pipeline.Schedule (e.g. '
                    f'jaxpar.pipeline.one_f_one_b(p, m)), got '
                    f'{type(schedule).__name__}.')
  size = axis_size(mesh, stage_axis)
  if size != schedule.num_ranks:
    raise ValueError(
        f'mesh axis {stage_axis!r} has size {size} but schedule '
        f'{schedule.name!r} has num_ranks={schedule.num_ranks}: build the '
        f'schedule for {size} ranks or a mesh with '
        f'{stage_axis}={schedule.num_ranks}.')
