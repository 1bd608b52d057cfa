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
which is what ``peak_memory`` measures. A rank admits a new
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


class GreedyRule(NamedTuple):
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


GREEDY_RULES = tuple(
    GreedyRule(split, forward_first, fill, None, reserve_all)
    for split in (True, False) for forward_first in (False, True)
    for fill in ('always', 'fit', 'eager') for reserve_all in (True, False))


def schedule(num_ranks: int, num_microbatches: int,
             placement: Sequence[int], cap: int,
             costs: Mapping[str, float], rule: GreedyRule = GreedyRule(),
             comm: float = 0.0, name: str = 'greedy') -> Schedule | None:
  """The greedy schedule for ``placement`` with at most ``cap`` stashes a rank.

  Args:
    num_ranks: ``p``.
    num_microbatches: ``m``.
    placement: rank of each logical stage.
    cap: stashes per rank (``>= `` the stages a rank holds).
    costs: time of each action kind (already per logical stage).
    rule: the heuristic's knobs.
    comm: latency between ranks, as in ``Schedule.simulate``.
    name: the schedule's name.

  Returns:
    The (unvalidated) ``Schedule``, or ``None`` if the cap is too small for
    this placement.
  """
  run = _GreedyRun.make(num_ranks, num_microbatches, placement, cap, costs,
                        rule, comm)
  if any(len(stages) > cap for stages in run.mine):
    return None
  state = _State.start(run)
  while any(state.todo):
    busy = [r for r in range(num_ranks) if state.todo[r]]
    rank = min(busy, key=lambda r: (state.clock(r), r in state.stalled, r))
    t = state.clock(rank)
    if rank in state.stalled:  # every rank at time t waits
      if not _wait_for_next_event(run, state, busy, t):
        return None  # the cap deadlocks this placement
      continue
    action = _choose(run, state, rank, t, busy)
    if action is None:
      state.stalled.add(rank)
      continue
    _run_action(run, state, rank, action, t)
    state.stalled.clear()
  return Schedule(num_ranks, run.num_stages, num_microbatches,
                  tuple(placement), tuple(map(tuple, state.rows)), name)


class _GreedyRun(NamedTuple):
  """What a run of the scheduler is given (and derives), fixed throughout."""
  num_ranks: int
  num_microbatches: int
  placement: tuple[int, ...]
  mine: list[list[int]]     # the stages of each rank, in model order
  cap: int
  inflight_cap: int         # rule.max_inflight, or the cap
  grad: str                 # the backward that frees the input: 'I' or 'B'
  actions_per_stash: int    # F + (I, W) or F + B
  costs: Mapping[str, float]
  rule: GreedyRule
  comm: float

  @property
  def num_stages(self) -> int:
    return len(self.placement)

  @classmethod
  def make(cls, p, m, placement, cap, costs, rule, comm) -> _GreedyRun:
    mine = [[s for s in range(len(placement)) if placement[s] == r]
            for r in range(p)]
    kinds = ('I', 'W') if rule.split else ('B',)
    return cls(p, m, tuple(placement), mine, cap,
               cap if rule.max_inflight is None else rule.max_inflight,
               kinds[0], 1 + len(kinds), costs, rule, comm)


class _State(NamedTuple):
  """The list scheduler's state, one entry per stage or per rank; the lists
  are updated in place by ``_run_action`` and ``_wait_for_next_event``."""
  f_next: list[int]         # next microbatch to forward, per stage
  b_next: list[int]         # next microbatch to backward (B or I), per stage
  end: dict[Action, float]  # when each action that ran ends
  free_at: list[float]      # when each rank's last action ends
  waiting_until: list[float]   # a stalled rank's clock jumps to here
  live: list[int]           # stashes held
  admitted: list[int]       # microbatches entered at the rank's first stage
  retired: list[int]        # ... whose stashes are all freed on this rank
  pending_w: list[collections.deque]   # I done, W not yet run (FIFO)
  rows: list[list[Action]]  # the schedule so far
  todo: list[int]           # actions still to run
  stalled: set[int]         # ranks with nothing to run at their clock

  @classmethod
  def start(cls, run: _GreedyRun) -> _State:
    p, n = run.num_ranks, run.num_stages
    return cls([0] * n, [0] * n, {}, [0.0] * p, [0.0] * p, [0] * p, [0] * p,
               [0] * p, [collections.deque() for _ in range(p)],
               [[] for _ in range(p)],
               [len(stages) * run.num_microbatches * run.actions_per_stash
                for stages in run.mine], set())

  def clock(self, rank: int) -> float:
    return max(self.free_at[rank], self.waiting_until[rank])


