"""A ``Schedule`` laid out in time: the tick table the executor scans over.

A schedule says *what* each rank computes and in which order; its tick
table says *when* (a global tick per block) and *where the data lives*
(which buffer slot each block reads and writes). The executor
(``jaxpar.pipeline.executor``) runs one ``lax.scan`` step per tick and reads
row ``t`` of these arrays, so the whole schedule is int32 data, never Python
control flow.

**Blocks.** A tick holds at most one block per rank:

* ``F``: a forward;
* ``B``: a schedule's full backward ``B(s, i)`` as one VJP (the input and
  the parameter cotangent), keeping nothing for later;
* ``I`` and ``W``: the two halves of a backward that zero-bubble and V
  schedules run apart: ``I`` the input cotangent (keeping for ``W`` the
  cotangents at the parameter-consuming operations), ``W`` the parameter
  cotangent.

A block's message (an activation, an input cotangent, or on the last stage
the loss cotangent, a local hand-off) leaves at the end of its tick and is
usable from the next. Ranks run in lock-step (every tick with messages ends
with the exchange), so a tick lasts as long as its slowest block::

  makespan(costs) = sum_t max_r costs[kind[t, r]]      F = I = W = 1, B = 2

**Like with like.** The blocks are placed by list scheduling (each rank in
its schedule order; a block at the first tick at which its inputs exist)
with a one-step lookahead: at each tick it also tries holding back the ready
``B``'s while other ranks run one-unit blocks (so that ``B``'s share ticks
instead of stretching a tick of ``F``'s to two units) and, in the first
``3 p`` ticks, holding back one rank (so that its messages later leave in
the same tick as another rank's and share its ``ppermute``); it finishes
each try by plain list scheduling and keeps the one with the least
lock-step time plus ``message_cost`` (``tick_table``'s keyword, in ``F``'s)
per tick with messages. Interleaved 1F1B,
p = 2, m = 4, laid out with fused ``B``'s (plain list scheduling pairs ``B``
with ``F``: 32)::

  rank 0: FFF.FFBFBFBFB.BBBB        lock-step 27 = simulate's
  rank 1: .FFFBFBFBFBFBFBBB.        (one tick pairs B with F)

and ZB-V, p = 2, m = 4, where rank 0 holds back a tick so that each of its
sends travels with one of rank 1's (10 ticks with messages instead of 14)::

  rank 0: FFFFI.WFIWFIWFIWIWFIWIWIW
  rank 1: .FFFFIWFIWFIWFIWFIWIIIWWW

ZB-H1, p = 2, m = 12, takes one tick more than with messages free (38, not
37) for 10 fewer ticks with messages (13, not 23): 1F1B's layout.

**Fused or split.** A schedule with ``B`` actions is laid out with each
``B`` as one ``B`` block and with each ``B`` as an ``I`` and then a ``W``;
the table with the lower score is kept (on a tie the fused one: it needs no
weight stash). The split ``I`` sends its cotangent when it ends, a tick
before ``B`` would, so a split table's lock-step time never exceeds
``Schedule.simulate``'s (costs ``F = 1, B = 2``: the schedule as written);
a fused one wins where it needs fewer ticks with messages. GPipe, 1F1B and
DualPipeV mostly run split, interleaved 1F1B at p = 4 fused. In 1F1B's
steady state rank ``r`` runs a backward while its neighbours run a forward
(their order and the one-tick message delay fix that), so a fused ``B``
would stretch every tick to two units (p = 4, m = 8: 39 against 33);
split, the early cotangent even beats the schedule as written (30), and
GPipe's drain shortens by a tick::

  GPipe p=2 m=3, fused:  rank 0: FFF..BBB       lock-step 12 = simulate's
                         rank 1: .FFFBBB.
  GPipe p=2 m=3, split:  rank 0: FFF..IWIWIW    lock-step 11, the table
                         rank 1: .FFFIWIWIW.
  1F1B p=2 m=3, split:   rank 0: F.FIWFIW.IW    lock-step 11, simulate's 12
                         rank 1: .FIWFIWFIW.

On two pinned CPU processes (the ``real_parallel`` bench's model and sizes,
GPipe alone against 1F1B) GPipe split ran at 0.98-1.00x 1F1B's speed, fused
with held messages at 0.91-0.92x (docs/benchmarks.md, "GPipe split").

The lookahead is bounded (``_LOOKAHEAD`` blocks placed by its tries per
table): past it, each tick runs every ready block.

**Held messages.** A message may also wait on its rank and leave with the
rank's next message over the same offset, both in one ``ppermute`` (a
message costs a wake-up of the other process, whatever its size). The table
tries each rank's sends in pairs (``_tick_packing.BUNDLE``: every other
message held until the next one) and keeps that layout when its lock-step
time plus ``message_cost`` per tick with messages is lower. At the default
``message_cost`` only forward-only tables whose forwards are GPipe's win
(GPipe, 1F1B, ZB-H1; p = 2 from m = 10, and GPipe's training table from
m = 14): a forward phase sends only forwards and a backward phase only
backwards, so no two ranks' sends share a tick. Where a message costs a
forward (``message_cost=1``), GPipe, p = 2, m = 12 sends in 12 ticks
instead of 24 for three more ticks (lock-step 41, not 38)::

  rank 0: FFFFFFFFFFFF.....IWIWIWIWIWIWIWIWIWIWIWIW     F0 held, F1 sends both
  rank 1: ..FFFFFFFFFFFFIWIWIWIWIWIWIWIWIWIWIWIW...     I0 held, I1 sends both

Buffers (per rank, slots reused through a free list, so the slot counts equal
the peak number of live entries):

* **stash**: written by ``F(s, i)``, read by its ``B`` or its ``I`` and
  ``W``, freed after the last of them;
* **weight stash**: what ``I(s, i)`` hands to ``W(s, i)``, freed after
  ``W`` (no slot for a ``B``);
* **mailbox**: one slot per message received but not yet consumed. Messages
  are activations ``F(s, i) -> F(s+1, i)``, input cotangents ``B/I(s, i) ->
  B, or I and W, (s-1, i)`` and, on the last stage, the loss cotangent
  ``F(S-1, i) -> B, or I and W, (S-1, i)`` (a local message).

* **hold**: one slot per message held back, from the end of its block's
  tick until it leaves (none in a table that holds nothing).

A message from rank ``src`` to rank ``dst`` travels over the rank offset
``(dst - src) % p``; ``offsets`` lists the distinct ones (``0`` is a local
hand-off). A rank sends at most one message per tick (its block's output,
with the held ones over the same offset), so the executor issues one
``ppermute`` per nonzero offset that carries a message in the tick: the
messages travelling the same way in a tick share it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

from jaxpar.pipeline.schedules._action import Action
from jaxpar.pipeline.schedules._schedule import Schedule
from jaxpar.pipeline.schedules._tick_packing import Blocks, layout
from jaxpar.pipeline.schedules._simulate import check_comm, check_costs

IDLE, F, B, I, W = 0, 1, 2, 3, 4
KIND_CODES = {'F': F, 'B': B, 'I': I, 'W': W}
KIND_NAMES = '.FBIW'
# What a tick with messages costs the packing, in forwards (``F = 1``): on 2
# CPU processes over gloo, one compute thread each, one message took
# 0.11-0.26 F (0.25-1.03 ms against a 4-layer stage's F of 1.9-4.1 ms;
# ``bench --only real_parallel``'s ``one message`` rows, docs/benchmarks.md).
MESSAGE_COST = 0.25
# ``tick_table``'s ``backward``: how a schedule's ``B`` runs (None: the
# better packing of the two).
BACKWARDS = (None, 'fused', 'split')


class TickTable(NamedTuple):
  """A schedule as the int32 tables the executor's ``lax.scan`` consumes.

  ``T`` is the number of ticks, ``p`` the number of ranks, ``K`` the number
  of distinct message offsets. Entries that do not apply are ``-1``.

  Attributes:
    schedule: the ``Schedule`` the table lays out.
    kind: int32 ``[T, p]``, the block of rank ``r`` at tick ``t``:
      ``0`` idle, ``1`` F, ``2`` B, ``3`` I, ``4`` W (``KIND_CODES``). A
      schedule's ``B`` is one ``B`` block, or an ``I`` and a later ``W``
      when the table is split (module doc).
    stage: int32 ``[T, p]``, its logical stage.
    microbatch: int32 ``[T, p]``, its microbatch.
    local_stage: int32 ``[T, p]``, index of ``stage`` among the rank's own
      stages (ascending stage order), i.e. into the rank's ``[v, ...]`` slice
      of the stage parameters.
    read_slot: int32 ``[T, p]``, the mailbox slot holding the block's input:
      the activation for ``F`` (``-1`` on stage 0, which reads the batch), the
      output cotangent for ``B``, ``I`` and ``W``.
    stash_slot: int32 ``[T, p]``, the stash slot ``F`` writes and ``B``,
      ``I`` and ``W`` read.
    weight_slot: int32 ``[T, p]``, the weight-stash slot ``I`` writes and
      ``W`` reads (``-1`` for ``F`` and ``B``).
    recv_slot: int32 ``[T, p, K]``, the mailbox slot into which rank ``r``
      stores, at the end of tick ``t``, the message from rank
      ``(r - offsets[k]) % p`` (the output of that rank's block at tick
      ``t``).
    hold_slot: int32 ``[T, p]``, the hold slot in which rank ``r`` keeps
      the output of its block at tick ``t`` instead of sending it (a held
      message, module doc).
    recv_held: int32 ``[T, p, K, H]``, the mailbox slot into which rank
      ``r`` stores, at the end of tick ``t``, what rank ``(r - offsets[k])
      % p`` held in its hold slot ``h`` (sent with that rank's message of
      tick ``t`` over offset ``k``).
    offsets: the ``K`` distinct offsets ``(dst - src) % p`` of all messages,
      ascending.
    num_stash_slots: stash slots per rank, ``max(peak_stash)``.
    num_weight_slots: weight-stash slots per rank.
    num_mailbox_slots: mailbox slots per rank, ``max(peak_mailbox)``.
    num_hold_slots: ``H``, hold slots per rank (``0``: no message is held).
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
  hold_slot: np.ndarray
  recv_held: np.ndarray
  offsets: tuple[int, ...]
  num_stash_slots: int
  num_weight_slots: int
  num_mailbox_slots: int
  num_hold_slots: int
  peak_stash: np.ndarray
  peak_mailbox: np.ndarray

  @property
  def num_ticks(self) -> int:
    """``T``, the length of the scan."""
    return self.kind.shape[0]

  @property
  def training(self) -> bool:
    """Whether the schedule has backward blocks (else it is forward-only)."""
    return bool((self.kind > F).any())

  @property
  def sends(self) -> np.ndarray:
    """bool ``[T, K]``: whether a message (or a bundle of them with held
    ones) travels over offset ``k`` in tick ``t``; ``False`` for ``0``, a
    local hand-off.

    Example (GPipe, p = 2, m = 8: its 16 messages leave in pairs where a
    message costs a forward):
      >>> import jaxpar
      >>> table = jaxpar.pipeline.tick_table(jaxpar.pipeline.gpipe(2, 8),
      ...                                    message_cost=1)
      >>> table.offsets, table.sends.shape, int(table.sends.sum())
      ((0, 1), (29, 2), 8)
      >>> table.num_hold_slots, table.message_ticks
      (1, 8)
    """
    sends = ((self.recv_slot >= 0) | (self.recv_held >= 0).any(-1)).any(1)
    return sends & (np.array(self.offsets) != 0)

  @property
  def message_ticks(self) -> int:
    """The ``ppermute``s of a step: per tick, the offsets between ranks that
    carry a message (the executor skips the others); held messages travel
    in their carrier's."""
    return int(self.sends.sum())

  def makespan(self, costs: Mapping[str, float] | None = None,
               comm: float = 0.0) -> float:
    """Lock-step time of the table: ``sum_t max_r costs[kind[t, r]]``.

    Plus ``comm`` for each tick that sends a message between ranks (the
    executor skips the ``ppermute`` of the others).

    Args:
      costs: time per block kind, merged into ``Schedule.simulate``'s
        defaults ``{'F': 1, 'B': 2, 'I': 1, 'W': 1}`` (without a ``'B'``
        entry, ``B = I + W``).
      comm: time of one tick's messages, ``>= 0``.

    Returns:
      The time the executor takes when every rank waits for the slowest one
      at the end of each tick, to compare with
      ``schedule.simulate(costs).makespan`` (the schedule's event-driven time,
      where nothing waits for a tick to end): never longer with the default
      costs and ``comm = 0`` for a table built with ``message_cost=0``
      (module doc; the default may trade a tick for fewer ticks with
      messages); with kinds of unequal cost a tick waits for its slowest
      block.

    Example:
      >>> import jaxpar
      >>> from jaxpar.pipeline import tick_table
      >>> s = jaxpar.pipeline.gpipe(4, 8)
      >>> s.simulate().makespan   # (m + p - 1)(F + B)
      33.0
      >>> tick_table(s).makespan()   # each I sends a tick early
      30.0
    """
    cost = check_costs(costs)
    table = np.array([0.0] + [cost[k] for k in KIND_NAMES[1:]])
    return float(table[self.kind].max(axis=1).sum()
                 + check_comm(comm) * self.sends.any(1).sum())

  def render(self) -> str:
    """The table as text, a row per rank and a letter per tick.

    Example:
      >>> import jaxpar
      >>> from jaxpar.pipeline import tick_table
      >>> print(tick_table(jaxpar.pipeline.gpipe(2, 3)).render())
      rank 0: FFF..IWIWIW
      rank 1: .FFFIWIWIW.
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
  (times are half-ticks: blocks read at ``2t``, messages land at
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


def _check_packing(message_cost: float, backward: str | None) -> None:
  """``tick_table``'s ``message_cost`` and ``backward``, or a ValueError."""
  if (isinstance(message_cost, bool)
      or not isinstance(message_cost, (int, float))
      or not math.isfinite(message_cost) or message_cost < 0):
    raise ValueError(f'tick_table: message_cost={message_cost!r} must be a '
                     'finite number >= 0 (what a tick with messages costs, '
                     'in forwards; 0: messages are free).')
  if backward not in BACKWARDS:
    raise ValueError(f'tick_table: backward={backward!r} is not one of '
                     f'{BACKWARDS} (None: fused or split, whichever packs '
                     'better).')


