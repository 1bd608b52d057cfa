"""The packing of a schedule's blocks into lock-step ticks (``tick_table``).

``layout(schedule, message_cost)`` places each rank's blocks (``F``, a
fused ``B`` or its ``I`` and ``W``) in ticks, in the rank's order and after
their inputs, by list scheduling with a one-step lookahead that packs like
with like: ranks run blocks of equal cost in the same tick where the
dependencies allow, and send in the same ticks (``_tick_table``'s module
doc has the rule and the numbers).
"""

from __future__ import annotations

from typing import NamedTuple

from jaxpar.pipeline.schedules._action import Action
from jaxpar.pipeline.schedules._schedule import Schedule
from jaxpar.pipeline.schedules._simulate import DEFAULT_COSTS

# Blocks placed by the lookahead's tries, per table, before it stops trying:
# interleaved 1F1B at p = 8, m = 64 (2048 blocks) takes 0.4 s of CPU.
_LOOKAHEAD = 100_000


class Blocks(NamedTuple):
  """A schedule's blocks, numbered: what the packing places in ticks.

  ``actions[b]`` is block ``b`` (a split ``B(s, i)`` is two blocks,
  ``I(s, i)`` and ``W(s, i)``); ``rows[r]`` rank ``r``'s blocks in order;
  ``deps[b]`` the blocks whose results ``b`` reads (placed strictly
  earlier); ``cost[b]`` its time (``DEFAULT_COSTS``); ``sends[b]`` the
  offset of its message to another rank, ``0`` if none; ``before[b]`` the
  block before it on its rank (``-1``: none) and ``after[b]`` the blocks
  that wait for ``b`` (reading it, or next on its rank).
  """
  actions: list[Action]
  rows: list[list[int]]
  deps: list[tuple[int, ...]]
  cost: list[float]
  sends: list[int]
  before: list[int]
  after: list[list[int]]


def _blocks(schedule: Schedule, *, fuse: bool) -> Blocks:
  """The blocks of a validated ``schedule``, each ``B`` one block if
  ``fuse``, else an ``I`` and then a ``W`` (module doc)."""
  p, last, where = schedule.num_ranks, schedule.num_stages - 1, {}
  actions, rows = [], []
  for acts in schedule.actions:
    rows.append([])
    for a in acts:
      if a is None:
        continue
      for kind in ('I', 'W') if a.kind == 'B' and not fuse else (a.kind,):
        where[a._replace(kind=kind)] = len(actions)
        rows[-1].append(len(actions))
        actions.append(a._replace(kind=kind))

  def grad(s, i):  # the block computing stage s's input cotangent
    return where.get(Action(s, 'B', i), where.get(Action(s, 'I', i)))

  deps, sends = [], []
  for s, kind, i in actions:
    offset = 0
    if kind == 'F':
      deps.append((where[Action(s - 1, 'F', i)],) if s > 0 else ())
      if s < last:
        offset = schedule.placement[s + 1] - schedule.placement[s]
    elif kind == 'W':
      deps.append((where[Action(s, 'I', i)],))
    else:
      deps.append((where[Action(s, 'F', i)],)
                  + ((grad(s + 1, i),) if s < last else ()))
      if s > 0:
        offset = schedule.placement[s - 1] - schedule.placement[s]
    sends.append(offset % p)
  before, after = [-1] * len(actions), [[] for _ in actions]
  for b, inputs in enumerate(deps):
    for d in inputs:
      after[d].append(b)
  for row in rows:
    for b, c in zip(row, row[1:]):
      before[c] = b
      after[b].append(c)
  return Blocks(actions, rows, deps, [DEFAULT_COSTS[a.kind] for a in actions],
                 sends, before, after)


