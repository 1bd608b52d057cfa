"""tick_table(): the tick table, replayed symbolically against the schedule."""

import dataclasses

import numpy as np
import pytest

from jaxpar import pipeline as sch
from jaxpar.pipeline.schedules import _simulate as simulate_module
from jaxpar.pipeline.schedules._tick_table import (
    B, F, I, IDLE, KIND_CODES, KIND_NAMES, MESSAGE_COST, W, local_stages,
    tick_table)
from helpers import SCHEDULES

# Every built-in constructor (helpers' and DualPipeV) and a searched one
# (small: search takes seconds).
BUILT = {**SCHEDULES, 'dualpipe_v': sch.dualpipe_v,
         'searched': lambda p, m: sch.search(p, m, memory_limit=p)}
CASES = [(name, p, m) for name in BUILT for p, m in
         [(1, 3), (2, 1), (2, 4), (4, 2), (4, 8), (3, 7), (8, 8)]
         if (name != 'interleaved' or m % p == 0)
         and (name != 'searched' or p * m <= 8)]
COST = np.array([0, 1, 2, 1, 1])   # per kind code: F = I = W = 1, B = 2


def replay(low):
  """Runs the table on symbolic values; asserts every read gets what it needs.

  Mailbox and stash slots hold keys naming their content: ``('act', s, i)``
  is stage s's output for microbatch i, ``('cot', s, i)`` the cotangent of
  stage s's input, ``('seed', i)`` the loss cotangent. Every block sends its
  own output at the end of its tick (``W`` sends nothing), or holds it
  (``hold_slot``) until it leaves with its rank's next message over the
  same offset (``recv_held``). Returns
  ``{(kind_code, stage, microbatch): tick}`` of the blocks run.
  """
  sched = low.schedule
  p, last = sched.num_ranks, sched.num_stages - 1
  mail = [dict() for _ in range(p)]
  stash = [dict() for _ in range(p)]
  kept = [dict() for _ in range(p)]
  held = [dict() for _ in range(p)]   # hold slot -> message held back
  done = {}
  for t in range(low.num_ticks):
    sent = {}
    for r in range(p):
      kind = low.kind[t, r]
      s, i = low.stage[t, r], low.microbatch[t, r]
      read, slot, wslot = (low.read_slot[t, r], low.stash_slot[t, r],
                           low.weight_slot[t, r])
      if kind == IDLE:
        assert s == i == read == slot == wslot == -1
        continue
      assert sched.placement[s] == r
      assert local_stages(sched)[r][low.local_stage[t, r]] == s
      assert (kind, s, i) not in done
      done[kind, s, i] = t
      assert -1 <= read < max(low.num_mailbox_slots, 1)
      assert -1 <= slot < max(low.num_stash_slots, 1)
      if kind == F:
        assert read == -1 if s == 0 else mail[r][read] == ('act', s - 1, i)
        if low.training:
          stash[r][slot] = (s, i)
        sent[r] = ('act', s, i) if s < last else ('seed', i)
        if s == last and not low.training:
          del sent[r]
        continue
      want = ('seed', i) if s == last else ('cot', s + 1, i)
      assert mail[r][read] == want, (t, r, mail[r].get(read), want)
      assert stash[r][slot] == (s, i)
      if kind == B:
        assert wslot == -1
      elif kind == I:
        kept[r][wslot] = (s, i)
      else:
        assert kept[r][wslot] == (s, i)
      if s > 0 and kind != W:
        sent[r] = ('cot', s, i)
    for r in range(p):   # a held message leaves with its rank's next one
      if low.hold_slot[t, r] >= 0:
        held[r][low.hold_slot[t, r]] = sent.pop(r)
    for r in range(p):
      for k, offset in enumerate(low.offsets):
        src = (r - offset) % p
        arrived = [(low.recv_slot[t, r, k], sent.get(src))] + [
            (low.recv_held[t, r, k, h], held[src].pop(h))
            for h in np.flatnonzero(low.recv_held[t, r, k] >= 0)]
        assert len(arrived) == 1 or offset and arrived[0][0] >= 0
        for slot, msg in arrived:
          if slot < 0:
            continue
          stage = msg[1] if msg[0] != 'seed' else last
          dst_stage = stage + 1 if msg[0] == 'act' else (
              stage - 1 if msg[0] == 'cot' else stage)
          assert sched.placement[dst_stage] == r
          mail[r][slot] = msg
  assert not any(held), held   # every held message left
  return done