def tick_table(schedule: Schedule, *, forward_only: bool = False,
               message_cost: float = MESSAGE_COST,
               backward: str | None = None) -> TickTable:
  """The tick table of ``schedule``: what the pipeline executor runs.

  Args:
    schedule: a ``Schedule``; it is validated first (``Schedule.validate``).
    forward_only: keep only the ``F`` actions (inference with
      ``pipeline_apply``); their order is the schedule's.
    message_cost: what a tick with messages between ranks costs the packing,
      in forwards (``F = 1, B = 2``), ``>= 0``; ``MESSAGE_COST`` (0.25) is
      about what a message took on two CPU processes over gloo, pinned or
      not (0.11-0.26). ``0``: the shortest lock-step time.
    backward: how the table runs the schedule's ``B`` actions: ``'fused'``
      (one ``B`` block), ``'split'`` (an ``I`` and then a ``W``) or ``None``,
      whichever scores lower (module doc, "Fused or split"). A schedule's
      own ``I`` and ``W`` actions stay as they are.

  Returns:
    A ``TickTable``: int32 ``[ticks, ranks]`` tables of blocks and
    buffer slots plus the buffer sizes. The stash and mailbox sizes follow
    the schedule: ``O(p)`` for 1F1B, ``O(m)`` for GPipe (which may hold
    messages back to send them in pairs where they cost more:
    ``num_hold_slots``). Its
    ``makespan(comm=message_cost)`` is at most that of the table before
    like-with-like packing (every ``B`` as ``I`` then ``W``, plain list
    scheduling), and with ``message_cost=0`` its ``makespan()`` is at most
    ``schedule.simulate().makespan`` (default costs).

  Raises:
    TypeError: if ``schedule`` is not a ``Schedule``.
    ScheduleError: (a ``ValueError``) if the schedule is invalid.
    ValueError: if the ranks hold different numbers of stages, or for a
      bad ``message_cost`` or ``backward``.

  Example:
    >>> import jaxpar
    >>> table = jaxpar.pipeline.tick_table(jaxpar.pipeline.gpipe(4, 8))
    >>> table.kind.shape, table.num_stash_slots, table.offsets
    ((30, 4), 8, (0, 1, 3))
    >>> fused = jaxpar.pipeline.tick_table(jaxpar.pipeline.gpipe(4, 8),
    ...                                    backward='fused')
    >>> fused.kind.shape, fused.num_weight_slots, fused.makespan()
    ((22, 4), 0, 33.0)
  """
  if not isinstance(schedule, Schedule):
    raise TypeError(f'tick_table expects a jaxpar.pipeline.Schedule, got '
                    f'{type(schedule).__name__}.')
  schedule.validate()
  if forward_only:
    schedule = dataclasses.replace(schedule, actions=tuple(
        tuple(a for a in acts if a is not None and a.kind == 'F')
        for acts in schedule.actions))
  _check_packing(message_cost, backward)
  stages_of = local_stages(schedule)
  packing = layout(schedule, float(message_cost), backward)
  blocks, ticks = packing.blocks, packing.tick
  slots, peaks, messages = _slots(schedule, blocks, ticks, not forward_only)
  offsets = tuple(sorted({(dst - src) % schedule.num_ranks
                          for src, dst, *_ in messages}))
  shape = (packing.t, schedule.num_ranks)
  kind = np.zeros(shape, np.int32)
  stage, microbatch, local_stage, read_slot, stash_slot, weight_slot = (
      np.full(shape, -1, np.int32) for _ in range(6))
  recv_slot = np.full(shape + (len(offsets),), -1, np.int32)
  hold_slot = np.full(shape, -1, np.int32)
  recv_held = np.full(shape + (len(offsets), int(peaks[3].max(initial=0))),
                      -1, np.int32)
  last = schedule.num_stages - 1
  for a, tk in zip(blocks.actions, ticks):
    s, i, r = a.stage, a.microbatch, schedule.placement[a.stage]
    kind[tk, r] = KIND_CODES[a.kind]
    stage[tk, r], microbatch[tk, r] = s, i
    local_stage[tk, r] = stages_of[r].index(s)
    if not forward_only:
      stash_slot[tk, r] = slots['stash', s, i]
    if a.kind == 'F':
      if s > 0:
        read_slot[tk, r] = slots['mail', 'F', s - 1, i]
      continue
    if a.kind in 'IW':
      weight_slot[tk, r] = slots['weight', s, i]
    read_slot[tk, r] = slots[('mail', 'F', s, i) if s == last else
                             ('mail', 'G', s + 1, i)]
  for src, dst, tk, key, held in messages:
    k = offsets.index((dst - src) % schedule.num_ranks)
    if held >= 0:
      h = slots[('hold',) + key]
      hold_slot[held, src] = h
      recv_held[tk, dst, k, h] = slots[('mail',) + key]
    else:
      recv_slot[tk, dst, k] = slots[('mail',) + key]
  return TickTable(
      schedule=schedule, kind=kind, stage=stage, microbatch=microbatch,
      local_stage=local_stage, read_slot=read_slot, stash_slot=stash_slot,
      weight_slot=weight_slot, recv_slot=recv_slot, hold_slot=hold_slot,
      recv_held=recv_held, offsets=offsets,
      num_stash_slots=int(peaks[0].max(initial=0)),
      num_weight_slots=int(peaks[1].max(initial=0)),
      num_mailbox_slots=int(peaks[2].max(initial=0)),
      num_hold_slots=recv_held.shape[-1],
      peak_stash=peaks[0], peak_mailbox=peaks[2])


