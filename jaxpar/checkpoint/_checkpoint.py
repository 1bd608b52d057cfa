"""Checkpoints of sharded pytrees (a ``TrainState``) with orbax.

One checkpoint directory holds numbered steps, as orbax's
``CheckpointManager`` writes them::

  directory/
    100/default/...     # step 100: one tensorstore file set per leaf,
    200/default/...     # each device writes its own shards

``save`` writes every shard of every leaf from the device that holds it (no
gather on one host), and returns only when the step is complete on disk, so a
process may exit right after it. ``restore`` reads each shard straight onto
the devices of a *target* sharding, given by ``like``: a state with the target
shardings (e.g. a fresh ``Trainer.init(...)``) or a pytree of
``jax.ShapeDtypeStruct`` with shardings. The target mesh may differ from the
one that saved -- other data / tensor sizes, other devices -- as long as
every leaf has the saved shape and dtype.

**Pipeline stages.** A ``jaxpar.parallel.Trainer`` state keeps stage leaves
in the executor's rank order ``[p, v, ...]``, which depends on the schedule
(``p`` ranks, ``v`` stages each, placement of the schedule). With
``schedule=`` the stages of every ``PipelineParams`` in the state (the
params) are saved in model order ``[num_stages, ...]``, and restored into
the rank order of the schedule passed to ``restore``. The optimizer state
is per layer (``LayerParams``, what the optimizer sees), the same for every
schedule: it is saved as it is. Such a checkpoint restores
onto any schedule with the same ``num_stages`` (1F1B on 4 ranks and
interleaved 1F1B with 2 ranks x 2 stages alike) and any mesh. Without
``schedule=`` leaves are saved as they are: restore onto the same schedule
(same ``p``, ``v`` and placement). A different ``num_stages`` is a different
model split and needs the model's own re-split (e.g.
``gpt.merge_from_pipeline`` / ``split_for_pipeline`` on the params).

**ZeRO.** A ``jaxpar.data_parallel`` ZeRO state is saved at its logical
shapes: the leaves ZeRO stores padded (``jaxpar.data_parallel.Padded``, leaves
that no dim of the data size divides) are saved cut to their shapes (each one
whole along its padded dim while it is written) and padded again by ``restore``
as ``like`` stores them. So it restores onto any mesh, any data size and any
``zero_stage``.

Example:
  >>> import tempfile
  >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxpar
  >>> ckpt = tempfile.mkdtemp()
  >>> loss_fn = lambda p, b: jnp.mean((b['x'] @ p['w'] - b['y']) ** 2)
  >>> trainer = jaxpar.data_parallel.trainer(
  ...     loss_fn, optax.adam(1e-2), mesh=jaxpar.make_mesh(data=8))
  >>> state = trainer.init({'w': jnp.zeros((4, 1))})
  >>> batch = {'x': np.ones((8, 4), np.float32),
  ...          'y': np.ones((8, 1), np.float32)}
  >>> state, stats = trainer.step(state, batch)
  >>> jaxpar.checkpoint.save(ckpt, state)          # at state.step
  1
  >>> other = jaxpar.data_parallel.trainer(     # another mesh
  ...     loss_fn, optax.adam(1e-2),
  ...     mesh=jaxpar.make_mesh(data=4, devices=jax.devices()[:4]))
  >>> like = other.init({'w': jnp.zeros((4, 1))})
  >>> restored = jaxpar.checkpoint.restore(ckpt, like)
  >>> restored.params['w'].sharding.mesh.shape['data']
  4
  >>> int(restored.step), bool(np.array_equal(restored.params['w'],
  ...                                         state.params['w']))
  (1, True)

  For a ``jaxpar.parallel`` trainer pass ``schedule=`` to both calls.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.checkpoint import _integrity as integrity

from jaxpar._validate import check_int
from jaxpar.checkpoint._integrity import CheckpointError, leaf_name
from jaxpar.data_parallel import internal as dp_internal
from jaxpar.parallel import (PipelineParams, stages_in_model_order,
                             stages_like)
from jaxpar.parallel.internal import model_sharding
from jaxpar.pipeline.schedules import Schedule, local_stages
from jaxpar.train_state import TrainState
from jaxpar.train_state.internal import PyTree

_SHOWN = 8  # leaf paths listed in one error message


def _path(directory: Any) -> str:
  if not isinstance(directory, (str, os.PathLike)):
    raise TypeError(f'directory must be a str or os.PathLike, got '
                    f'{type(directory).__name__}: {directory!r}.')
  return os.path.abspath(os.fspath(directory))


def _manager(path: str, *, keep: int | None = None, create: bool = False,
             handler: Any = None) -> ocp.CheckpointManager:
  # Synchronous: save returns once the step is on disk (and renamed from its
  # temporary name), so an exit right after it cannot leave it half written.
  return ocp.CheckpointManager(
      path, item_handlers=handler or ocp.StandardCheckpointHandler(),
      options=ocp.CheckpointManagerOptions(
          max_to_keep=keep, create=create, enable_async_checkpointing=False))


def _writer() -> ocp.PyTreeCheckpointHandler:
  """orbax's standard handler, but each replicated array written whole by
  its first replica.

  orbax's default on CPU (replica-parallel writing) first slices every
  replica's shard on its device, an eager op compiled per shape and device
  (most of a small state's save time: 120 compiles for a 3D GPT on 8
  devices); on GPU orbax writes whole replicas already. Same files, read
  back with ``StandardRestore``.
  """
  handlers = [(t, ocp.type_handlers.get_type_handler(t))
              for t in (int, float, bytes, np.number, np.ndarray, str)]
  registry = ocp.type_handlers.create_type_handler_registry(
      *handlers,
      (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)))
  return ocp.PyTreeCheckpointHandler(
      save_concurrent_gb=96, restore_concurrent_gb=96,
      type_handler_registry=registry)


def _check_step(step: Any) -> int:
  if isinstance(step, (bool, np.bool_)) or not isinstance(
      step, (int, np.integer)) or step < 0:
    raise ValueError(f'step={step!r} must be an int >= 0.')
  return int(step)


def _check_schedule(schedule: Any) -> None:
  if schedule is not None and not isinstance(schedule, Schedule):
    raise TypeError(f'schedule must be a jaxpar.pipeline.Schedule or None, got '
                    f'{type(schedule).__name__}.')


def _is_pipeline(node: Any) -> bool:
  return isinstance(node, PipelineParams)


def _map_stages(fn, tree: PyTree, *rest: PyTree) -> PyTree:
  """``fn(stages, *rest_stages)`` on every ``PipelineParams`` node of ``tree``.

  ``rest`` are trees with ``PipelineParams`` nodes at the same places.
  """
  return jax.tree.map(
      lambda n, *r: n._replace(stages=fn(n.stages, *(x.stages for x in r)))
      if _is_pipeline(n) else n, tree, *rest, is_leaf=_is_pipeline)


def _check_rank_order(tree: PyTree, schedule: Schedule, name: str) -> None:
  """``ValueError`` unless ``tree``'s stages are in ``schedule``'s rank
  placement."""
  nodes = [n for n in jax.tree.leaves(tree, is_leaf=_is_pipeline)
           if _is_pipeline(n)]
  if not nodes:
    raise ValueError(
        f'schedule= applies to jaxpar.parallel.Trainer states (with '
        f'PipelineParams), but {name} has no PipelineParams; drop schedule=.')
  p = schedule.num_ranks
  lead = (p, schedule.num_stages // p)
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      [n.stages for n in nodes]):
    if tuple(np.shape(leaf)[:2]) != lead:
      stage_leaf = 'stages/' + leaf_name(path[1:])
      raise ValueError(
          f'{name} stage leaf {stage_leaf!r} has shape '
          f'{tuple(np.shape(leaf))}, but the rank order of schedule '
          f'{schedule.name!r} ({p} ranks, {schedule.num_stages} stages) '
          f'starts with {lead}; pass the schedule of the Trainer that made '
          f'{name}.')
  for n in nodes:   # a trainer's state says its placement (parallel.placed)
    placement = getattr(n, 'placement', local_stages(schedule))
    if placement != local_stages(schedule):
      raise ValueError(
          f'{name} holds its stages in the rank order {placement} of '
          f'schedule {type(n).schedule.name!r}, not in that of schedule='
          f'{schedule.name!r} ({local_stages(schedule)}); pass the schedule '
          f'of the Trainer that made {name}.')


def _to_model_order(state: PyTree, schedule: Schedule) -> PyTree:
  return _map_stages(lambda st: stages_in_model_order(st, schedule), state)


def _check_leaves(tree: PyTree, name: str, kinds: tuple[type, ...],
                  rule: str) -> list:
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  if not leaves:
    raise ValueError(f'{name} has no array leaves: nothing to checkpoint.')
  for path, leaf in leaves:
    if not isinstance(leaf, kinds):
      raise TypeError(f'{name} leaf {leaf_name(path)!r} is a '
                      f'{type(leaf).__name__}; {rule}')
  return leaves


def save(directory: str | os.PathLike, state: PyTree, *,
         step: int | None = None, schedule: Schedule | None = None,
         keep: int | None = None) -> int:
  """Saves ``state`` (sharded or not) as step ``step`` of ``directory``.

  Every process of a multi-process run must call it with its part of the
  same global ``state``; each device writes its own shards. The call returns
  when the step is completely written: orbax writes it under a temporary
  name and renames it at the end, then jaxpar adds the integrity records
  (crc32 of every file each process wrote, a checksum per array, the jaxpar,
  jax and orbax versions; see ``jaxpar.integrity``) and last the commit mark.
  A process killed at any point leaves the earlier steps restorable and this
  one either absent or incomplete (skipped by ``latest_step``).

  A state whose params (for a ``TrainState``; every float leaf otherwise)
  hold NaN or inf is refused: it is never written.

  Args:
    directory: the checkpoint directory (created if missing; relative paths
      are made absolute against the current directory).
    state: a pytree of ``jax.Array`` / numpy arrays / scalars, e.g. a
      ``TrainState`` from any jaxpar train step (ZeRO and 3D included).
    step: the step number; default ``int(state.step)`` for a ``TrainState``.
      Saving a step that already exists replaces it.
    schedule: for a ``jaxpar.parallel.Trainer`` state, the trainer's
      schedule: pipeline stages are saved in model order, restorable onto any
      schedule with the same ``num_stages`` (see the module docstring).
    keep: after saving, keep only the ``keep`` most recently saved steps;
      ``None`` keeps all.

  Returns:
    The step number saved.

  Raises:
    ValueError: bad ``step``/``keep``, or ``state`` without leaves.
    CheckpointError: (a ``ValueError``) params that are not finite.
    TypeError: a leaf that is not an array or scalar, or a bad ``schedule``.

  Example:
    >>> import tempfile
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> ckpt = tempfile.mkdtemp()
    >>> state = jaxpar.TrainState.create({'w': jnp.ones(3)}, optax.sgd(0.1))
    >>> jaxpar.checkpoint.save(ckpt, state, keep=3)   # ckpt/<state.step>/
    0
  """
  path = _path(directory)
  _check_schedule(schedule)
  if keep is not None:
    check_int('keep', keep, fix='Or None to keep all steps.')
  if step is None:
    if not isinstance(state, TrainState):
      raise ValueError(
          f'step=None takes the step from a TrainState, but state is a '
          f'{type(state).__name__}; pass step=<int>.')
    step = int(state.step)
  step = _check_step(step)
  _check_leaves(state, 'state', (jax.Array, np.ndarray, np.generic, int, float),
                'checkpoints hold arrays and numbers only.')
  state = dp_internal.unpadded(state)
  if schedule is not None:
    _check_rank_order(state, schedule, 'state')
    state = _to_model_order(state, schedule)
  checksums, finite = integrity.array_checksums(state)
  _check_finite(finite, params_only=isinstance(state, TrainState), step=step)
  manager = _manager(path, keep=keep, create=True, handler=_writer())
  try:
    if step in manager.all_steps():
      manager.delete(step)
    manager.save(step, args=ocp.args.PyTreeSave(state), force=True)
    manager.wait_until_finished()
  finally:
    manager.close()
  integrity.write_records(os.path.join(path, str(step)), step, checksums)
  return step


def _check_finite(finite: dict[str, bool], *, params_only: bool,
                  step: int) -> None:
  bad = [name for name, ok in finite.items() if not ok and (
      not params_only or name == 'params' or name.startswith('params/'))]
  if bad:
    raise CheckpointError(
        f'refusing to save step {step}: leaves {_listing(bad, ", ")} hold '
        'NaN or inf (a checkpoint is never written from non-finite params); '
        'the earlier steps are untouched: restore the last good one and lower '
        'the learning rate or check the data.')


def _steps(path: str) -> list[int]:
  """The steps orbax lists in ``path`` (complete renames), ascending."""
  if not os.path.isdir(path):
    return []
  manager = _manager(path)
  try:
    return sorted(manager.all_steps())
  finally:
    manager.close()


def latest_step(directory: str | os.PathLike, *,
                verify: bool = True) -> int | None:
  """The highest good step saved in ``directory``; ``None`` if there is none.

  A missing directory also gives ``None``, so ``latest_step(d) is None``
  tells a fresh run from one to resume.

  Args:
    directory: a directory written by ``save``.
    verify: re-read the files of each step, newest first, and skip (with a
      ``UserWarning`` naming the step and the reason) those that are
      incomplete or fail their crc32 check (``jaxpar.integrity``).
      ``False``: the highest step on disk, unchecked.

  Example:
    >>> import tempfile
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> ckpt = tempfile.mkdtemp()
    >>> jaxpar.checkpoint.latest_step(ckpt) is None      # a fresh run
    True
    >>> state = jaxpar.TrainState.create({'w': jnp.ones(3)}, optax.sgd(0.1))
    >>> jaxpar.checkpoint.save(ckpt, state, step=5)
    5
    >>> jaxpar.checkpoint.latest_step(ckpt)              # resume from here
    5
  """
  path = _path(directory)
  for step in reversed(_steps(path)):
    if not verify:
      return step
    try:
      integrity.verify_files(os.path.join(path, str(step)), step)
    except CheckpointError as e:
      warnings.warn(f'jaxpar.checkpoint.latest_step skips step {step}: {e}',
                    stacklevel=2)
      continue
    return step
  return None


def _pick_step(path: str, step: int | None,
               verify: bool) -> tuple[int, dict | None]:
  """``(step, commit record)``: the asked step, or the latest good one."""
  steps = _steps(path)
  if not steps:
    raise FileNotFoundError(f'no checkpoint in {path} (it has no saved steps).')
  if step is not None and step not in steps:
    raise FileNotFoundError(f'no step {step} in {path}; saved steps: {steps}.')
  if not verify:
    return (steps[-1] if step is None else step), None
  if step is not None:
    return step, integrity.verify_files(os.path.join(path, str(step)), step)
  good = latest_step(path)   # warns about each step it skips
  if good is None:
    raise CheckpointError(
        f'no step of {path} passes verification (steps {steps}: see the '
        'warnings); the checkpoint cannot be used, start without it.')
  return good, integrity.verify_files(os.path.join(path, str(good)), good)


def _target(leaf: Any) -> Any:
  """What orbax restores ``leaf`` as: sharded ``ShapeDtypeStruct`` or numpy
  (a ``Padded`` one at its logical shape)."""
  if dp_internal.is_padded(leaf):
    if dp_internal.logical_sharding(leaf) is None:
      return np.zeros(leaf.shape, leaf.dtype)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                sharding=dp_internal.logical_sharding(leaf))
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  return leaf


def _model_target(leaf: Any, schedule: Schedule) -> Any:
  """Target of a rank-order ``[p, v, ...]`` stage leaf, in model order."""
  shape = (schedule.num_stages,) + tuple(leaf.shape[2:])
  if isinstance(leaf, np.ndarray):
    return np.zeros(shape, leaf.dtype)
  return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=model_sharding(leaf))


def _listing(items: list[str], sep: str) -> str:
  """The first ``_SHOWN`` items joined by ``sep``, and how many are left."""
  more = f'{sep}(+{len(items) - _SHOWN} more)' if len(items) > _SHOWN else ''
  return sep.join(items[:_SHOWN]) + more


def _compare(saved: dict[str, Any], wanted: dict[str, Any], path: str,
             hint: str) -> None:
  """One ``ValueError`` listing every missing, extra or mismatched leaf."""
  def describe(x):
    return f'{tuple(x.shape)} {np.dtype(x.dtype)}'
  problems = []
  missing = [k for k in wanted if k not in saved]
  if missing:
    problems.append('in like but not in the checkpoint: '
                    + _listing(missing, ', '))
  extra = [k for k in saved if k not in wanted]
  if extra:
    problems.append('in the checkpoint but not in like: '
                    + _listing(extra, ', '))
  shapes = [f'{k}: checkpoint {describe(saved[k])} vs like '
            f'{describe(wanted[k])}' for k in wanted
            if k in saved and describe(saved[k]) != describe(wanted[k])]
  if shapes:
    problems.append('shape/dtype mismatch:\n    '
                    + _listing(shapes, '\n    '))
  if problems:
    raise ValueError(f'checkpoint {path} does not match like:\n  '
                     + '\n  '.join(problems) + f'\n{hint}')


def restore(directory: str | os.PathLike, like: PyTree, *,
            step: int | None = None, schedule: Schedule | None = None,
            verify: bool = True) -> PyTree:
  """Restores step ``step`` of ``directory`` onto the shardings of ``like``.

  Args:
    directory: a directory written by ``save``.
    like: the target: a pytree with the saved structure whose leaves are
      ``jax.Array`` (restored with the same sharding, e.g. a fresh
      ``Trainer.init(...)`` on any mesh), ``jax.ShapeDtypeStruct`` with a
      ``sharding``, or numpy arrays (restored as numpy). Shapes and dtypes
      must be the saved ones; values of ``like`` are not used.
    step: the step to restore; default the latest good one
      (``latest_step``, which warns about each newer step it skips).
    schedule: the schedule of the trainer that ``like`` comes from, when the
      checkpoint was saved with ``schedule=`` (model-order stages): they are
      put into this schedule's rank order.
    verify: check the step before reading it (the crc32 of every file) and
      the values after (one checksum per array). ``False`` reads an
      unverified step (e.g. one written without the integrity records).

  Returns:
    ``like``'s pytree (same node types) holding the saved values, bit for
    bit, with ``like``'s shardings.

  Raises:
    FileNotFoundError: no such directory, no checkpoint in it, or no step
      ``step`` (the message lists the saved steps).
    CheckpointError: (a ``ValueError``, one line) the step is incomplete,
      damaged or unreadable; it names the step, the file or array, and what
      to do.
    ValueError: leaves missing on either side, or with another shape or
      dtype (the message names each leaf and both shapes).
    TypeError: a ``like`` leaf that is not an array or a sharded
      ``ShapeDtypeStruct``.

  Example:
    >>> import tempfile
    >>> import jax, jax.numpy as jnp, optax, jaxpar
    >>> ckpt = tempfile.mkdtemp()
    >>> state = jaxpar.TrainState.create({'w': jnp.arange(3.0)},
    ...                                  optax.sgd(0.1))
    >>> jaxpar.checkpoint.save(ckpt, state)
    0
    >>> like = jax.tree.map(jnp.zeros_like, state)   # the target shardings
    >>> jaxpar.checkpoint.restore(ckpt, like).params['w']
    Array([0., 1., 2.], dtype=float32)
  """
  path = _path(directory)
  _check_schedule(schedule)
  if step is not None:
    step = _check_step(step)
  for _, leaf in _check_leaves(
      like, 'like', (jax.Array, jax.ShapeDtypeStruct, np.ndarray),
      'use jax.Array, numpy arrays or jax.ShapeDtypeStruct(shape, dtype, '
      'sharding=...).'):
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
      raise TypeError(
          f'like has a jax.ShapeDtypeStruct {leaf} without sharding; give it '
          'sharding=NamedSharding(mesh, spec) (where to put the restored '
          'array).')
  if schedule is not None:
    _check_rank_order(like, schedule, 'like')
  if not os.path.isdir(path):
    raise FileNotFoundError(f'no checkpoint directory {path}.')
  step, record = _pick_step(path, step, verify)
  step_dir = os.path.join(path, str(step))
  refs = jax.tree.map(_target, like, is_leaf=dp_internal.is_padded)
  target = refs
  if schedule is not None:
    target = _map_stages(lambda st: jax.tree.map(
        lambda a: _model_target(a, schedule), st), refs)
  manager = _manager(path)
  try:
    try:
      metadata = manager.item_metadata(step).tree
    except Exception as e:  # pylint: disable=broad-except
      raise integrity.unreadable(step_dir, step, e) from e
    saved = {leaf_name(p): m for p, m in jax.tree_util.tree_leaves_with_path(
        metadata)}
    wanted = {leaf_name(p): t for p, t in jax.tree_util.tree_leaves_with_path(
        target)}
    _compare(saved, wanted, step_dir, hint=(
        'Restore onto a state of the same model and optimizer. Pipeline '
        'stages: a checkpoint saved with schedule= holds them in model order '
        '[num_stages, ...] (restore with schedule=, same num_stages); without '
        'it, in the rank order [p, v, ...] of the schedule used (restore '
        'without schedule= onto the same schedule).'))
    try:
      restored = manager.restore(step, args=ocp.args.StandardRestore(target))
    except Exception as e:  # pylint: disable=broad-except
      raise integrity.unreadable(step_dir, step, e) from e
  finally:
    manager.close()
  if record is not None:
    integrity.verify_arrays(record, restored, step_dir, step)
  if schedule is not None:
    restored = _map_stages(lambda st, ref: stages_like(st, ref, schedule),
                           restored, refs)
  return dp_internal.place_like(restored, like)
