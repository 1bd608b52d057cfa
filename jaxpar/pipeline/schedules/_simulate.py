"""Event-driven timing of a pipeline schedule: makespan, bubbles, peak stashes.

Every rank runs its actions in order; an action starts when the previous
action on its rank has ended and each of its dependencies (see
``jaxpar.pipeline.Schedule``) has ended, plus ``comm`` when the dependency ran
on another rank. Start times are computed in one topological pass over the
actions (Kahn's algorithm), ``O(actions)``: no loop over time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from jaxpar.pipeline.schedules._action import Action, ScheduleLike

DEFAULT_COSTS = {'F': 1.0, 'B': 2.0, 'I': 1.0, 'W': 1.0}


class SimResult(NamedTuple):
  """Timing of a schedule (time in the units of ``costs``).

  Attributes:
    makespan: ``T``, the end time of the last action (all start at >= 0).
    bubble_fraction: ``1 - sum(busy) / (p * T)``, the idle share of the
      ``p x T`` rank-time rectangle.
    busy: per rank, the summed cost of its actions.
    bubble: per rank, ``T - busy``: idle time, waiting for dependencies or
      for the other ranks to finish.
    peak_activations: per rank, the largest number of ``(stage, microbatch)``
      whose ``F`` has run and whose ``B`` (or ``I``, when split) has not: the
      activation stashes the rank must hold at once.
    peak_weight_grad_stash: per rank, the largest number whose ``I`` has run
      and whose ``W`` has not (0 for unsplit schedules).
    start: start time of every action.
    end: end time of every action (``start + costs[kind]``).
  """
  makespan: float
  bubble_fraction: float
  busy: tuple[float, ...]
  bubble: tuple[float, ...]
  peak_activations: tuple[int, ...]
  peak_weight_grad_stash: tuple[int, ...]
  start: dict[Action, float]
  end: dict[Action, float]


def check_costs(costs: Mapping[str, float] | None,
                defaults: Mapping[str, float] = DEFAULT_COSTS
                ) -> dict[str, float]:
  """``defaults`` updated by ``costs``; ``ValueError`` for bad kinds/values.

  Without a ``'B'`` entry a full backward costs ``I + W``.
  """
  if costs is None:
    return dict(defaults)
  if not isinstance(costs, Mapping):
    raise TypeError(f'costs={costs!r} must be a mapping from kind to time, '
                    "e.g. {'F': 1, 'B': 2, 'I': 1, 'W': 1}.")
  merged = dict(defaults)
  for kind, cost in costs.items():
    if kind not in defaults:
      raise ValueError(f'costs={dict(costs)!r}: unknown kind {kind!r}; use '
                       f'some of {sorted(defaults)}.')
    if (isinstance(cost, bool) or not isinstance(cost, (int, float))
        or not math.isfinite(cost) or cost < 0):
      raise ValueError(f'costs={dict(costs)!r}: costs[{kind!r}]={cost!r} must '
                       'be a finite number >= 0.')
    merged[kind] = float(cost)
  if 'B' not in costs and 'B' in merged:
    merged['B'] = merged['I'] + merged['W']
  return merged


def check_comm(comm: object) -> float:
  """``comm`` as a float; ``ValueError`` unless a finite number ``>= 0``."""
  if (isinstance(comm, bool) or not isinstance(comm, (int, float))
      or not math.isfinite(comm) or comm < 0):
    raise ValueError(f'comm={comm!r} must be a finite number >= 0 (time '
                     'between a dependency ending and its consumer starting '
                     'on another rank).')
  return float(comm)


def dependency_graph(schedule: ScheduleLike
                     ) -> dict[Action, tuple[Action, ...]]:
  """What each action of ``schedule`` waits for, besides its rank's order.

  ``F(s, i) <- F(s-1, i)``; ``B/I(s, i) <- F(s, i), B/I(s+1, i)`` (the latter
  for ``s < S-1``); ``W(s, i) <- I(s, i)``. Assumes the counts are valid
  (``Schedule.validate`` checks them first).

  Returns:
    ``{action: dependencies}`` for every action in the schedule.
  """
  present = {a for row in schedule.actions for a in row if a is not None}
  last = schedule.num_stages - 1

  def grad(stage, mb):  # the action producing the input gradient of ``stage``
    full = Action(stage, 'B', mb)
    return full if full in present else Action(stage, 'I', mb)

  graph = {}
  for a in present:
    s, kind, i = a
    if kind == 'F':
      deps = (Action(s - 1, 'F', i),) if s > 0 else ()
    elif kind == 'W':
      deps = (Action(s, 'I', i),)
    else:
      deps = (Action(s, 'F', i),) + ((grad(s + 1, i),) if s < last else ())
    graph[a] = deps
  return graph


def _run(schedule: ScheduleLike, graph: Mapping[Action, tuple[Action, ...]],
         duration: Mapping[str, float], comm: float):
  """Start/end times by Kahn's algorithm; unreached actions are deadlocked."""
  rank_of, successors, waiting = {}, {}, {}
  for rank, row in enumerate(schedule.actions):
    prev = None
    for a in row:
      if a is None:
        continue
      rank_of[a] = rank
      successors.setdefault(a, [])
      waiting[a] = len(graph[a]) + (prev is not None)
      if prev is not None:
        successors[prev].append(a)
      prev = a
  for a, deps in graph.items():
    for d in deps:
      successors[d].append(a)
  free_at = [0.0] * schedule.num_ranks  # when each rank's last action ended
  start, end = {}, {}
  ready = [a for a, n in waiting.items() if n == 0]
  while ready:
    a = ready.pop()
    rank = rank_of[a]
    t = free_at[rank]
    for d in graph[a]:
      t = max(t, end[d] + (comm if rank_of[d] != rank else 0.0))
    start[a], end[a] = t, t + duration[a.kind]
    free_at[rank] = end[a]
    for b in successors[a]:
      waiting[b] -= 1
      if waiting[b] == 0:
        ready.append(b)
  return start, end