def expected(sched, fused):
  """The ``(kind_code, stage, microbatch)`` the table must run: a ``B`` is
  a ``B`` block if ``fused``, else an ``I`` and a ``W``."""
  want = set()
  for row in sched.actions:
    for a in row:
      if a is not None:
        kinds = 'IW' if a.kind == 'B' and not fused else a.kind
        want |= {(KIND_CODES[k], a.stage, a.microbatch) for k in kinds}
  return want


@pytest.mark.parametrize('name,p,m', CASES)
def test_table_replays(name, p, m):
  sched = BUILT[name](p, m)
  low = tick_table(sched)
  done = replay(low)
  fused = bool((low.kind == B).any())
  assert set(done) == expected(sched, fused)
  # Dependencies are satisfied strictly earlier (messages usable at t + 1);
  # an input cotangent leaves with its B or I.
  sent = {(s, i): t for (k, s, i), t in done.items() if k in (B, I)}
  for (kind, s, i), t in done.items():
    if kind == F and s > 0:
      assert done[F, s - 1, i] < t
    if kind in (B, I):
      assert done[F, s, i] < t
      assert s == sched.num_stages - 1 or sent[s + 1, i] < t
    if kind == W:
      assert done[I, s, i] < t
  # Each rank runs its blocks in the schedule's order.
  for r, row in enumerate(sched.actions):
    ticks = [done[KIND_CODES['I' if a.kind == 'B' and not fused else a.kind],
                  a.stage, a.microbatch] for a in row if a is not None]
    assert ticks == sorted(ticks), (r, ticks)
  # The stash is the schedule's: live from F to its last backward block.
  np.testing.assert_array_equal(low.peak_stash, [
      simulate_module._peak(row, 'F', ('B', 'W')) for row in sched.actions])
  if not (low.kind == I).any():
    assert low.num_weight_slots == 0
  for field in (low.kind, low.stage, low.microbatch, low.local_stage,
                low.read_slot, low.stash_slot, low.weight_slot):
    assert field.dtype == np.int32 and field.shape == (low.num_ticks, p)
  assert low.recv_slot.shape == (low.num_ticks, p, len(low.offsets))


GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 4, 8, 12)] + [
    (8, 8), (8, 16)]


@pytest.mark.parametrize('name', BUILT)
def test_lockstep_time_at_most_the_simulated_time(name):
  """With messages free, ``tick_table(s).makespan()`` (what the executor
  scans) <= ``simulate``'s (the schedule as written: the lock-step time
  before like-with-like packing)."""
  for p, m in GRID:
    if name == 'interleaved' and m % p or name == 'searched' and p * m > 8:
      continue
    sched = BUILT[name](p, m)
    low = tick_table(sched, message_cost=0)
    # makespan() is its formula: each tick lasts as long as its slowest block.
    assert low.makespan() == COST[low.kind].max(axis=1).sum()
    assert low.makespan() <= sched.simulate().makespan, (p, m)


# Lock-step time and ticks with messages of every table before like-with-like
# packing (commit 0d3ced4: each B as I then W, its cotangent sent with W,
# plain list scheduling).
BEFORE = {
    ('gpipe', 2, 4): (15, 8), ('gpipe', 2, 12): (39, 24),
    ('gpipe', 4, 8): (33, 20), ('1f1b', 2, 4): (15, 6),
    ('1f1b', 2, 12): (39, 14), ('1f1b', 4, 8): (33, 43),
    ('interleaved', 2, 4): (27, 18), ('interleaved', 2, 12): (75, 50),
    ('interleaved', 4, 8): (57, 73), ('zb_h1', 2, 4): (13, 8),
    ('zb_h1', 2, 12): (37, 24), ('zb_h1', 4, 8): (27, 40),
    ('zero_bubble_v', 2, 4): (25, 14), ('zero_bubble_v', 2, 12): (73, 46),
    ('zero_bubble_v', 4, 8): (51, 66), ('dualpipe_v', 2, 4): (25, 12),
    ('dualpipe_v', 2, 12): (73, 44), ('dualpipe_v', 4, 8): (51, 66),
    ('v_half', 2, 4): (25, 13), ('v_half', 2, 12): (73, 37),
    ('v_half', 4, 8): (53, 74), ('v_min', 2, 4): (27, 14),
    ('v_min', 2, 12): (75, 38), ('v_min', 4, 8): (59, 80)}