def _arrival(run: _GreedyRun, state: _State, action: Action,
             rank: int) -> float | None:
  """When ``action``'s cross-action inputs are there (``None``: not yet)."""
  s, kind, i = action
  if kind == 'F':   # plain tuples: the keys of ``end`` compare equal
    deps = ((s - 1, 'F', i),) if s > 0 else ()
  elif s < run.num_stages - 1:
    deps = ((s, 'F', i), (s + 1, run.grad, i))
  else:
    deps = ((s, 'F', i),)
  t, end = 0.0, state.end
  for d in deps:
    e = end.get(d)
    if e is None:
      return None
    t = max(t, e + (run.comm if run.placement[d[0]] != rank else 0.0))
  return t


def _future_forwards(run: _GreedyRun, state: _State, rank: int) -> int:
  """Forwards still to run on this rank for microbatches it admitted."""
  first = run.mine[rank][0]
  return sum(state.f_next[first] - state.f_next[s]
             for s in run.mine[rank][1:])


def _admits(run: _GreedyRun, state: _State, rank: int) -> bool:
  """Whether the rank's cap has room to admit a new microbatch."""
  room = state.live[rank] + len(run.mine[rank]) + (
      _future_forwards(run, state, rank) if run.rule.reserve_all else 0)
  return room <= run.cap and (
      state.admitted[rank] - state.retired[rank] < run.inflight_cap)


def _candidates(run: _GreedyRun, state: _State,
                rank: int) -> list[tuple[float | None, Action]]:
  """``(arrival or None, action)`` for the next F per stage and B/I."""
  out = []
  for s in run.mine[rank]:
    if state.b_next[s] < state.f_next[s]:
      a = Action(s, run.grad, state.b_next[s])
      out.append((_arrival(run, state, a, rank), a))
    if state.f_next[s] < run.num_microbatches:
      a = Action(s, 'F', state.f_next[s])
      if state.live[rank] >= run.cap:
        continue
      if s == run.mine[rank][0] and not _admits(run, state, rank):
        continue
      out.append((_arrival(run, state, a, rank), a))
  return out


def _choose(run: _GreedyRun, state: _State, rank: int, t: float,
            busy: list[int]) -> Action | None:
  """The action ``rank`` runs at ``t`` (``None``: it waits)."""
  rule, pending_w = run.rule, state.pending_w[rank]
  cands = _candidates(run, state, rank)
  ready = [a for at, a in cands if at is not None and at <= t]
  known = [at for at, _ in cands if at is not None]
  if pending_w and rule.fill == 'eager' and not any(
      a.kind in 'BI' for a in ready):
    return pending_w.popleft()
  if ready:
    order = ('F', 'B', 'I') if rule.forward_first else ('B', 'I', 'F')
    return min(ready, key=lambda a: (order.index(a.kind), -a.stage))
  if pending_w and (rule.fill == 'always' or not known
                    or t + run.costs['W'] <= min(known)
                    or not any(state.todo[r] for r in busy if r != rank)):
    return pending_w.popleft()
  return None


def _run_action(run: _GreedyRun, state: _State, rank: int, action: Action,
         t: float) -> None:
  s, kind, i = action
  first = s == run.mine[rank][0]
  state.end[action] = t + run.costs[kind]
  state.free_at[rank] = state.end[action]
  state.rows[rank].append(action)
  state.todo[rank] -= 1
  if kind == 'F':
    state.f_next[s] += 1
    state.live[rank] += 1
    state.admitted[rank] += first
  elif kind in ('B', 'I'):
    state.b_next[s] += 1
    if kind == 'I':
      state.pending_w[rank].append(Action(s, 'W', i))
  if kind in ('B', 'W'):
    state.live[rank] -= 1
    state.retired[rank] += first


def _wait_for_next_event(run: _GreedyRun, state: _State, busy: list[int],
                         t: float) -> bool:
  """Every rank at time ``t`` waits: moves the stalled ranks' clocks to the
  next event (``False``: there is none, the cap deadlocks)."""
  future = [state.clock(r) for r in busy if state.clock(r) > t] + [
      at for r in state.stalled for at, _ in _candidates(run, state, r)
      if at is not None and at > t]
  if not future:
    return False
  for r in state.stalled:
    state.waiting_until[r] = max(state.waiting_until[r], min(future))
  state.stalled.clear()
  return True