def blocked(schedule: ScheduleLike, graph: Mapping[Action, tuple[Action, ...]]
            ) -> list[tuple[int, int, Action]]:
  """``(rank, step, awaited action)`` for each rank stuck in a deadlock.

  Empty when every action can run. ``step`` is the position of the first
  action the rank cannot start; the awaited action is one of its unfinished
  dependencies.
  """
  _, end = _run(schedule, graph, dict.fromkeys('FBIW', 0.0), 0.0)
  stuck = []
  for rank, row in enumerate(schedule.actions):
    for step, a in enumerate(row):
      if a is not None and a not in end:
        dep = next(d for d in graph[a] if d not in end)
        stuck.append((rank, step, dep))
        break
  return stuck


def _peak(row, plus: str, minus: tuple[str, ...]) -> int:
  live = peak = 0
  for a in row:
    if a is not None:
      live += (a.kind == plus) - (a.kind in minus)
      peak = max(peak, live)
  return peak


def peak_memory(schedule: ScheduleLike) -> tuple[float, ...]:
  """Per rank, the most activation stashes held at once, in 1F1B stages.

  A forward's stash is held until its backward has fully run: ``B``, or
  ``W`` when split (the weight gradient needs the stage's inputs too; a
  rank of ZB-H1 holds as much as 1F1B's rank 0). A logical stage is
  ``num_ranks / num_stages`` of a 1F1B stage, so the unit is one 1F1B
  stage's activations for one microbatch: 1F1B, ZB-H1 and ZB-V hold ``p``,
  GPipe ``m``. ``search``'s ``memory_limit`` is in this unit.

  Example:
    >>> import jaxpar
    >>> from jaxpar.pipeline import peak_memory
    >>> peak_memory(jaxpar.pipeline.one_f_one_b(4, 8))
    (4.0, 3.0, 2.0, 1.0)
    >>> peak_memory(jaxpar.pipeline.zero_bubble_v(4, 8))
    (4.0, 4.0, 4.0, 4.0)
  """
  unit = schedule.num_ranks / schedule.num_stages
  return tuple(unit * _peak(row, 'F', ('B', 'W')) for row in schedule.actions)


def simulate(schedule: ScheduleLike, costs: Mapping[str, float] | None = None,
             comm: float = 0.0) -> SimResult:
  """Times ``schedule``: ranks run their actions in order, as early as possible.

  Args:
    schedule: a ``Schedule`` (validated first; idle ``None`` slots take no
      time, waiting follows from the dependencies).
    costs: time per action kind, merged into the default
      ``{'F': 1, 'B': 2, 'I': 1, 'W': 1}`` (without a ``'B'`` entry,
      ``B = I + W``).
    comm: latency ``>= 0`` between a dependency ending on one rank and its
      consumer starting on another (0 between stages on the same rank).

  Returns:
    ``SimResult``. Closed forms (``comm = 0``, uniform costs): GPipe and 1F1B
    have bubble fraction ``(p-1)/(m+p-1)``; 1F1B stashes ``min(p-r, m)``
    activations on rank ``r``, GPipe ``m``.

  Raises:
    ScheduleError: if the schedule is invalid; ValueError for bad costs/comm.

  Example:
    >>> import jaxpar
    >>> from jaxpar.pipeline.schedules._simulate import simulate
    >>> r = simulate(jaxpar.pipeline.gpipe(4, 8), costs={'F': 1, 'B': 1})
    >>> r.makespan, round(r.bubble_fraction, 4)   # 2(m+p-1), 3/11
    (22.0, 0.2727)
  """
  duration = check_costs(costs)
  comm = check_comm(comm)
  graph = dependency_graph(schedule.validate())
  start, end = _run(schedule, graph, duration, comm)
  makespan = max(end.values())
  busy = tuple(sum(duration[a.kind] for a in row if a is not None)
               for row in schedule.actions)
  return SimResult(
      makespan=makespan,
      bubble_fraction=(1.0 - sum(busy) / (schedule.num_ranks * makespan)
                       if makespan > 0 else 0.0),
      busy=busy,
      bubble=tuple(makespan - b for b in busy),
      peak_activations=tuple(_peak(row, 'F', ('B', 'I'))
                             for row in schedule.actions),
      peak_weight_grad_stash=tuple(_peak(row, 'I', ('W',))
                                   for row in schedule.actions),
      start=start, end=end)
