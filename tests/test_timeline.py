"""jaxpar.pipeline.timeline: every rank's ticks as they ran, and the Timeline's
arithmetic (compute, messages, waiting, overhead, outside add up)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar import pipeline as pp
from jaxpar.pipeline.schedules import KIND_CODES


def _stage(w, x):
  return jnp.tanh(x @ w)


def _loss(_, y, t):
  return jnp.mean((y - t) ** 2)


def _in_order(table):
  """Each rank's blocks as the executor runs them: ``(kind code, stage,
  microbatch)``, a ``B`` as one block or, where the table splits it, as its
  ``I`` then its ``W``."""
  fused = (table.kind == KIND_CODES['B']).any()
  out = []
  for row in table.schedule.actions:
    blocks = []
    for a in row:
      if a is not None:
        for kind in ('IW' if a.kind == 'B' and not fused else a.kind):
          blocks.append((KIND_CODES[kind], a.stage, a.microbatch))
    out.append(blocks)
  return out


def test_measured_blocks_run_in_the_schedules_order():
  # Two stages per rank (each B an I and a W) and two devices per rank (a
  # data axis): the timeline keeps each rank's first.
  schedule = pp.interleaved_one_f_one_b(2, 4, 2)
  mesh = jaxpar.make_mesh(stage=2, data=2, devices=jax.devices()[:4])
  step = pp.pipeline_value_and_grad(_stage, _loss, schedule=schedule,
                                    mesh=mesh)
  rng = np.random.default_rng(0)
  args = (rng.normal(size=(schedule.num_stages, 8, 8)).astype(np.float32) / 3,
          0., rng.normal(size=(16, 8)).astype(np.float32),
          np.zeros((16, 8), np.float32))
  want = step(*args)
  timeline = pp.timeline(step, *args, steps=2)
  table = timeline.table
  ticks = table.num_ticks
  assert table.schedule is schedule
  assert timeline.start.shape == (2, ticks, 2)
  # What the devices reported running, in the order of their timestamps.
  for rank, blocks in enumerate(_in_order(table)):
    for n in range(2):
      order = np.argsort(timeline.start[n, :, rank], kind='stable')
      ran = [tuple(int(v) for v in a) for a in timeline.actions[order, rank]
             if a[0]]
      assert ran == blocks, (rank, n)
  busy = timeline.actions[..., 0] > 0
  np.testing.assert_array_equal(timeline.actions[..., 0], table.kind)
  np.testing.assert_array_equal(timeline.actions[..., 1][busy],
                                table.stage[busy])
  np.testing.assert_array_equal(timeline.actions[..., 2][busy],
                                table.microbatch[busy])
  # Each rank's stamps in time: start <= computed <= received <= next start,
  # all between the call and the return.
  s, c, e = timeline.start, timeline.computed, timeline.received
  assert (s <= c).all() and (c <= e).all() and (e[:, :-1] <= s[:, 1:]).all()
  assert (timeline.called[:, None] <= s).all()
  assert (e <= timeline.returned[:, None]).all()
  for t in timeline.totals():
    assert t.compute + t.messages + t.waiting + t.overhead + t.outside == (
        pytest.approx(t.wall, rel=1e-9))
    assert 0 <= t.bubble <= t.waiting and min(t[1:]) >= 0
  assert set(timeline.costs()) == {'F', 'I', 'W', 'B'}   # B = I + W
  assert timeline.message_seconds() > 0
  # After the timeline, the step compiles as before: no callback, same result.
  assert 'callback' not in step.lower(*args).as_text()
  for got, expected in zip(jax.tree.leaves(step(*args)),
                           jax.tree.leaves(want)):
    np.testing.assert_array_equal(got, expected)


def _synthetic():
  """A Timeline of 1F1B on 2 ranks with made-up times: tick ``t`` of rank
  ``r`` starts at ``10 t + r``, computes ``2 + r``, and every rank's
  messages land at ``10 t + 6``; the step is called at -1, returns at
  ``10 T + 1``."""
  table = pp.tick_table(pp.one_f_one_b(2, 2))
  ticks = table.num_ticks
  t, r = np.meshgrid(np.arange(ticks), np.arange(2), indexing='ij')
  s = (10. * t + r)[None]
  c = s + 2 + r
  e = (10. * t + 6 + 0 * r)[None]
  actions = np.stack([table.kind, table.stage, table.microbatch], -1)
  return pp.Timeline(table, actions, s, c, e, np.full((1, 2), -1.),
                     np.full((1, 2), 10. * ticks + 1),
                     np.ones(ticks, bool))


def test_a_rank_that_ends_early_waits_in_its_last_tick_not_outside():
  """A rank whose last ticks are idle and send nothing (1F1B's and GPipe's
  last rank) runs through them at once and waits for the others in the
  step's final sums: that is lock-step time of its last tick (its bubble,
  as it idles there), not ``outside``."""
  timeline = _synthetic()
  assert timeline.table.kind[-1, 1] == 0 and timeline.table.kind[-1, 0]
  exchanges = timeline.exchanges.copy()
  exchanges[-1] = False                      # the last tick sends nothing
  received = timeline.received.copy()
  received[:, -1, 1] = timeline.computed[:, -1, 1]   # rank 1 ends at 10T-6
  first, last = timeline._replace(exchanges=exchanges,
                                  received=received).totals()
  # Rank 0 ends its ticks at 10 T - 4, rank 1 2 earlier; both return at
  # 10 T + 1, after the final sums.
  assert (last.waiting, last.bubble, last.outside) == (2, 2, 2 + 5)
  assert (first.waiting, first.outside) == (2 * (timeline.table.num_ticks
                                                 - 1), 1 + 5)
  for t in (first, last):
    assert sum(t[2:7]) == t.wall


def test_totals_split_the_step_as_documented():
  timeline = _synthetic()
  ticks = timeline.table.num_ticks
  idle = (timeline.table.kind == 0).sum(0)
  for t in timeline.totals():
    r = t.rank
    assert t.wall == 10 * ticks + 2
    assert t.compute == (2 + r) * ticks
    # Rank 1 computes one unit longer: rank 0 waits 2 per tick (the last
    # rank reaches the messages at 10 t + 4), which land 2 later.
    assert t.waiting == (2 if r == 0 else 0) * ticks
    assert t.messages == 2 * ticks
    assert t.bubble == (2 * idle[0] if r == 0 else 0)
    assert t.overhead == (4 + r) * (ticks - 1)
    assert t.outside == (r + 1) + 5
    assert sum(t[2:7]) == t.wall
  names = {code: name for name, code in KIND_CODES.items()}
  kinds = {names[k] for k in np.unique(timeline.table.kind) if k}
  want = {k: 2.5 for k in kinds}
  assert timeline.costs() == (want if 'B' in want else {**want, 'B': 5.0})
  assert timeline.message_seconds() == 2
  predicted = timeline.predicted()
  assert predicted['measured'] == 10 * ticks - 4
  # (The table's split I sends before the schedule's B would end: its
  # lock-step time may be below the schedule's simulated one.)
  assert predicted['lockstep'] == timeline.table.makespan(
      timeline.costs(), 2) and predicted['simulated'] > 0
  assert 'rank' in timeline.summary() and '1F1B' in timeline.summary()


def test_plot_draws_simulated_measured_and_totals():
  fig = _synthetic().plot()
  assert len(fig.axes) == 3
  with pytest.raises(ValueError, match='step=5 must be an int'):
    _synthetic().plot(step=5)


def test_bad_calls_raise():
  with pytest.raises(TypeError, match='step=3 is not callable'):
    pp.timeline(3)
  with pytest.raises(ValueError, match='steps=0 must be an int >= 1'):
    pp.timeline(jax.jit(jnp.sin), 1., steps=0)
  with pytest.raises(ValueError, match='ran no pipeline tick'):
    pp.timeline(jax.jit(jnp.sin), 1., steps=1, warmup=0)
