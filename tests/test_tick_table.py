"""tick_table(): the tick table, replayed symbolically against the schedule."""

import dataclasses

import numpy as np
import pytest

from jaxpar import pipeline as sch
from jaxpar.pipeline.schedules._tick_table import F, I, IDLE, W, local_stages, tick_table
from helpers import SCHEDULES

CASES = [(name, p, m) for name in SCHEDULES for p, m in
         [(1, 3), (2, 1), (2, 4), (4, 2), (4, 8), (3, 7), (8, 8)]
         if name != 'interleaved' or m % p == 0]


def replay(low):
  """Runs the table on symbolic values; asserts every read gets what it needs.

  Mailbox and stash slots hold keys naming their content: ``('act', s, i)``
  is stage s's output for microbatch i, ``('cot', s, i)`` the cotangent of
  stage s's input, ``('seed', i)`` the loss cotangent. Returns ``{(kind_code,
  stage, microbatch): tick}`` of the actions run.
  """
  sched = low.schedule
  p, last = sched.num_ranks, sched.num_stages - 1
  mail = [dict() for _ in range(p)]
  stash = [dict() for _ in range(p)]
  kept = [dict() for _ in range(p)]
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
      if kind == I:
        kept[r][wslot] = (s, i)
      else:
        assert kept[r][wslot] == (s, i)
      if s > 0:  # I sends its input cotangent, W the one its I computed
        sent[r] = ('cot', s, i)
    for r in range(p):
      for k, offset in enumerate(low.offsets):
        slot = low.recv_slot[t, r, k]
        if slot >= 0:
          msg = sent[(r - offset) % p]
          stage = msg[1] if msg[0] != 'seed' else last
          dst_stage = stage + 1 if msg[0] == 'act' else (
              stage - 1 if msg[0] == 'cot' else stage)
          assert sched.placement[dst_stage] == r
          mail[r][slot] = msg
  return done


def expected(sched):
  """The ``(kind_code, stage, microbatch)`` the table must run: B = I + W."""
  want = set()
  for row in sched.actions:
    for a in row:
      if a is not None:
        kinds = 'IW' if a.kind == 'B' else a.kind
        want |= {(dict(F=F, I=I, W=W)[k], a.stage, a.microbatch)
                 for k in kinds}
  return want


@pytest.mark.parametrize('name,p,m', CASES)
def test_table_replays(name, p, m):
  sched = SCHEDULES[name](p, m)
  low = tick_table(sched)
  done = replay(low)
  assert set(done) == expected(sched)
  # Dependencies are satisfied strictly earlier (messages usable at t + 1);
  # a split B's input cotangent leaves with its W.
  split = {(a.stage, a.microbatch) for row in sched.actions for a in row
           if a is not None and a.kind == 'B'}
  sent = {(s, i): t + ((s, i) in split) for (k, s, i), t in done.items()
          if k == I}
  for (kind, s, i), t in done.items():
    if kind == F and s > 0:
      assert done[F, s - 1, i] < t
    if kind == I:
      assert done[F, s, i] < t
      assert s == sched.num_stages - 1 or sent[s + 1, i] < t
    if kind == W:
      assert done[I, s, i] < t
  for field in (low.kind, low.stage, low.microbatch, low.local_stage,
                low.read_slot, low.stash_slot, low.weight_slot):
    assert field.dtype == np.int32 and field.shape == (low.num_ticks, p)
  assert low.recv_slot.shape == (low.num_ticks, p, len(low.offsets))


GRID = [(name, p, m) for name in SCHEDULES for p in (1, 2, 3, 4, 8)
        for m in (1, 2, 4, 8, 12, 32, 64)
        if name != 'interleaved' or m % p == 0]


@pytest.mark.parametrize('name', SCHEDULES)
def test_lockstep_time_is_the_simulated_time(name):
  """``tick_table(s).makespan()`` (what the executor scans) == ``simulate``'s."""
  for n, p, m in GRID:
    if n == name:
      sched = SCHEDULES[name](p, m)
      assert tick_table(sched).makespan() == sched.simulate().makespan, (p, m)


def test_lockstep_time_by_hand():
  # 1F1B, p=2, m=3: (m + p - 1)(F + B) = 12 with F=1, B = I + W = 2.
  low = tick_table(sch.one_f_one_b(2, 3))
  assert low.render() == 'rank 0: FF..IWFIW.IW\nrank 1: .FIWFIWFIW..'
  assert low.makespan() == 12
  # A tick lasts as long as its slowest action.
  assert low.makespan({'F': 2, 'I': 1, 'W': 1}) == 5 * 2 + 7 * 1  # 5 of 12 hold an F
  with pytest.raises(ValueError, match='unknown kind'):
    low.makespan({'X': 1})


@pytest.mark.parametrize('name,p,m', [c for c in CASES if c[0] != 'gpipe'])
def test_forward_only_table_replays(name, p, m):
  low = tick_table(SCHEDULES[name](p, m), forward_only=True)
  assert not low.training
  assert set(np.unique(low.kind)) <= {IDLE, F}
  assert low.num_stash_slots == 0
  assert len(replay(low)) == low.schedule.num_stages * m


@pytest.mark.parametrize('name', ['1f1b', 'interleaved', 'zb_h1', 'zero_bubble_v'])
def test_buffers_are_flat_in_m(name):
  small, large = (tick_table(SCHEDULES[name](4, m)) for m in (8, 64))
  assert small.num_stash_slots == large.num_stash_slots
  assert small.num_mailbox_slots == large.num_mailbox_slots
  assert large.num_ticks > 7 * small.num_ticks // 2


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

