"""The fastest schedule under a memory cap (the zero-bubble paper's search).

``search`` runs jaxpar's memory-capped list scheduler (``_greedy``, the
zero-bubble paper's heuristic: warm up with as many forwards as memory
allows, then backward first, weight gradients ``W`` into the bubbles and
whenever memory is full) with every combination of its knobs, on the
one-stage-per-rank placement and on the V placement, and keeps the fastest
order whose stashes fit; the built-in constructors compete too, so the result
is never slower than any of them that fits.

"Fastest" is by the time the executor takes: the lock-step time of its tick
table (``tick_table(s).makespan``), where every tick lasts as long as its
slowest action. With ``F = I = W`` that is at most ``simulate``'s event-driven
time; with kinds of unequal cost it can be longer, and the search ranks the
candidates by what really runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Mapping

from jaxpar.pipeline.schedules import _greedy
from jaxpar.pipeline.schedules import _constructors
from jaxpar.pipeline.schedules import _tick_table
from jaxpar.pipeline.schedules import _simulate
from jaxpar.pipeline.schedules import _vshape
from jaxpar.pipeline.schedules._action import check_sizes
from jaxpar.pipeline.schedules._schedule import Schedule, ScheduleError

# Built-in schedules that compete, by placement: build(p, m).
_SINGLE: tuple[Callable[[int, int], Schedule], ...] = (
    _constructors.one_f_one_b, _constructors.zero_bubble_h1,
    _constructors.gpipe)
_V = (_constructors.zero_bubble_v, _vshape.dualpipe_v, _vshape.v_half,
      _vshape.v_min)
_CHUNKS = (2, 3, 4)  # interleaved 1F1B's chunks per rank, for m % p == 0
_POLISH_BUDGET = 150  # schedules timed while polishing the best one


def action_costs(schedule: Schedule,
                 costs: Mapping[str, float] | None = None) -> dict[str, float]:
  """Per-action costs of ``schedule`` from costs per 1F1B stage.

  A schedule with ``S`` logical stages on ``p`` ranks cuts the model ``S/p``
  times finer than 1F1B, so each of its actions costs ``p/S`` of a 1F1B
  stage's: ZB-V's forward costs half of 1F1B's. ``costs`` default to
  ``simulate.DEFAULT_COSTS``.

  Example:
    >>> import jaxpar
    >>> from jaxpar.pipeline.schedules._search import action_costs
    >>> action_costs(jaxpar.pipeline.zero_bubble_v(2, 4))
    {'F': 0.5, 'B': 1.0, 'I': 0.5, 'W': 0.5}
  """
  scale = schedule.num_ranks / schedule.num_stages
  return {k: c * scale for k, c in _simulate.check_costs(costs).items()}


def makespan(schedule: Schedule,
             costs: Mapping[str, float] | None = None, comm: float = 0.0
             ) -> float:
  """The executor's time for ``schedule``, with costs per 1F1B stage.

  The lock-step time of its tick table packed for ``comm``,
  ``tick_table(schedule, message_cost=comm / F).makespan(
  action_costs(schedule, costs), comm)``: a tick lasts as long as its slowest
  action, plus ``comm`` if it sends a message between ranks. Comparable
  across placements (1F1B and ZB-V of the same model, e.g.); at most
  ``schedule.simulate``'s time for ``F = I = W`` and ``comm = 0`` (less
  where the table splits a ``B`` and its ``I`` sends early: 1F1B).

  Example:
    >>> import jaxpar
    >>> from jaxpar.pipeline import makespan
    >>> from jaxpar.pipeline.schedules._search import action_costs
    >>> pp = jaxpar.pipeline
    >>> makespan(pp.one_f_one_b(4, 8)), makespan(pp.zero_bubble_v(4, 8))
    (30.0, 25.5)
    >>> s = pp.one_f_one_b(4, 8)
    >>> costs = {'F': 1, 'I': 1.5, 'W': 0.5}   # a tick waits for its I
    >>> makespan(s, costs), s.simulate(action_costs(s, costs)).makespan
    (38.5, 33.0)
  """
  per_action = action_costs(schedule, costs)
  return _makespan(dataclasses.replace(schedule, name=''),
                   tuple(sorted(per_action.items())), comm)


# Searches time the same built-in schedules again (each search offers every
# constructor that fits; a notebook or test searches under several limits),
# so makespans are cached by what they depend on (not the schedule's name).
# A bad schedule or comm raises every time: exceptions are not cached.
@functools.lru_cache(maxsize=4096, typed=True)
def _makespan(schedule: Schedule, per_action: tuple[tuple[str, float], ...],
              comm: float) -> float:
  """``makespan`` of a nameless schedule at ``dict(per_action)`` costs."""
  per_action = dict(per_action)
  # The table is packed for this comm: a message priced in the action's F.
  price = comm / per_action['F'] if per_action['F'] > 0 else comm
  return _tick_table.tick_table(schedule, message_cost=price).makespan(
      per_action, comm)


def search(num_ranks: int, num_microbatches: int, *, memory_limit: float,
           costs: Mapping[str, float] | None = None,
           v_shape: bool | None = None, comm: float = 0.0) -> Schedule:
  """The fastest schedule whose stashes stay within ``memory_limit`` per rank.

  Candidates: the list-scheduled orders (see the module docstring) and every
  built-in constructor of the allowed placements (1F1B, ZB-H1, GPipe; ZB-V,
  DualPipeV, V-Half, V-Min; interleaved 1F1B with 2, 3, 4 chunks a rank when
  ``p`` divides ``m``). Each is timed by ``makespan(s, costs, comm)``, the
  lock-step time the executor takes, and measured by
  ``simulate.peak_memory`` (a stash is held from its forward until its
  backward has fully run, ``W`` included); the fastest that fits wins, ties
  going to the built-in constructor. When ``F``, ``I`` and ``W`` cost
  differently (or ``comm > 0``) the lock-step time is not the list
  scheduler's event-driven one, and the winner is polished by swapping
  neighbouring actions while the lock-step time drops (at most 150 tries).

  With ``F = I = W`` ZB-H1 and ZB-V already reach the lower bounds of their
  placements, ``m(F+I+W)`` plus the last rank's wait for its first input,
  ``(p-1)F`` (one stage per rank) or ``(p-1)F/2`` (V); the search gains
  where the zero-bubble paper says, with unequal ``F``/``I``/``W`` and
  memory between ZB-H1's (``p``) and ZB-H2's (``2p``), and under caps below
  ``p`` where only V-Half and V-Min, or nothing built in, fit.

  Args:
    num_ranks: ``p >= 1``.
    num_microbatches: ``m >= 1``.
    memory_limit: stashes per rank in units of one 1F1B stage's activations
      for one microbatch (1F1B and ZB-V need ``p``, GPipe ``m``); ``>= 1``.
    costs: time per kind for one 1F1B stage, merged into
      ``{'F': 1, 'B': 2, 'I': 1, 'W': 1}``; V schedules pay half per action.
    v_shape: ``True``: only V placements (``2p`` stages); ``False``: only one
      stage per rank; ``None``: both, and interleaved 1F1B.
    comm: latency between ranks, as in ``simulate``.

  Returns:
    The validated fastest ``Schedule``: a constructor's (with its name) or a
    searched one named ``'Search(memory=...)'``.

  Raises:
    ValueError: for ``memory_limit`` below the minimum feasible memory (one
      1F1B stage: each rank must hold at least one stash of each of its
      stages), bad sizes or costs.

  Example:
    >>> import jaxpar
    >>> from jaxpar.pipeline import search
    >>> s = search(4, 8, memory_limit=2)
    >>> max(jaxpar.pipeline.peak_memory(s)) <= 2
    True
  """
  check_sizes('search', num_ranks=num_ranks, num_microbatches=num_microbatches)
  p, m = int(num_ranks), int(num_microbatches)
  limit = _check_limit(memory_limit, p, m, v_shape)
  _simulate.check_costs(costs)
  placements = [] if v_shape is True else [(tuple(range(p)), _SINGLE)]
  if v_shape is not False:
    placements.append((_vshape.v_placement(p), _V))
  builtins = [build(p, m) for _, builds in placements for build in builds]
  if v_shape is None and m % p == 0:
    builtins += [_constructors.interleaved_one_f_one_b(p, m, v)
                 for v in _CHUNKS]
  best = _Best(limit, costs, comm)
  for schedule in builtins:
    best.offer(schedule)
  for placement, _ in placements:
    scale = len(placement) / p
    per_action = {k: c / scale for k, c in _simulate.check_costs(costs).items()}
    cap = math.floor(limit * scale + 1e-9)
    for rule in _greedy.GREEDY_RULES:
      for inflight in sorted({cap // 2, cap - 1} - {0}) + [None]:
        s = _greedy.schedule(p, m, placement, cap, per_action,
                             rule._replace(max_inflight=inflight), comm,
                             name=f'Search(memory={memory_limit:g})')
        if s is not None:
          best.offer(s)
  per_action = _simulate.check_costs(costs)
  if len({per_action[k] for k in 'FIW'}) > 1 or comm:
    _polish(best, f'Search(memory={memory_limit:g})')
  return best.schedule.validate()


def _polish(best: _Best, name: str) -> None:
  """Swaps neighbouring actions of a rank while the executor's time drops.

  The list scheduler plans with event-driven time; in lock-step a tick
  waits for its slowest kind (and pays ``comm`` for its messages), so
  reordering two neighbours can shorten the table. Hill climbing on
  ``best``, first improvement, at most ``_POLISH_BUDGET`` schedules timed;
  each stage keeps its microbatch order per kind.
  """
  rows = [list(row) for row in best.schedule.actions]
  budget, improved = _POLISH_BUDGET, True
  while improved and budget > 0:
    improved = False
    for row in rows:
      for j in range(len(row) - 1):
        a, b = row[j], row[j + 1]
        if budget <= 0 or a.stage == b.stage and (
            a.kind == b.kind or a.microbatch == b.microbatch):
          continue
        row[j], row[j + 1] = b, a
        budget -= 1
        try:
          better = best.offer(dataclasses.replace(
              best.schedule, actions=tuple(map(tuple, rows)), name=name))
        except ScheduleError:  # the swap deadlocks
          better = False
        if better:
          improved = True
        else:
          row[j], row[j + 1] = a, b


class _Best:
  """The fastest schedule offered so far that fits ``limit``."""

  def __init__(self, limit: float, costs, comm: float):
    self.limit, self.costs, self.comm = limit, costs, comm
    self.schedule, self.time, self.seen = None, math.inf, set()

  def offer(self, schedule: Schedule) -> bool:
    """Keeps ``schedule`` if it fits and is faster; says whether it did."""
    if schedule.actions in self.seen:  # many knob settings agree
      return False
    self.seen.add(schedule.actions)
    if max(_simulate.peak_memory(schedule)) > self.limit + 1e-9:
      return False
    time = makespan(schedule, self.costs, self.comm)
    if time >= self.time:
      return False
    self.schedule, self.time = schedule, time
    return True


def _check_limit(memory_limit: object, p: int, m: int,
                 v_shape: bool | None) -> float:
  call = (f'search(num_ranks={p}, num_microbatches={m}, '
          f'memory_limit={memory_limit!r})')
  if v_shape not in (None, True, False):
    raise TypeError(f'{call}: v_shape={v_shape!r} must be True, False or '
                    'None (both placements).')
  if (isinstance(memory_limit, bool)
      or not isinstance(memory_limit, numbers.Real)):
    raise TypeError(f'{call}: memory_limit must be a number of 1F1B-stage '
                    'activations, e.g. memory_limit=2.')
  if not math.isfinite(memory_limit) or memory_limit < 1:
    raise ValueError(
        f'{call}: the minimum feasible memory is 1 (one 1F1B stage\'s '
        'activations for one microbatch: a rank must hold the stash of its '
        'stage while the microbatch runs downstream); 1F1B needs '
        f'{min(p, m)}. Use memory_limit >= 1.')
  return float(memory_limit)
