"""Lowering a ``Schedule`` to the tick table the executor scans over.

A schedule says *what* each rank computes and in which order; the lowered
table says *when* (a global tick per action) and *where the data lives*
(which buffer slot each action reads and writes). The executor
(``jaxpar.pipeline.executor``) runs one ``lax.scan`` step per tick and reads
row ``t`` of these arrays, so the whole schedule is int32 data, never Python
control flow.

Timing model (unit ticks, greedy list scheduling):

* every action takes one tick and a rank runs at most one action per tick, in
  its schedule order (``None`` entries are display padding and take no time,
  as in ``Schedule.simulate``);
* an action starts at the first tick at which all its inputs exist: a result
  produced at tick ``t`` (sent to another rank or kept locally) is usable from
  tick ``t + 1``;
* dependencies: ``F(s, i)`` needs ``F(s-1, i)``; ``B(s, i)`` and ``I(s, i)``
  need ``F(s, i)`` and the input cotangent from ``B/I(s+1, i)`` (the last
  stage's needs only its own ``F``, which also computes the loss);
  ``W(s, i)`` needs ``I(s, i)``.

Buffers (per rank, slots reused through a free list, so the slot counts equal
the peak number of live entries):

* **stash**: written by ``F(s, i)``, read by ``B(s, i)`` or by ``I(s, i)``
  and ``W(s, i)``, freed after the last of them;
* **mailbox**: one slot per message received but not yet consumed. Messages
  are activations ``F(s, i) -> F(s+1, i)``, cotangents
  ``B/I(s, i) -> B/I/W(s-1, i)`` and, on the last stage, the loss cotangent
  ``F(S-1, i) -> B/I/W(S-1, i)`` (a local message). A cotangent read by ``I``
  stays until ``W``, which needs it again.

A message from rank ``src`` to rank ``dst`` travels over the rank offset
``(dst - src) % p``; ``offsets`` lists the distinct ones (``0`` is a local
hand-off), so the executor issues one ``ppermute`` per nonzero offset per tick.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from jaxpar.pipeline.schedule import Action, Schedule
from jaxpar.pipeline.simulate import dependency_graph

IDLE, F, B, I, W = 0, 1, 2, 3, 4
KIND_CODES = {'F': F, 'B': B, 'I': I, 'W': W}


class LoweredSchedule(NamedTuple):
  """A schedule as the int32 tables the executor's ``lax.scan`` consumes.

  ``T`` is the number of ticks, ``p`` the number of ranks, ``K`` the number
  of distinct message offsets. Entries that do not apply are ``-1``.

  Attributes:
    schedule: the ``Schedule`` that was lowered.
    kind: int32 ``[T, p]``, the action of rank ``r`` at tick ``t``:
      ``0`` idle, ``1`` F, ``2`` B, ``3`` I, ``4`` W.
    stage: int32 ``[T, p]``, its logical stage.
    microbatch: int32 ``[T, p]``, its microbatch.
    local_stage: int32 ``[T, p]``, index of ``stage`` among the rank's own
      stages (ascending stage order), i.e. into the rank's ``[v, ...]`` slice
      of the stage parameters.
    read_slot: int32 ``[T, p]``, the mailbox slot holding the action's input:
      the activation for ``F`` (``-1`` on stage 0, which reads the batch), the
      output cotangent for ``B``, ``I`` and ``W``.
    stash_slot: int32 ``[T, p]``, the stash slot ``F`` writes and
      ``B``/``I``/``W`` read.
    recv_slot: int32 ``[T, p, K]``, the mailbox slot into which rank ``r``
      stores, at the end of tick ``t``, the message from rank
      ``(r - offsets[k]) % p``.
    offsets: the ``K`` distinct offsets ``(dst - src) % p`` of all messages,
      ascending.
    num_stash_slots: stash slots per rank, ``max(peak_stash)``.
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
  recv_slot: np.ndarray
  offsets: tuple[int, ...]
  num_stash_slots: int
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


