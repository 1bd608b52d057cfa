"""A memory-capped list scheduler: the engine of ``search``, V-Half and V-Min.

The zero-bubble paper's heuristic (Qi et al. 2024, section 3), generalised to
any placement: ranks are simulated event by event; a rank that is free at time
``t`` runs, among the actions whose inputs have arrived, a backward first (it
frees memory and unblocks the ranks upstream), else a forward if its memory
allows, else a pending weight gradient ``W`` to fill the bubble; it waits only
when none of these can run. Forwards enter each stage in microbatch order,
backwards leave it in microbatch order, ``W`` run first-in first-out.

Memory is counted in stashes: a forward's stash lives until its backward has
fully run (``B``, or ``W`` when the backward is split into ``I`` and ``W``),
which is what ``simulate.peak_memory`` measures. A rank admits a new
microbatch only if its cap leaves room for the forwards of every microbatch
it has already admitted on its later stages (V placements hold two), so the
cap itself can never deadlock the pipeline.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from jaxpar.pipeline.schedules._action import Action
from jaxpar.pipeline.schedules._schedule import Schedule


class Policy(NamedTuple):
  """The knobs the search turns (each combination is one candidate).

  Attributes:
    split: backwards as ``I`` + ``W`` (``True``) or one ``B``.
    forward_first: when a forward and a backward are both ready, run the
      forward (fills the pipeline sooner) instead of the backward.
    fill: run a pending ``W`` while waiting ``'always'``, only when it ends
      before the earliest known arrival (``'fit'``), or before any forward
      (``'eager'``: stashes freed soonest, for tight caps).
    max_inflight: at most this many microbatches admitted and not yet fully
      backwarded per rank (``None``: as many as the cap allows).
    reserve_all: admit a microbatch only with room for the later-stage
      forwards of every admitted one (never deadlocks), or with room for one
      (``False``: the next such forward always fits, as they run in
      microbatch order; far more microbatches in flight on a V, and a cap
      that deadlocks is reported as ``None``).
  """
  split: bool = True
  forward_first: bool = False
  fill: str = 'always'
  max_inflight: int | None = None
  reserve_all: bool = True


POLICIES = tuple(Policy(split, forward_first, fill, None, reserve_all)
                 for split in (True, False) for forward_first in (False, True)
                 for fill in ('always', 'fit', 'eager')
                 for reserve_all in (True, False))


def schedule(num_ranks: int, num_microbatches: int,
             placement: Sequence[int], cap: int,
             costs: Mapping[str, float], policy: Policy = Policy(),
             comm: float = 0.0, name: str = 'greedy') -> Schedule | None:
  """The greedy schedule for ``placement`` with at most ``cap`` stashes a rank.

  Args:
    num_ranks: ``p``.
    num_microbatches: ``m``.
    placement: rank of each logical stage.
    cap: stashes per rank (``>= `` the stages a rank holds).
    costs: time of each action kind (already per logical stage).
    policy: the heuristic's knobs.
    comm: latency between ranks, as in ``simulate``.
    name: the schedule's name.

  Returns:
    The (unvalidated) ``Schedule``, or ``None`` if the cap is too small for
    this placement.
  """
  p, m, num_stages = num_ranks, num_microbatches, len(placement)
  mine = [[s for s in range(num_stages) if placement[s] == r]
          for r in range(p)]
  if any(len(stages) > cap for stages in mine):
    return None
  inflight_cap = cap if policy.max_inflight is None else policy.max_inflight
  last = num_stages - 1
  kinds = ('I', 'W') if policy.split else ('B',)
  grad = kinds[0]
  f_next = [0] * num_stages  # next microbatch to forward at each stage
  b_next = [0] * num_stages
  end: dict[Action, float] = {}
  free_at = [0.0] * p
  live = [0] * p  # stashes held
  admitted = [0] * p  # microbatches entered at the rank's first stage
  retired = [0] * p  # ... whose stashes are all freed on this rank
  pending_w = [collections.deque() for _ in range(p)]
  rows: list[list[Action]] = [[] for _ in range(p)]
  todo = [len(stages) * m * len(kinds) + len(stages) * m for stages in mine]

  def arrival(action: Action, rank: int) -> float | None:
    """When ``action``'s cross-action inputs are there (``None``: not yet)."""
    s, kind, i = action
    if kind == 'F':
      deps = [Action(s - 1, 'F', i)] if s > 0 else []
    else:
      deps = [Action(s, 'F', i)] + (
          [Action(s + 1, grad, i)] if s < last else [])
    t = 0.0
    for d in deps:
      if d not in end:
        return None
      t = max(t, end[d] + (comm if placement[d.stage] != rank else 0.0))
    return t

  def future_forwards(rank: int) -> int:
    """Forwards still to run on this rank for microbatches it admitted."""
    first = mine[rank][0]
    return sum(f_next[first] - f_next[s] for s in mine[rank][1:])

  def candidates(rank: int):
    """``(arrival or None, action)`` for the next F per stage and B/I."""
    out = []
    for s in mine[rank]:
      if b_next[s] < f_next[s]:
        a = Action(s, grad, b_next[s])
        out.append((arrival(a, rank), a))
      if f_next[s] < m:
        a = Action(s, 'F', f_next[s])
        if live[rank] >= cap:
          continue
        if s == mine[rank][0]:
          room = live[rank] + len(mine[rank]) + (
              future_forwards(rank) if policy.reserve_all else 0)
          if room > cap or admitted[rank] - retired[rank] >= inflight_cap:
            continue
        out.append((arrival(a, rank), a))
    return out

  def run(rank: int, action: Action, t: float):
    s, kind, i = action
    end[action] = t + costs[kind]
    free_at[rank] = end[action]
    rows[rank].append(action)
    todo[rank] -= 1
    if kind == 'F':
      f_next[s] += 1
      live[rank] += 1
      admitted[rank] += s == mine[rank][0]
    elif kind in ('B', 'I'):
      b_next[s] += 1
      if kind == 'I':
        pending_w[rank].append(Action(s, 'W', i))
    if kind in ('B', 'W'):
      live[rank] -= 1
      retired[rank] += s == mine[rank][0]

  waiting_until = [0.0] * p
  stalled: set[int] = set()  # ranks with nothing to run at their clock
  clock = lambda r: max(free_at[r], waiting_until[r])
  while any(todo):
    busy = [r for r in range(p) if todo[r]]
    rank = min(busy, key=lambda r: (clock(r), r in stalled, r))
    t = clock(rank)
    if rank in stalled:  # every rank at time t waits: jump to the next event
      future = [clock(r) for r in busy if clock(r) > t] + [
          at for r in stalled for at, _ in candidates(r)
          if at is not None and at > t]
      if not future:
        return None  # the cap deadlocks this placement
      for r in stalled:
        waiting_until[r] = max(waiting_until[r], min(future))
      stalled.clear()
      continue
    cands = candidates(rank)
    ready = [a for at, a in cands if at is not None and at <= t]
    known = [at for at, _ in cands if at is not None]
    if pending_w[rank] and policy.fill == 'eager' and not any(
        a.kind in 'BI' for a in ready):
      run(rank, pending_w[rank].popleft(), t)
    elif ready:
      order = ('F', 'B', 'I') if policy.forward_first else ('B', 'I', 'F')
      ready.sort(key=lambda a: (order.index(a.kind), -a.stage))
      run(rank, ready[0], t)
    elif pending_w[rank] and (policy.fill == 'always' or not known
                              or t + costs['W'] <= min(known)
                              or not any(todo[r] for r in busy if r != rank)):
      run(rank, pending_w[rank].popleft(), t)
    else:
      stalled.add(rank)
      continue
    stalled.clear()
  return Schedule(p, num_stages, m, tuple(placement), tuple(map(tuple, rows)),
                  name)
