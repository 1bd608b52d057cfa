"""The packing of a schedule's blocks into lock-step ticks (``tick_table``).

``layout(schedule, message_cost)`` places each rank's blocks (``F``, a
fused ``B`` or its ``I`` and ``W``) in ticks, in the rank's order and after
their inputs, by list scheduling with a one-step lookahead that packs like
with like: ranks run blocks of equal cost in the same tick where the
dependencies allow, and send in the same ticks (``_tick_table``'s module
doc has the rule and the numbers). With ``bundle > 1`` (``_blocks``) a rank
holds a message back and sends it with its next ones over the same offset,
``bundle`` in one ``ppermute``; ``layout`` keeps that where it scores better.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxpar.pipeline.schedules._action import Action
from jaxpar.pipeline.schedules._schedule import Schedule
from jaxpar.pipeline.schedules._simulate import DEFAULT_COSTS

# Blocks placed by the lookahead's tries, per table, before it stops trying:
# interleaved 1F1B at p = 8, m = 64 (2048 blocks) takes 0.1 s of CPU.
_LOOKAHEAD = 100_000
# Messages per ``ppermute`` in the bundled layout (``layout``): pairs. GPipe
# p = 2, m = 12 sends in 12 ticks instead of 24 for 3 more units of
# lock-step time (42, not 39); bundles of 3 save less than they delay at
# ``MESSAGE_COST``.
BUNDLE = 2


class Blocks(NamedTuple):
  """A schedule's blocks, numbered: what the packing places in ticks.

  ``actions[b]`` is block ``b`` (a split ``B(s, i)`` is two blocks,
  ``I(s, i)`` and ``W(s, i)``); ``rows[r]`` rank ``r``'s blocks in order;
  ``deps[b]`` the blocks whose results ``b`` reads (placed strictly
  earlier); ``cost[b]`` its time (``DEFAULT_COSTS``); ``sends[b]`` the
  offset of its message to another rank, ``0`` if none (or held);
  ``before[b]`` the block before it on its rank (``-1``: none) and
  ``after[b]`` the blocks that wait for ``b`` (reading it, or next on its
  rank); ``carrier[b]`` the later block of its rank whose message carries
  ``b``'s (held until then: the blocks of other ranks that read ``b`` wait
  for the carrier), ``-1`` if ``b`` sends its own or none.
  """
  actions: list[Action]
  rows: list[list[int]]
  deps: list[tuple[int, ...]]
  cost: list[float]
  sends: list[int]
  before: list[int]
  after: list[list[int]]
  carrier: list[int]


def _blocks(schedule: Schedule, *, fuse: bool, bundle: int = 1) -> Blocks:
  """The blocks of a validated ``schedule``, each ``B`` one block if
  ``fuse``, else an ``I`` and then a ``W`` (module doc); with ``bundle > 1``
  each rank's messages over an offset leave ``bundle`` at a time
  (``_carriers``)."""
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
  carrier = _carriers(rows, sends, bundle)
  rank = [schedule.placement[a.stage] for a in actions]
  deps = [tuple(carrier[d] if carrier[d] >= 0 and rank[d] != rank[b] else d
                for d in inputs) for b, inputs in enumerate(deps)]
  sends = [0 if c >= 0 else o for o, c in zip(sends, carrier)]
  before, after = [-1] * len(actions), [[] for _ in actions]
  for b, inputs in enumerate(deps):
    for d in inputs:
      after[d].append(b)
  for row in rows:
    for b, c in zip(row, row[1:]):
      before[c] = b
      after[b].append(c)
  return Blocks(actions, rows, deps, [DEFAULT_COSTS[a.kind] for a in actions],
                 sends, before, after, carrier)


def _carriers(rows: list[list[int]], sends: list[int], bundle: int
              ) -> list[int]:
  """Each block's carrier (``Blocks.carrier``): a rank's sends over each
  offset, in its order, go in groups of ``bundle``, all held for the last
  of their group, which sends them with its own (a short last group too)."""
  carrier = [-1] * len(sends)
  for row in rows:
    for offset in {sends[b] for b in row} - {0}:
      group = [b for b in row if sends[b] == offset]
      for k in range(0, len(group), bundle):
        *held, last = group[k:k + bundle]
        for b in held:
          carrier[b] = last
  return carrier


class _Packing:
  """Blocks placed in ticks ``< t`` so far; ``place`` adds tick ``t``
  (``_Lookahead.trial`` scores a try of it finished by plain list
  scheduling)."""

  def __init__(self, blocks: Blocks):
    self.blocks = blocks
    self.pos = [0] * len(blocks.rows)     # each rank's next block
    self.tick = [-1] * len(blocks.actions)
    self.t = 0
    self.time = 0.0       # lock-step time so far
    self.messages = 0     # ticks x offsets with messages between ranks

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
  way). Both share one ``_Lookahead`` (their tries often meet)."""
  scores = (lambda k: _score(k, message_cost), lambda k: (k.time, k.messages))
  lookahead = _Lookahead(blocks)
  return min((_greedy(blocks, score, lookahead) for score in scores),
             key=lambda k: _score(k, message_cost))


def _greedy(blocks: Blocks, score, lookahead: _Lookahead) -> _Packing:
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
      trial, placed = lookahead.trial(packing, choice)
      budget -= placed
      if best_score is None or score(trial) < best_score:
        best, best_score = choice, score(trial)
    packing.place(best)
  return packing