@pytest.mark.parametrize('name,p,m', BEFORE)
def test_never_slower_than_before_with_messages_priced(name, p, m):
  """Lock-step time + ``MESSAGE_COST`` per tick with messages: never more
  than before, but DualPipeV at p = 4 (its split B's cotangents, sent with
  I, no longer line up with other sends: 72 ticks with messages, not 66)."""
  low = tick_table(BUILT[name](p, m))
  time, messages = BEFORE[name, p, m]
  slack = 3 if (name, p) == ('dualpipe_v', 4) else 0
  assert (low.makespan(comm=MESSAGE_COST)
          <= time + MESSAGE_COST * messages + slack)


@pytest.mark.parametrize('name,p,m,fused,time,simulated', [
    ('gpipe', 2, 3, False, 11, 12),   # fused: 12 (FFF..BBB)
    ('gpipe', 4, 8, False, 30, 33),   # fused: 33 with 20 ticks of messages
    ('interleaved', 2, 4, False, 26, 27),
    ('interleaved', 4, 8, True, 57, 57),   # split: 54 + 63 messages
    ('1f1b', 4, 8, False, 30, 33),   # fused: 39, every B beside an F
    ('1f1b', 8, 16, False, 63, 69),
    ('dualpipe_v', 4, 8, False, 51, 51),
])
def test_fused_or_split_whichever_scores_lower(name, p, m, fused, time,
                                                simulated):
  # The split I sends its cotangent a tick before a fused B would; a fused
  # table is kept where its fewer ticks with messages outweigh that.
  low = tick_table(BUILT[name](p, m))
  assert bool((low.kind == B).any()) == fused
  assert not (fused and (low.kind == I).any())
  assert (low.num_weight_slots == 0) == fused
  assert (low.makespan(), low.schedule.simulate().makespan) == (time,
                                                               simulated)


def test_backward_fused_or_split_on_request():
  gpipe = sch.gpipe(2, 3)
  fused = tick_table(gpipe, backward='fused')
  assert fused.render() == 'rank 0: FFF..BBB\nrank 1: .FFFBBB.'
  assert (fused.makespan(), fused.num_weight_slots) == (12, 0)
  split = tick_table(gpipe, backward='split')
  assert split.render() == tick_table(gpipe).render()
  assert (split.makespan(), split.num_weight_slots) == (11, 1)
  assert len(replay(fused)) == 2 * 3 * 2 and len(replay(split)) == 2 * 3 * 3
  interleaved = sch.interleaved_one_f_one_b(4, 8, 2)
  assert not (tick_table(interleaved, backward='split').kind == B).any()
  # A schedule's own I and W stay apart.
  assert (tick_table(sch.zero_bubble_h1(2, 4), backward='fused').kind
          == I).any()
  with pytest.raises(ValueError, match="backward='both'"):
    tick_table(gpipe, backward='both')


def test_like_with_like():
  # Fused interleaved 1F1B: B's share their ticks with B's (or idle ranks)
  # but for the first ticks of the steady state; plain list scheduling pairs
  # B with F in 21 ticks and takes 68, not 57.
  low = tick_table(BUILT['interleaved'](4, 8))
  mixed = (low.kind == B).any(1) & (low.kind == F).any(1)
  assert mixed.sum() == 3 and low.makespan() == 57
  assert low.render() == (
      'rank 0: FFFFF.FF.FF.FFBFBFBFBFBFB.B.B.BBBBBBBB\n'
      'rank 1: .FFFFF.FF.FFBFBFBFBFBFBFBFB.B.BBBBBBB.\n'
      'rank 2: ..FFFFF.FFBFBFBFBFBFBFBFBFBFB.BBBBBB..\n'
      'rank 3: ...FFFFFBFBFBFBFBFBFBFBFBFBFBFBBBBB...')


