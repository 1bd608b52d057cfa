"""Stage leaves in two orders: the schedule's rank order and the model's.

The pipeline keeps stage leaves in the rank order ``[p, v, ...]`` of a
``Schedule`` (``jaxpar.pipeline.stages_to_ranks``: rank ``r`` holds its
``v`` stages); users, ``Trainer.params`` and checkpoints see them in model
order ``[num_stages, ...]``. The two functions here move whole trees of
global arrays between the two in one jitted program per signature, keeping
their shards (``P(a, None, *rest)`` <-> ``P(a, *rest)``), where moving leaf
by leaf eagerly compiled a program per leaf.

A 3D trainer's state says which placement its stages are in: its
``params`` is a ``PipelineParams`` subclass per placement (``placed``; its
``placement`` attribute is ``local_stages(schedule)``), so states of two
schedules differ in their pytree type, and a trainer re-lays a state of
another schedule's placement (``relaid``) instead of reading its stages in
the wrong order.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.parallel._params import PipelineParams
from jaxpar.pipeline import executor
from jaxpar.pipeline.executor.internal import check_leading
from jaxpar.pipeline.schedules import Schedule, local_stages

PyTree = Any


def padded_spec(spec: P, ndim: int) -> tuple:
  """``spec``'s entries, ``None`` for the trailing dims it leaves out."""
  return tuple(spec) + (None,) * (ndim - len(spec))


def model_sharding(leaf: Any) -> NamedSharding | None:
  """Sharding of a ``[p, v, ...]`` leaf's model order ``[p*v, ...]``:
  ``P(a, None, *rest)`` (ranks split over ``a``) -> ``P(a, *rest)``;
  ``None`` for a leaf without a ``NamedSharding``."""
  sharding = getattr(leaf, 'sharding', None)
  if not isinstance(sharding, NamedSharding):
    return None
  spec = padded_spec(sharding.spec, len(leaf.shape))
  return NamedSharding(sharding.mesh, P(spec[0], *spec[2:]))


def stages_in_model_order(stages: PyTree, schedule: Schedule) -> PyTree:
  """Stage leaves in the rank order ``[p, v, ...]`` of ``schedule``
  back in model order ``[num_stages, ...]``, shards kept
  (``P(a, None, *rest)`` -> ``P(a, *rest)``): the order of
  ``Trainer.params`` and of checkpoints.

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> s = jaxpar.pipeline.zero_bubble_v(2, 2)   # placement (0, 1, 1, 0)
    >>> jaxpar.parallel.stages_in_model_order(
    ...     {'w': jnp.array([[0, 3], [1, 2]])}, s)['w'].tolist()
    [0, 1, 2, 3]
  """
  return _relaid(stages, stages, schedule, to_ranks=False)


def stages_like(stages: PyTree, like: PyTree, schedule: Schedule) -> PyTree:
  """Model-order stage leaves ``[num_stages, ...]`` in the rank order
  ``[p, v, ...]`` of ``schedule``, stored as ``like``'s leaves are (their
  shardings; numpy for numpy); inverse of ``stages_in_model_order``.

  Example:
    >>> import numpy as np, jaxpar
    >>> s = jaxpar.pipeline.zero_bubble_v(2, 2)
    >>> jaxpar.parallel.stages_like({'w': np.arange(4)},
    ...                             {'w': np.zeros((2, 2))}, s)['w'].tolist()
    [[0, 3], [1, 2]]
  """
  return _relaid(stages, like, schedule, to_ranks=True)