class _Trial(NamedTuple):
  """What a try scores: ``_Packing.time`` and ``messages`` after it."""
  time: float
  messages: int


class _Lookahead:
  """The tries of ``_greedy``: a packing after ``place(choice)`` and a plain
  ``finish``, scored without building it.

  A plain finish puts each block left at ``t + depth``, its depth in the
  graph of the blocks left (0 without a predecessor left, else one more than
  its deepest one), so what it adds depends only on which blocks are left,
  i.e. on each rank's next block: computed once per such ``pos`` (the two
  packings of ``_pack`` try the same ones often), in one pass over the
  blocks in a fixed topological order.
  """

  def __init__(self, blocks: Blocks):
    n, self.blocks, self.memo = len(blocks.actions), blocks, {}
    self.preds = [((prev,) if prev >= 0 else ()) + deps
                  for prev, deps in zip(blocks.before, blocks.deps)]
    self.bits = [1 << o if o else 0 for o in blocks.sends]
    order = _topological(blocks)
    if order is None:   # validate() rules this out (layout() the holds')
      raise RuntimeError('Deadlock: the blocks wait for each other.')
    self.order, self.index = order, [0] * n
    for k, b in enumerate(order):
      self.index[b] = k

  def trial(self, packing: _Packing, choice: list[int]) -> tuple[_Trial, int]:
    """``packing`` after ``place(choice)`` and ``finish()`` (left as it
    was): its time and messages, and how many blocks ``finish`` placed."""
    blocks, cost, offsets, pos = packing.blocks, 0.0, set(), list(packing.pos)
    for r in choice:
      b = blocks.rows[r][pos[r]]
      pos[r] += 1
      cost = max(cost, blocks.cost[b])
      offsets.add(blocks.sends[b])
    key = tuple(pos)
    rest = self.memo.get(key)
    if rest is None:
      rest = self.memo[key] = self._rest(packing, choice, pos)
    time, messages, placed = rest
    return _Trial(packing.time + cost + time,
                  packing.messages + len(offsets - {0}) + messages), placed

  def _rest(self, packing: _Packing, choice: list[int], pos: list[int]
            ) -> tuple[float, int, int]:
    """What a plain finish adds after ``choice``: time, messages, blocks."""
    blocks, tick, preds, bits = (packing.blocks, packing.tick, self.preds,
                                 self.bits)
    left = [row[k] for row, k in zip(blocks.rows, pos) if k < len(row)]
    if not left:
      return 0.0, 0, 0
    for r in choice:   # placed, as place() would
      tick[blocks.rows[r][packing.pos[r]]] = packing.t
    n = len(tick)
    depth, top, mask = [-1] * n, [0.0] * n, [0] * n
    placed, cost = 0, blocks.cost
    for b in self.order[min(self.index[b] for b in left):]:
      if tick[b] >= 0:
        continue
      d = 0
      for q in preds[b]:
        if depth[q] >= d:
          d = depth[q] + 1
      depth[b] = d
      placed += 1
      if cost[b] > top[d]:
        top[d] = cost[b]
      mask[d] |= bits[b]
    for r in choice:
      tick[blocks.rows[r][packing.pos[r]]] = -1
    levels = max(depth) + 1
    return (sum(top[:levels]), sum(m.bit_count() for m in mask[:levels]),
            placed)


def _topological(blocks: Blocks) -> list[int] | None:
  """The blocks in an order that puts each after its predecessors (on its
  rank and the blocks it reads; Kahn's algorithm), ``None`` if they wait
  for each other in a cycle."""
  preds = [((prev,) if prev >= 0 else ()) + deps
           for prev, deps in zip(blocks.before, blocks.deps)]
  waiting = [len(q) for q in preds]
  order = [b for b in range(len(preds)) if not waiting[b]]
  for b in order:   # order grows while it is read
    for c in blocks.after[b]:
      waiting[c] -= 1
      if not waiting[c]:
        order.append(c)
  return order if len(order) == len(preds) else None


def layout(schedule: Schedule, message_cost: float,
           backward: str | None = None) -> _Packing:
  """The packed blocks of ``schedule`` with the least ``_score`` (lock-step
  time plus ``message_cost`` per tick with messages; module doc): each
  ``B`` fused or split into ``I`` and ``W`` (``backward``: ``'fused'``,
  ``'split'``, ``None`` for either), and each rank's messages over an offset
  sent one or ``BUNDLE`` at a time. On a tie the fused blocks win (no
  weight stash), then single messages."""
  has_b = any(a is not None and a.kind == 'B'
              for row in schedule.actions for a in row)
  fuses = {'fused': (True,), 'split': (False,)}.get(
      backward, (True, False) if has_b else (True,))
  candidates = []
  for fuse in fuses:
    candidates.append(_pack(_blocks(schedule, fuse=fuse), message_cost))
    if message_cost == 0:   # holding a message only ever delays
      continue
    held = _blocks(schedule, fuse=fuse, bundle=BUNDLE)
    if max(held.carrier, default=-1) >= 0 and _topological(held) is not None:
      candidates.append(_pack(held, message_cost))
  return min(candidates, key=lambda k: _score(k, message_cost)[0])