def test_messages_fold():
  # Holding a rank back a tick early lines up its sends with another rank's:
  # one ppermute carries both. ZB-V and DualPipeV, p = 2, m = 12: 46 and 44
  # before.
  assert tick_table(sch.zero_bubble_v(2, 12)).message_ticks == 26
  assert tick_table(sch.dualpipe_v(2, 12)).message_ticks == 27
  low = tick_table(sch.one_f_one_b(2, 12))
  assert low.message_ticks == 13
  assert low.makespan(comm=0.5) == low.makespan() + 0.5 * 13
  # ZB-H1 trades a tick for 10 fewer ticks with messages (priced at half a
  # forward): 1F1B's 38 and 13; with messages free, 37 and 23.
  zb = sch.zero_bubble_h1(2, 12)
  assert (tick_table(zb).makespan(), tick_table(zb).message_ticks) == (38, 13)
  free = tick_table(zb, message_cost=0)
  assert (free.makespan(), free.message_ticks) == (37, 23)
  with pytest.raises(ValueError, match='message_cost=-1'):
    tick_table(zb, message_cost=-1)


# Bundled: GPipe's messages held a tick and sent in pairs (p = 2, m even and
# odd; p = 3; forward only) where a message costs a forward.
PINNED = 1.0
BUNDLED = [(2, 8, False), (2, 9, False), (3, 14, False), (2, 12, True)]


@pytest.mark.parametrize('p,m,forward_only', BUNDLED)
def test_bundled_table_replays(p, m, forward_only):
  sched = sch.gpipe(p, m)
  low = tick_table(sched, forward_only=forward_only, message_cost=PINNED)
  assert low.num_hold_slots == 1
  assert low.recv_held.shape == (low.num_ticks, p, len(low.offsets), 1)
  assert low.hold_slot.shape == (low.num_ticks, p)
  done = replay(low)
  blocks = 1 if forward_only else 2 if (low.kind == B).any() else 3
  assert len(done) == sched.num_stages * m * blocks
  # A rank holds every other message it sends in a direction: activations
  # to the next rank, input cotangents to the one before.
  np.testing.assert_array_equal((low.hold_slot >= 0).sum(0), [
      m // 2 * ((r < p - 1) + (r > 0 and not forward_only))
      for r in range(p)])
  free = tick_table(sched, message_cost=0, forward_only=forward_only)
  assert free.num_hold_slots == 0 and not (free.hold_slot >= 0).any()
  assert low.makespan(comm=PINNED) < free.makespan(comm=PINNED)


def test_gpipe_sends_in_pairs():
  # GPipe p = 2, m = 12 where a message costs a forward: 12 ticks with
  # messages instead of 24 for 3 more units of lock-step time; its F's and
  # its I's and W's share ticks with their own kind only.
  low = tick_table(sch.gpipe(2, 12), message_cost=PINNED)
  assert (low.makespan(), low.message_ticks, low.num_ticks) == (41, 12, 41)
  assert low.render() == ('rank 0: ' + 'F' * 12 + '.....' + 'IW' * 12 + '\n'
                          'rank 1: ..' + 'F' * 12 + 'IW' * 12 + '...')
  free = tick_table(sch.gpipe(2, 12), message_cost=0)
  assert (free.makespan(), free.message_ticks) == (38, 24)
  # Each pair leaves with its second message: rank 0's F(2j) and rank 1's
  # I(2j) are held.
  held = [np.flatnonzero(low.hold_slot[:, r] >= 0).tolist() for r in (0, 1)]
  assert held == [list(range(0, 12, 2)), list(range(14, 38, 4))]
  # At the default price (a message a quarter of a forward) no constructor
  # holds a message at the bench's sizes.
  for name in BUILT:
    for p, m in ((2, 8), (2, 12), (4, 8)):
      if name != 'searched':
        assert tick_table(BUILT[name](p, m)).num_hold_slots == 0, (name, p, m)