def _relaid(stages: PyTree, like: PyTree, schedule: Schedule, *,
            to_ranks: bool) -> PyTree:
  """Leaves laid out like a global array of ``like`` in one jitted program
  (``_relaid_arrays``), the others one by one."""
  if not isinstance(schedule, Schedule):
    raise TypeError('schedule must be a jaxpar.pipeline.Schedule, got '
                    f'{type(schedule).__name__}.')
  if to_ranks:
    check_leading(stages, schedule.num_stages, 'stages',
                         'schedule.num_stages')
  else:
    lead = (schedule.num_ranks, schedule.num_stages // schedule.num_ranks)
    wrong = [f'stages{jax.tree_util.keystr(k)} has shape {np.shape(a)}'
             for k, a in jax.tree_util.tree_leaves_with_path(stages)
             if np.shape(a)[:2] != lead]
    if wrong:
      raise ValueError(
          f'{"; ".join(wrong)}, but rank-order stage leaves start with '
          f'(num_ranks, num_stages // num_ranks) = {lead} for schedule '
          f'{schedule.name!r}; model-order leaves go to stages_like.')
  leaves, tree = jax.tree.flatten(stages)
  refs = tree.flatten_up_to(like)
  move = executor.stages_to_ranks if to_ranks else executor.ranks_to_stages
  out, todo = [], []
  for i, (a, ref) in enumerate(zip(leaves, refs)):
    if model_sharding(ref) is not None:   # a global array's sharding
      todo.append(i)
      out.append(None)
    else:
      a = move(a, schedule)
      out.append(np.asarray(a) if isinstance(ref, np.ndarray) else a)
  if todo:
    moves = tuple((model_sharding(refs[i]), refs[i].sharding) if to_ranks
                  else (model_sharding(refs[i]),) * 2 for i in todo)
    for i, a in zip(todo, _relaid_arrays([leaves[i] for i in todo], schedule,
                                         moves, to_ranks)):
      out[i] = a
  return tree.unflatten(out)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _relaid_arrays(leaves: list, schedule: Schedule, moves: tuple,
                   to_ranks: bool) -> list:
  """``moves[i] = (model-order sharding, sharding of the result)``."""
  move = executor.stages_to_ranks if to_ranks else executor.ranks_to_stages
  return [jax.device_put(move(a, schedule, out_sharding=model), out)
          for a, (model, out) in zip(leaves, moves)]


# --------------------------------------------------- a state's own placement

# placement -> its PipelineParams subclass (and a schedule that has it).
_PLACED: dict[tuple[tuple[int, ...], ...], type] = {}


def placed(params: PipelineParams, schedule: Schedule) -> PipelineParams:
  """``params`` (stages in ``schedule``'s rank order) typed with that
  placement: a ``PipelineParams`` subclass whose ``placement`` is
  ``local_stages(schedule)`` (and ``schedule`` one schedule with it).

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> from jaxpar.parallel._placement import placed
    >>> pp = jaxpar.parallel.PipelineParams({}, {'w': jnp.zeros((2, 2))}, {})
    >>> zbv = placed(pp, jaxpar.pipeline.zero_bubble_v(2, 2))
    >>> type(zbv).__name__, zbv.placement, isinstance(
    ...     zbv, jaxpar.parallel.PipelineParams)
    ('PipelineParams', ((0, 3), (1, 2)), True)
  """
  placement = local_stages(schedule)
  if placement not in _PLACED:
    _PLACED[placement] = type('PipelineParams', (PipelineParams,), {
        '__slots__': (), '__module__': PipelineParams.__module__,
        '__doc__': f'PipelineParams, stages in the rank order '
                   f'{placement} (rank r holds the stages placement[r]).',
        'placement': placement, 'schedule': schedule,
        '__reduce__': lambda self: (placed, (PipelineParams(*self),
                                             type(self).schedule))})
  return _PLACED[placement](*params)


def relaid(params: PipelineParams, schedule: Schedule) -> PipelineParams:
  """Rank-placement ``params`` in ``schedule``'s placement, as a plain
  ``PipelineParams``: those ``placed`` for another placement are moved
  (through model order, exact; e.g. a live state from an interleaved
  trainer handed to a ZB-V one); untyped ones are taken as they are.

  Raises:
    ValueError: the stages are placed for another number of ranks or of
      stages: restore a checkpoint saved with ``schedule=`` instead.
  """
  old = getattr(type(params), 'schedule', None)
  plain = PipelineParams(*params)
  if old is None or params.placement == local_stages(schedule):
    return plain
  if (old.num_ranks, old.num_stages) != (schedule.num_ranks,
                                         schedule.num_stages):
    raise ValueError(
        f'the state holds its stages in the rank order of schedule '
        f'{old.name!r} ({old.num_ranks} ranks, {old.num_stages} stages); '
        f'this trainer runs {schedule.name!r} ({schedule.num_ranks} ranks, '
        f'{schedule.num_stages} stages). Save it with jaxpar.checkpoint.save('
        f'..., schedule=old_schedule) and restore it with jaxpar.checkpoint.'
        f'restore(..., trainer.init(params), schedule=new_schedule).')
  return plain._replace(stages=stages_like(
      stages_in_model_order(plain.stages, old), plain.stages, schedule))