class _Packing:
  """Blocks placed in ticks ``< t`` so far; ``place`` adds tick ``t``,
  ``finish`` places the rest by plain list scheduling."""

  def __init__(self, blocks: Blocks):
    self.blocks = blocks
    self.pos = [0] * len(blocks.rows)     # each rank's next block
    self.tick = [-1] * len(blocks.actions)
    self.t = 0
    self.time = 0.0       # lock-step time so far
    self.messages = 0     # ticks x offsets with messages between ranks

  def copy(self) -> _Packing:
    new = object.__new__(_Packing)
    new.__dict__.update(self.__dict__, pos=list(self.pos),
                        tick=list(self.tick))
    return new

  @property
  def done(self) -> bool:
    return all(p == len(row) for p, row in zip(self.pos, self.blocks.rows))

  def ready(self) -> list[int]:
    """The ranks whose next block can run at tick ``t``."""
    rows, deps, tick, t = self.blocks.rows, self.blocks.deps, self.tick, self.t
    return [r for r, row in enumerate(rows) if self.pos[r] < len(row)
            and all(0 <= tick[d] < t for d in deps[row[self.pos[r]]])]

  def place(self, ranks: list[int]) -> None:
    """Runs the next block of each of ``ranks`` at tick ``t``; next tick."""
    cost, offsets = 0.0, set()
    for r in ranks:
      b = self.blocks.rows[r][self.pos[r]]
      self.tick[b] = self.t
      self.pos[r] += 1
      cost = max(cost, self.blocks.cost[b])
      offsets.add(self.blocks.sends[b])
    self.time += cost
    self.messages += len(offsets - {0})
    self.t += 1

  def finish(self) -> int:
    """Places every block left at its earliest tick (after the rank's
    previous block and its inputs, from tick ``t`` on); returns how many."""
    blocks, tick, waiting, ready = self.blocks, self.tick, {}, []
    for r, row in enumerate(blocks.rows):
      for k in range(self.pos[r], len(row)):
        b = row[k]
        waiting[b] = sum(tick[d] < 0 for d in blocks.deps[b]) + (
            k > self.pos[r])
        if not waiting[b]:
          ready.append(b)
    cost, offsets = {}, {}
    while ready:
      b = ready.pop()
      prev = blocks.before[b]
      at = max([self.t, tick[prev] + 1 if prev >= 0 else 0]
               + [tick[d] + 1 for d in blocks.deps[b]])
      tick[b] = at
      cost[at] = max(cost.get(at, 0.0), blocks.cost[b])
      offsets.setdefault(at, set()).add(blocks.sends[b])
      for c in blocks.after[b]:
        if c in waiting:
          waiting[c] -= 1
          if not waiting[c]:
            ready.append(c)
    if any(tick[b] < 0 for b in waiting):   # validate() rules this out
      raise RuntimeError(f'Deadlock after tick {self.t}.')
    self.pos = [len(row) for row in blocks.rows]
    self.time += sum(cost.values())
    self.messages += sum(len(o - {0}) for o in offsets.values())
    self.t = max(cost, default=self.t - 1) + 1
    return len(waiting)


def _choices(packing: _Packing, ranks: list[int], *, drops: bool
             ) -> list[list[int]]:
  """What tick ``t`` may run: every ready rank first, then all but the
  costliest blocks (when costs differ) and, with ``drops``, all but one
  rank."""
  out = [ranks]
  cost = [packing.blocks.cost[packing.blocks.rows[r][packing.pos[r]]]
          for r in ranks]
  cheap = [r for r, c in zip(ranks, cost) if c < max(cost, default=0)]
  out += [cheap] if cheap else []
  if drops and len(ranks) > 1:
    out += [[q for q in ranks if q != r] for r in ranks]
  return [c for k, c in enumerate(out) if c not in out[:k]]


def _score(packing: _Packing, message_cost: float) -> tuple[float, ...]:
  """What the packing minimises: lock-step time plus ``message_cost`` per
  tick with messages, then the time, then the messages."""
  return (packing.time + message_cost * packing.messages, packing.time,
          packing.messages)


def _pack(blocks: Blocks, message_cost: float) -> _Packing:
  """The blocks in ticks with the least ``_score`` of two greedy packings:
  one scoring each tick's choices by ``_score``, one by the lock-step time
  and then the messages (the one-step lookahead is short-sighted either
  way)."""
  scores = (lambda k: _score(k, message_cost), lambda k: (k.time, k.messages))
  return min((_greedy(blocks, score) for score in scores),
             key=lambda k: _score(k, message_cost))


def _greedy(blocks: Blocks, score) -> _Packing:
  """List scheduling with a one-step lookahead (the module doc): each tick
  takes the choice whose plain finish has the least ``score``. Holding back
  one rank is tried in the first ``3 p`` ticks (it sets the ranks' phases)
  with half of ``_LOOKAHEAD`` (the blocks its tries may place), all tries
  with all of it."""
  packing, budget = _Packing(blocks), _LOOKAHEAD
  while not packing.done:
    ready = packing.ready()
    if not ready:   # validate() rules this out
      raise RuntimeError(f'Deadlock at tick {packing.t}.')
    drops = packing.t < 3 * len(blocks.rows) and budget > _LOOKAHEAD // 2
    choices = _choices(packing, ready, drops=drops) if budget > 0 else [ready]
    best, best_score = ready, None
    for choice in choices if len(choices) > 1 else ():
      trial = packing.copy()
      trial.place(choice)
      budget -= trial.finish()
      if best_score is None or score(trial) < best_score:
        best, best_score = choice, score(trial)
    packing.place(best)
  return packing


def layout(schedule: Schedule, message_cost: float) -> _Packing:
  """The packed blocks of ``schedule``: fused ``B``'s unless that is slower
  than the schedule as written, then split (module doc)."""
  fused = _pack(_blocks(schedule, fuse=True), message_cost)
  if (not any(a is not None and a.kind == 'B' for row in schedule.actions
              for a in row) or fused.time <= schedule.simulate().makespan):
    return fused
  return _pack(_blocks(schedule, fuse=False), message_cost)