def test_lockstep_time_by_hand():
  low = tick_table(sch.interleaved_one_f_one_b(4, 8, 2))
  assert low.makespan() == 57   # 19 ticks of F, 19 with a B
  assert low.makespan({'F': 2, 'B': 3}) == 19 * 2 + 19 * 3
  assert low.makespan({'I': 2}) == 19 * 1 + 19 * 3   # B = I + W
  low = tick_table(sch.one_f_one_b(2, 3))
  assert low.render() == 'rank 0: F.FIWFIW.IW\nrank 1: .FIWFIWFIW.'
  assert low.makespan() == 11   # I sends at its end, a tick before B would
  assert low.makespan({'F': 2, 'I': 1, 'W': 1}) == 6 * 2 + 5 * 1
  with pytest.raises(ValueError, match='unknown kind'):
    low.makespan({'X': 1})


def test_kind_codes():
  assert (IDLE, F, B, I, W) == (0, 1, 2, 3, 4)
  assert KIND_CODES == {'F': 1, 'B': 2, 'I': 3, 'W': 4}
  assert [KIND_NAMES[c] for c in KIND_CODES.values()] == list(KIND_CODES)


@pytest.mark.parametrize('name,p,m', [c for c in CASES if c[0] != 'gpipe'])
def test_forward_only_table_replays(name, p, m):
  low = tick_table(BUILT[name](p, m), forward_only=True)
  assert not low.training
  assert set(np.unique(low.kind)) <= {IDLE, F}
  assert low.num_stash_slots == 0
  assert len(replay(low)) == low.schedule.num_stages * m


@pytest.mark.parametrize('name', ['1f1b', 'interleaved', 'zb_h1', 'zero_bubble_v'])
def test_buffers_are_flat_in_m(name):
  small, large = (tick_table(SCHEDULES[name](4, m)) for m in (16, 64))
  assert small.num_stash_slots == large.num_stash_slots
  assert small.num_mailbox_slots == large.num_mailbox_slots
  assert large.num_ticks > 3 * small.num_ticks // 2


def test_gpipe_buffers_grow_with_m():
  for m in (3, 8):
    low = tick_table(sch.gpipe(4, m))
    assert low.num_stash_slots == m
    np.testing.assert_array_equal(low.peak_stash, [m] * 4)


@pytest.mark.parametrize('p,m', [(4, 8), (4, 2), (3, 5)])
def test_1f1b_stash_matches_simulate(p, m):
  sched = sch.one_f_one_b(p, m)
  low = tick_table(sched)
  np.testing.assert_array_equal(low.peak_stash,
                                sched.simulate().peak_activations)
  np.testing.assert_array_equal(low.peak_stash,
                                [min(p - r, m) for r in range(p)])


def test_offsets():
  assert tick_table(sch.one_f_one_b(4, 4)).offsets == (0, 1, 3)
  assert tick_table(sch.one_f_one_b(1, 2)).offsets == (0,)
  assert tick_table(sch.one_f_one_b(4, 4), forward_only=True).offsets == (1,)
  assert tick_table(sch.zero_bubble_v(4, 4)).offsets == (0, 1, 3)  # V turns locally
  assert tick_table(sch.zero_bubble_v(2, 2)).offsets == (0, 1)      # +1 == -1 for p = 2


def test_local_stages():
  assert local_stages(sch.interleaved_one_f_one_b(2, 2, 2)) == ((0, 2), (1, 3))
  assert local_stages(sch.zero_bubble_v(2, 2)) == ((0, 3), (1, 2))


def test_errors():
  with pytest.raises(TypeError, match='Schedule'):
    tick_table('1f1b')
  bad = dataclasses.replace(sch.one_f_one_b(2, 2), actions=(
      sch.one_f_one_b(2, 2).actions[0][:-1], sch.one_f_one_b(2, 2).actions[1]))
  with pytest.raises(ValueError, match='missing'):
    tick_table(bad)
  # Three stages on two ranks: rank 0 would hold two, rank 1 one.
  uneven = sch.Schedule(2, 3, 1, (0, 0, 1), (
      (sch.Action(0, 'F', 0), sch.Action(1, 'F', 0), sch.Action(1, 'B', 0),
       sch.Action(0, 'B', 0)),
      (sch.Action(2, 'F', 0), sch.Action(2, 'B', 0))), 'uneven')
  with pytest.raises(ValueError, match=r'\[2, 1\] stages'):
    tick_table(uneven)
