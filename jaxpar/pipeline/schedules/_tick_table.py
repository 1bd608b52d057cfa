"""A ``Schedule`` laid out in time: the tick table the executor scans over.

A schedule says *what* each rank computes and in which order; its tick
table says *when* (a global tick per action) and *where the data lives*
(which buffer slot each action reads and writes). The executor
(``jaxpar.pipeline.executor``) runs one ``lax.scan`` step per tick and reads
row ``t`` of these arrays, so the whole schedule is int32 data, never Python
control flow.

**Every tick holds one action per rank, and every action costs about the
same**: a full backward ``B(s, i)`` runs as its two halves, ``I(s, i)`` (the
input cotangent) and then ``W(s, i)`` (the parameter cotangent, from what
``I`` kept) in the next tick, and its input cotangent is sent with ``W``, when
``B`` would have finished. Ranks run in lock-step (every tick ends with the
messages), so a tick lasts as long as its slowest rank::

  makespan(costs) = sum_t max_r costs[kind[t, r]]

With ``F``, ``I`` and ``W`` alike (``B = I + W = 2F``, ``simulate``'s default
costs) no rank waits inside a tick, and the lock-step time is the event-driven
time of ``Schedule.simulate``: a ``B`` still takes two units and still hands
its cotangent on when it ends. (Run as one block, a ``B`` beside an ``F`` on
the next rank would stretch every steady-state tick of 1F1B to ``B``.)

The table is built by greedy list scheduling (in each rank's schedule order;
``None`` entries are display padding and take no time): a rank runs its next
action at the first tick at which its inputs exist; a result produced at tick
``t`` (sent to another rank or kept locally) is usable from tick ``t + 1``. The
dependencies are ``dependency_graph``'s (``_simulate``): ``F(s, i)`` needs
``F(s-1, i)``; ``B(s, i)`` and ``I(s, i)`` need ``F(s, i)`` and the input
cotangent from ``B/I(s+1, i)``; ``W(s, i)`` needs ``I(s, i)``.

Buffers (per rank, slots reused through a free list, so the slot counts equal
the peak number of live entries):

* **stash**: written by ``F(s, i)``, read by ``I(s, i)`` and ``W(s, i)``,
  freed after ``W``;
* **weight stash**: what ``I(s, i)`` hands to ``W(s, i)`` (the cotangents at
  the parameter-consuming operations, and the input cotangent), written by
  ``I``, freed after ``W`` (one slot when ``W`` follows ``I``);
* **mailbox**: one slot per message received but not yet consumed. Messages
  are activations ``F(s, i) -> F(s+1, i)``, cotangents ``I/W(s, i) ->
  I, W(s-1, i)`` and, on the last stage, the loss cotangent
  ``F(S-1, i) -> I, W(S-1, i)`` (a local message).

A message from rank ``src`` to rank ``dst`` travels over the rank offset
``(dst - src) % p``; ``offsets`` lists the distinct ones (``0`` is a local
hand-off), so the executor issues one ``ppermute`` per nonzero offset per tick.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

from jaxpar.pipeline.schedules._action import Action
from jaxpar.pipeline.schedules._schedule import Schedule
from jaxpar.pipeline.schedules._simulate import (check_comm, check_costs,
                                                  dependency_graph)

IDLE, F, I, W = 0, 1, 3, 4
KIND_CODES = {'F': F, 'I': I, 'W': W}
KIND_NAMES = '.F?IW'


class TickTable(NamedTuple):
  """A schedule as the int32 tables the executor's ``lax.scan`` consumes.

  ``T`` is the number of ticks, ``p`` the number of ranks, ``K`` the number
  of distinct message offsets. Entries that do not apply are ``-1``.

  Attributes:
    schedule: the ``Schedule`` the table lays out.
    kind: int32 ``[T, p]``, the action of rank ``r`` at tick ``t``:
      ``0`` idle, ``1`` F, ``3`` I, ``4`` W (a schedule's ``B`` is an ``I``
      and the ``W`` after it).
    stage: int32 ``[T, p]``, its logical stage.
    microbatch: int32 ``[T, p]``, its microbatch.
    local_stage: int32 ``[T, p]``, index of ``stage`` among the rank's own
      stages (ascending stage order), i.e. into the rank's ``[v, ...]`` slice
      of the stage parameters.
    read_slot: int32 ``[T, p]``, the mailbox slot holding the action's input:
      the activation for ``F`` (``-1`` on stage 0, which reads the batch), the
      output cotangent for ``I`` and ``W``.
    stash_slot: int32 ``[T, p]``, the stash slot ``F`` writes and ``I``/``W``
      read.
    weight_slot: int32 ``[T, p]``, the weight-stash slot ``I`` writes and
      ``W`` reads.
    recv_slot: int32 ``[T, p, K]``, the mailbox slot into which rank ``r``
      stores, at the end of tick ``t``, the message from rank
      ``(r - offsets[k]) % p``.
    offsets: the ``K`` distinct offsets ``(dst - src) % p`` of all messages,
      ascending.
    num_stash_slots: stash slots per rank, ``max(peak_stash)``.
    num_weight_slots: weight-stash slots per rank.
    num_mailbox_slots: mailbox slots per rank, ``max(peak_mailbox)``.
    peak_stash: int32 ``[p]``, most stash entries live at once on each rank.
    peak_mailbox: int32 ``[p]``, most messages in flight (received, not yet
      consumed) at once on each rank.
  """
  schedule: Schedule
  kind: np.ndarray
  stage: np.ndarray
  microbatch: np.ndarray
  local_stage: np.ndarray
  read_slot: np.ndarray
  stash_slot: np.ndarray
  weight_slot: np.ndarray
  recv_slot: np.ndarray
  offsets: tuple[int, ...]
  num_stash_slots: int
  num_weight_slots: int
  num_mailbox_slots: int
  peak_stash: np.ndarray
  peak_mailbox: np.ndarray

  @property
  def num_ticks(self) -> int:
    """``T``, the length of the scan."""
    return self.kind.shape[0]

  @property
  def training(self) -> bool:
    """Whether the schedule has backward actions (else it is forward-only)."""
    return bool((self.kind > F).any())

  def makespan(self, costs: Mapping[str, float] | None = None,
               comm: float = 0.0) -> float:
    """Lock-step time of the table: ``sum_t max_r costs[kind[t, r]]``.

    Plus ``comm`` for each tick that sends a message between ranks (the
    executor skips the ``ppermute`` of the others).

    Args:
      costs: time per action kind, merged into ``Schedule.simulate``'s
        defaults ``{'F': 1, 'B': 2, 'I': 1, 'W': 1}`` (``B`` runs as ``I`` and
        ``W``, so its own cost is not used).
      comm: time of one tick's messages, ``>= 0``.

    Returns:
      The time the executor takes when every rank waits for the slowest one
      at the end of each tick, to compare with
      ``schedule.simulate(costs).makespan``: equal for ``F = I = W`` and
      ``comm = 0``; with kinds of unequal cost a tick waits for its slowest
      kind, so the lock-step time can be longer.

    Example:
      >>> import jaxpar
      >>> from jaxpar.pipeline import tick_table
      >>> s = jaxpar.pipeline.one_f_one_b(4, 8)
      >>> tick_table(s).makespan(), s.simulate().makespan   # (m + p - 1)(F + B)
      (33.0, 33.0)
    """
    cost = check_costs(costs)
    table = np.array([0.0, cost['F'], 0.0, cost['I'], cost['W']])
    remote = [k for k, offset in enumerate(self.offsets) if offset]
    sends = (self.recv_slot[:, :, remote] >= 0).any(axis=(1, 2))
    return float(table[self.kind].max(axis=1).sum()
                 + check_comm(comm) * sends.sum())

  def render(self) -> str:
    """The table as text, a row per rank and a letter per tick.

    Example:
      >>> import jaxpar
      >>> from jaxpar.pipeline import tick_table
      >>> print(tick_table(jaxpar.pipeline.one_f_one_b(2, 3)).render())
      rank 0: FF..IWFIW.IW
      rank 1: .FIWFIWFIW..
    """
    return '\n'.join(f'rank {r}: ' + ''.join(KIND_NAMES[k] for k in row)
                     for r, row in enumerate(self.kind.T))


def local_stages(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
  """Each rank's logical stages, ascending: ``result[r][j]`` is stage ``k``.

  Every rank must hold the same number ``v = num_stages // num_ranks`` of
  stages so that stage parameters can be laid out as ``[p, v, ...]``.

  Example:
    >>> import jaxpar
    >>> from jaxpar.pipeline import local_stages
    >>> local_stages(jaxpar.pipeline.interleaved_one_f_one_b(2, 2, 2))
    ((0, 2), (1, 3))
  """
  per_rank = tuple(
      tuple(k for k, r in enumerate(schedule.placement) if r == rank)
      for rank in range(schedule.num_ranks))
  counts = [len(s) for s in per_rank]
  if len(set(counts)) != 1:
    raise ValueError(
        f'Schedule {schedule.name!r}: placement {schedule.placement} gives '
        f'the ranks {counts} stages each; every rank must hold the same number '
        f'of stages (num_stages a multiple of num_ranks={schedule.num_ranks}).')
  return per_rank


def _allocate(intervals: Iterable[tuple[int, int, tuple]]) -> tuple[dict, int]:
  """Slots for ``(write_time, last_read_time, key)`` with a free list.

  A slot last read at time ``r`` can be written again at any time ``>= r``
  (times are half-ticks: actions read at ``2t``, messages land at
  ``2t + 1``), so intervals that do not overlap share a slot. Returns
  ``{key: slot}`` and the peak slot count.
  """
  free: list[int] = []
  busy: list[tuple[int, int]] = []  # (last_read_time, slot)
  slots, size = {}, 0
  for write, read, key in sorted(intervals, key=lambda iv: iv[:2]):
    while busy and busy[0][0] <= write:
      heapq.heappush(free, heapq.heappop(busy)[1])
    if free:
      slot = heapq.heappop(free)
    else:
      slot, size = size, size + 1
    slots[key] = slot
    heapq.heappush(busy, (read, slot))
  return slots, size


def _ticks(schedule: Schedule) -> tuple[dict[Action, int], dict, int]:
  """Greedy list scheduling with every ``B`` split into ``I`` then ``W``.

  Returns ``({action: tick}`` over ``F``/``I``/``W`` actions, ``{(stage,
  microbatch): tick}`` at which the input cotangent is sent, tick count).
  """
  graph = dependency_graph(schedule)
  rows = []  # per rank: (action run, what it waits for, what it completes)
  for acts in schedule.actions:
    row = []
    for a in acts:
      if a is None:
        continue
      if a.kind == 'B':
        i, w = a._replace(kind='I'), a._replace(kind='W')
        row += [(i, graph[a], i), (w, (i,), a)]
      else:
        row.append((a, graph[a], a))
    rows.append(row)
  tick: dict[Action, int] = {}
  done: dict[Action, int] = {}  # schedule action (or split I) -> its tick
  pos = [0] * len(rows)
  t = 0
  while any(pos[r] < len(row) for r, row in enumerate(rows)):
    progressed = False
    for r, row in enumerate(rows):
      if pos[r] < len(row):
        a, deps, completes = row[pos[r]]
        if all(done.get(d, t) < t for d in deps):
          tick[a] = t
          done[completes] = t
          pos[r] += 1
          progressed = True
    if not progressed:  # validate() rules this out
      raise RuntimeError(f'Schedule {schedule.name!r} deadlocks at tick {t}.')
    t += 1
  sent = {(a.stage, a.microbatch): t for a, t in done.items()
          if a.kind in 'BI'}
  return tick, sent, t


def tick_table(schedule: Schedule, *, forward_only: bool = False) -> TickTable:
  """The tick table of ``schedule``: what the pipeline executor runs.

  Args:
    schedule: a ``Schedule``; it is validated first (``Schedule.validate``).
    forward_only: keep only the ``F`` actions (inference with
      ``pipeline_apply``); their order is the schedule's.

  Returns:
    A ``TickTable``: int32 ``[ticks, ranks]`` tables of actions and
    buffer slots plus the buffer sizes. The stash and mailbox sizes follow
    the schedule: ``O(p)`` for 1F1B, ``O(m)`` for GPipe. Its lock-step time
    ``makespan()`` equals ``schedule.simulate().makespan`` (default costs).

  Raises:
    TypeError: if ``schedule`` is not a ``Schedule``.
    ScheduleError: (a ``ValueError``) if the schedule is invalid.
    ValueError: if the ranks hold different numbers of stages.

  Example:
    >>> import jaxpar
    >>> table = jaxpar.pipeline.tick_table(jaxpar.pipeline.one_f_one_b(4, 8))
    >>> table.kind.shape, table.num_stash_slots, table.offsets
    ((33, 4), 4, (0, 1, 3))
  """
  if not isinstance(schedule, Schedule):
    raise TypeError(f'tick_table expects a jaxpar.pipeline.Schedule, got '
                    f'{type(schedule).__name__}.')
  schedule.validate()
  training = not forward_only
  if forward_only:
    schedule = dataclasses.replace(schedule, actions=tuple(
        tuple(a for a in acts if a is not None and a.kind == 'F')
        for acts in schedule.actions))
  stages_of = local_stages(schedule)
  p, n = schedule.num_ranks, schedule.num_stages
  tick, sent, num_ticks = _ticks(schedule)
  at = lambda kind, s, i: tick[Action(s, kind, i)]

  # Buffer lifetimes (write time, last read time, key) in half-ticks: an
  # action reads at 2t, its messages land at 2t + 1.
  stash_iv: list[list[tuple]] = [[] for _ in range(p)]
  weight_iv: list[list[tuple]] = [[] for _ in range(p)]
  mail_iv: list[list[tuple]] = [[] for _ in range(p)]
  messages = []  # (src, dst, send tick, key)
  for a, tk in tick.items():
    s, i, src = a.stage, a.microbatch, schedule.placement[a.stage]
    if a.kind == 'F':
      if training:
        stash_iv[src].append((2 * tk, 2 * at('W', s, i), (s, i)))
      if s < n - 1:
        dst = schedule.placement[s + 1]
        messages.append((src, dst, tk, ('F', s, i)))
        mail_iv[dst].append((2 * tk + 1, 2 * at('F', s + 1, i), ('F', s, i)))
      elif training:  # the loss cotangent, kept locally for I and W
        messages.append((src, src, tk, ('F', s, i)))
        mail_iv[src].append((2 * tk + 1, 2 * at('W', s, i), ('F', s, i)))
    elif a.kind == 'I':
      weight_iv[src].append((2 * tk, 2 * at('W', s, i), (s, i)))
      if s > 0:
        dst = schedule.placement[s - 1]
        messages.append((src, dst, sent[s, i], ('I', s, i)))
        mail_iv[dst].append((2 * sent[s, i] + 1, 2 * at('W', s - 1, i),
                             ('I', s, i)))
  slots = {}
  peaks = np.zeros((3, p), np.int32)
  for k, intervals in enumerate((stash_iv, weight_iv, mail_iv)):
    for r in range(p):
      found, peaks[k, r] = _allocate(intervals[r])
      slots.update({(k,) + key: slot for key, slot in found.items()})
  offsets = tuple(sorted({(dst - src) % p for src, dst, *_ in messages}))

  shape = (num_ticks, p)
  kind = np.zeros(shape, np.int32)
  stage, microbatch, local_stage, read_slot, stash_slot, weight_slot = (
      np.full(shape, -1, np.int32) for _ in range(6))
  recv_slot = np.full(shape + (len(offsets),), -1, np.int32)
  for a, tk in tick.items():
    s, i, r = a.stage, a.microbatch, schedule.placement[a.stage]
    kind[tk, r] = KIND_CODES[a.kind]
    stage[tk, r], microbatch[tk, r] = s, i
    local_stage[tk, r] = stages_of[r].index(s)
    if training:
      stash_slot[tk, r] = slots[0, s, i]
    if a.kind == 'F':
      if s > 0:
        read_slot[tk, r] = slots[2, 'F', s - 1, i]
    else:
      weight_slot[tk, r] = slots[1, s, i]
      read_slot[tk, r] = slots[(2, 'F', s, i) if s == n - 1 else
                               (2, 'I', s + 1, i)]
  for src, dst, tk, key in messages:
    recv_slot[tk, dst, offsets.index((dst - src) % p)] = slots[(2,) + key]
  return TickTable(
      schedule=schedule, kind=kind, stage=stage, microbatch=microbatch,
      local_stage=local_stage, read_slot=read_slot, stash_slot=stash_slot,
      weight_slot=weight_slot, recv_slot=recv_slot, offsets=offsets,
      num_stash_slots=int(peaks[0].max(initial=0)),
      num_weight_slots=int(peaks[1].max(initial=0)),
      num_mailbox_slots=int(peaks[2].max(initial=0)),
      peak_stash=peaks[0], peak_mailbox=peaks[2])