def local_stages(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
  """The logical stages of each rank, ascending: ``result[r][j]`` is stage ``k``.

  Every rank must hold the same number ``v = num_stages // num_ranks`` of
  stages so that stage parameters can be laid out as ``[p, v, ...]``.

  Example:
    >>> local_stages(jaxpar.pipeline.interleaved_1f1b(2, 2, 2))
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
  """Slots for ``(write_tick, last_read_tick, key)`` with a free list.

  A slot read at tick ``t`` can be written again at the end of ``t`` (the
  executor reads before it writes), so intervals ``(w, r]`` that do not
  overlap share a slot. Returns ``{key: slot}`` and the peak slot count.
  """
  free: list[int] = []
  busy: list[tuple[int, int]] = []  # (last_read_tick, slot)
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


def lower(schedule: Schedule, *, forward_only: bool = False) -> LoweredSchedule:
  """Lowers ``schedule`` to the tick table the pipeline executor runs.

  Args:
    schedule: a ``Schedule``; it is validated first (``Schedule.validate``).
    forward_only: keep only the ``F`` actions (inference with
      ``pipeline_apply``); their order is the schedule's.

  Returns:
    A ``LoweredSchedule``: int32 ``[ticks, ranks]`` tables of actions and
    buffer slots plus the buffer sizes. The stash and mailbox sizes follow
    the schedule: ``O(p)`` for 1F1B, ``O(m)`` for GPipe. With every action
    one tick, the number of ticks is ``schedule.simulate(costs={'F': 1,
    'B': 1, 'I': 1, 'W': 1}).makespan``.

  Raises:
    TypeError: if ``schedule`` is not a ``Schedule``.
    ScheduleError: (a ``ValueError``) if the schedule is invalid.
    ValueError: if the ranks hold different numbers of stages.

  Example:
    >>> low = jaxpar.pipeline.lower(jaxpar.pipeline.one_f_one_b(4, 8))
    >>> low.kind.shape, low.num_stash_slots, low.offsets
    ((22, 4), 4, (0, 1, 3))
  """
  if not isinstance(schedule, Schedule):
    raise TypeError(f'lower expects a jaxpar.pipeline.Schedule, got '
                    f'{type(schedule).__name__}.')
  schedule.validate()
  training = not forward_only
  if forward_only:
    schedule = dataclasses.replace(schedule, actions=tuple(
        tuple(a for a in acts if a is not None and a.kind == 'F')
        for acts in schedule.actions))
  stages_of = local_stages(schedule)
  p, n, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
  bwd = {(a.stage, a.microbatch): 'I' if a.kind == 'I' else 'B'
         for acts in schedule.actions for a in acts
         if a is not None and a.kind in 'BI'}

  # Greedy list scheduling: tick of each action (the executor's dependency
  # rules are the simulator's).
  graph = dependency_graph(schedule)
  tick: dict[tuple[str, int, int], int] = {}
  placed: list[list[tuple[int, Action]]] = [[] for _ in range(p)]
  pos = [0] * p
  t = 0
  order = [[a for a in acts if a is not None] for acts in schedule.actions]
  while any(pos[r] < len(order[r]) for r in range(p)):
    progressed = False
    for r in range(p):
      if pos[r] < len(order[r]):
        a = order[r][pos[r]]
        if all(tick.get((d.kind, d.stage, d.microbatch), t) < t
               for d in graph[a]):
          tick[a.kind, a.stage, a.microbatch] = t
          placed[r].append((t, a))
          pos[r] += 1
          progressed = True
    if not progressed:  # validate() rules this out
      raise RuntimeError(f'Schedule {schedule.name!r} deadlocks at tick {t}.')
    t += 1
  num_ticks = t

  # Buffer lifetimes: (write tick, last read tick, key) per rank.
  def last_use(kind_key: str, s: int, i: int) -> int:
    """Tick of the last action reading (s, i)'s backward inputs."""
    return tick['W', s, i] if kind_key == 'I' else tick['B', s, i]

  stash_iv: list[list[tuple]] = [[] for _ in range(p)]
  mail_iv: list[list[tuple]] = [[] for _ in range(p)]
  messages = []  # (src, dst, send tick, last read tick, key)
  for (k, s, i), tk in tick.items():
    src = schedule.placement[s]
    if k == 'F':
      if training:
        stash_iv[src].append((tk, last_use(bwd[s, i], s, i), (s, i)))
      if s < n - 1:
        dst = schedule.placement[s + 1]
        messages.append((src, dst, tk, tick['F', s + 1, i], ('F', s, i)))
      elif training:  # loss cotangent, kept locally for the backward
        messages.append((src, src, tk, last_use(bwd[s, i], s, i), ('F', s, i)))
    elif k in 'BI' and s > 0:
      dst = schedule.placement[s - 1]
      messages.append((src, dst, tk, last_use(bwd[s - 1, i], s - 1, i),
                       (k, s, i)))
  for src, dst, tk, read, key in messages:
    mail_iv[dst].append((tk, read, key))
  stash_slots, mail_slots = {}, {}
  peak_stash = np.zeros(p, np.int32)
  peak_mail = np.zeros(p, np.int32)
  for r in range(p):
    slots, peak_stash[r] = _allocate(stash_iv[r])
    stash_slots.update(slots)
    slots, peak_mail[r] = _allocate(mail_iv[r])
    mail_slots.update(slots)
  offsets = tuple(sorted({(dst - src) % p for src, dst, *_ in messages}))

  shape = (num_ticks, p)
  kind = np.zeros(shape, np.int32)
  stage, microbatch, local_stage, read_slot, stash_slot = (
      np.full(shape, -1, np.int32) for _ in range(5))
  recv_slot = np.full(shape + (len(offsets),), -1, np.int32)
  for r in range(p):
    for tk, a in placed[r]:
      s, i = a.stage, a.microbatch
      kind[tk, r] = KIND_CODES[a.kind]
      stage[tk, r], microbatch[tk, r] = s, i
      local_stage[tk, r] = stages_of[r].index(s)
      if training:
        stash_slot[tk, r] = stash_slots[s, i]
      if a.kind == 'F':
        if s > 0:
          read_slot[tk, r] = mail_slots['F', s - 1, i]
      elif s == n - 1:
        read_slot[tk, r] = mail_slots['F', s, i]
      else:
        read_slot[tk, r] = mail_slots[bwd[s + 1, i], s + 1, i]
  for src, dst, tk, _, key in messages:
    recv_slot[tk, dst, offsets.index((dst - src) % p)] = mail_slots[key]
  return LoweredSchedule(
      schedule=schedule, kind=kind, stage=stage, microbatch=microbatch,
      local_stage=local_stage, read_slot=read_slot, stash_slot=stash_slot,
      recv_slot=recv_slot, offsets=offsets,
      num_stash_slots=int(peak_stash.max(initial=0)),
      num_mailbox_slots=int(peak_mail.max(initial=0)),
      peak_stash=peak_stash, peak_mailbox=peak_mail)