def _slots(schedule: Schedule, blocks: Blocks, ticks: list[int],
           training: bool) -> tuple[dict, np.ndarray, list]:
  """The buffer slots of the placed blocks (module doc).

  Returns ``({('stash' | 'weight', s, i) or ('mail' | 'hold', 'F' | 'G',
  s, i): slot}, int32 [4, p] peak stash / weight / mailbox / hold entries,
  messages as (src rank, dst rank, tick it leaves, (kind, stage,
  microbatch), the tick of its block if it is held there, else -1))``:
  ``'F'`` keys an activation or the loss cotangent of
  stage ``s``'s ``F``, ``'G'`` the input cotangent of stage ``s``'s ``B`` or
  ``I``; a held message waits in a hold slot of its rank from the end of
  its block's tick until it leaves with its carrier's (``Blocks.carrier``).
  """
  p, last, place = schedule.num_ranks, schedule.num_stages - 1, {}
  for a, tk in zip(blocks.actions, ticks):
    place[a] = tk
  # The tick a block's message leaves: its own, or its carrier's.
  sent = [ticks[c] if c >= 0 else tk for c, tk in zip(blocks.carrier, ticks)]
  at = lambda kind, s, i: place[Action(s, kind, i)]
  # The last block that reads (s, i)'s stash and output cotangent.
  done = lambda s, i: place.get(Action(s, 'B', i), place.get(Action(s, 'W', i)))
  # (write time, last read time, key) in half-ticks: a block reads at 2t,
  # its messages land at 2t + 1.
  names = ('stash', 'weight', 'mail', 'hold')
  lives = {name: [[] for _ in range(p)] for name in names}
  messages = []
  for a, tk, ts in zip(blocks.actions, ticks, sent):
    s, i, src = a.stage, a.microbatch, schedule.placement[a.stage]
    key = ('F', s, i) if a.kind == 'F' else ('G', s, i)
    if ts > tk:   # held on its rank until it leaves with its carrier
      lives['hold'][src].append((2 * tk + 1, 2 * ts + 1, ('hold',) + key))
    if a.kind == 'F' and training:
      lives['stash'][src].append((2 * tk, 2 * done(s, i), ('stash', s, i)))
    if a.kind == 'F' and (s < last or training):
      dst = schedule.placement[s + 1] if s < last else src
      read = at('F', s + 1, i) if s < last else done(s, i)
      messages.append((src, dst, ts, key, tk if ts > tk else -1))
      lives['mail'][dst].append((2 * ts + 1, 2 * read, ('mail',) + key))
    if a.kind == 'I':
      lives['weight'][src].append((2 * tk, 2 * at('W', s, i),
                                   ('weight', s, i)))
    if a.kind in 'BI' and s > 0:
      dst = schedule.placement[s - 1]
      messages.append((src, dst, ts, key, tk if ts > tk else -1))
      lives['mail'][dst].append((2 * ts + 1, 2 * done(s - 1, i),
                                 ('mail',) + key))
  slots, peaks = {}, np.zeros((len(names), p), np.int32)
  for k, name in enumerate(names):
    for r in range(p):
      found, peaks[k, r] = _allocate(lives[name][r])
      slots.update(found)
  return slots, peaks, messages
