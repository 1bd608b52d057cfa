"""The planner's time model (``jaxpar.planner._time``): ZeRO-3's collectives
as a compiled step runs them, the lock-step time with idle ranks, and what
``measure`` times. Nothing here is timed: the terms are checked against
compiled programs and against the model as written."""

import re

import jax
import numpy as np
import optax
import pytest

import jaxpar
from jaxpar import planner
from jaxpar.models import gpt
from jaxpar.planner import _calibrate, _measure, _source
from jaxpar.planner._time import lock_step, zero3_seconds

CONFIG = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16, num_heads=2,
                       num_layers=2)
COLLECTIVE = re.compile(r'= .*\b(all-gather|reduce-scatter|all-reduce|'
                        r'collective-permute)(?:-start)?\(')


def _computations(text: str) -> tuple[dict, str]:
  """``({name: lines}, entry)`` of an HLO module's text."""
  comps, name, entry = {}, None, None
  for line in text.splitlines():
    head = re.match(r'^(ENTRY )?%?([\w.\-]+) .*\{$', line)
    if head:
      name = head.group(2)
      comps[name] = []
      entry = name if head.group(1) else entry
    elif name is not None:
      comps[name].append(line)
  return comps, entry


def run_counts(text: str, name: str | None = None) -> dict[str, int]:
  """Collectives over more than one device a compiled program (its HLO
  ``text``) runs, or its computation ``name``, each counted as often as
  it runs (a ``while`` body times its known trip count), by kind."""
  comps, entry = _computations(text)

  def count(name: str) -> dict[str, int]:
    out = {}
    for line in comps.get(name, []):
      found = COLLECTIVE.search(line)
      if found and not re.search(r'replica_groups=\{\{\d+\}', line):
        out[found.group(1)] = out.get(found.group(1), 0) + 1
      for callee in re.findall(r'(?:body|calls|to_apply)=%?([\w.\-]+)',
                               line):
        for kind, n in count(callee).items():
          out[kind] = out.get(kind, 0) + trips(line) * n
    return out
  return count(name or entry)


def trips(line: str) -> int:
  """The known trip count of a ``while`` instruction, else 1."""
  found = re.search(r'known_trip_count.{0,8}"n":"(\d+)"', line)
  return int(found.group(1)) if ' while(' in line and found else 1


def per_microbatch(src, m: int = 3) -> dict[str, int]:
  """The collectives of one microbatch of a ZeRO-3 DP step of ``m``: the
  body of its ``while`` of ``m`` trips."""
  layout = planner.Layout(2, 1, 1, 'one_f_one_b', m, zero_stage=3)
  trainer = _source.build_trainer(src, jax.devices()[:2], layout,
                                  optax.adam(1e-3))
  state = trainer.init(src.pipeline(1)[0])
  ids = np.zeros((2 * m, CONFIG.seq_len), np.int32)
  text = trainer.step.lower(state, (ids, ids)).compile().as_text()
  loop, = [line for line in text.splitlines() if trips(line) == m]
  return run_counts(text, re.search(r'body=%?([\w.\-]+)', loop).group(1))


def test_zero3_step_runs_per_microbatch_what_the_calibration_times():
  """A ZeRO-3 step's collectives grow by the same per microbatch as the
  calibration's program runs per layer, times the layers (plus the
  embedding's and head's arrays): each param array gathered twice and
  reduce-scattered once, one at a time; the prediction grows by
  ``zero3_seconds`` per microbatch."""
  spec = planner.ModelSpec.from_gpt(CONFIG)
  program, args = _calibrate._zero3_program(spec, jax.devices()[:2])
  layer = {k: n / _calibrate._slots(spec)
           for k, n in run_counts(program.lower(*args).compile().as_text()
                                  ).items()}
  leaves = len(jax.tree.leaves(_calibrate._host_stage(spec)[1]))
  # each array reduce-scattered once, gathered twice (XLA keeps one here)
  assert layer == {'all-gather': 2 * leaves - 1, 'reduce-scatter': leaves}
  src = _source.source(CONFIG, blocks='blocks', embed=None, head_loss=None,
                       inputs=None)
  step = per_microbatch(src)
  sides = 2 + 4   # embed and position; final norm and head: kernel, bias
  for kind in layer:   # the step's layers: the calibration's, + the sides
    assert (CONFIG.num_layers * layer[kind] <= step[kind]
            <= CONFIG.num_layers * layer[kind] + sides)
  timed = planner.PROFILES['H100-SXM']._replace(zero3_layer_seconds=1e-3)
  step = lambda m: planner.step_time(
      spec, planner.Layout(2, 1, 1, 'one_f_one_b', m, zero_stage=3),
      batch=4, profile=timed)
  grows = zero3_seconds(spec, planner.Layout(2, 1, 1, 'one_f_one_b', 1, 3),
                        timed, CONFIG.num_layers)
  assert step(2).data - step(1).data == pytest.approx(grows)
  assert grows == pytest.approx(2e-3 + zero3_seconds(
      spec, planner.Layout(2, 1, 1, 'one_f_one_b', 1, 3), timed, 0))


def test_lock_step_waits_only_at_ticks_that_send():
  """The ranks run their blocks back to back and wait for the slowest at
  each tick that sends (+ ``comm``); ``alone_speedup`` divides the ticks
  where the other ranks idle (1 + (s - 1) x share). Never above
  ``makespan`` (every tick waits), equal where every tick sends."""
  blocks = {'F': 1.0, 'I': 1.5, 'W': 2.2, 'B': 2.7}
  for schedule in (jaxpar.pipeline.one_f_one_b(2, 4),
                   jaxpar.pipeline.zero_bubble_v(2, 1),
                   jaxpar.pipeline.gpipe(4, 2)):
    table = jaxpar.pipeline.tick_table(schedule)
    cost = np.array([0.0] + [blocks[k] for k in 'FBIW'])[table.kind]
    ranks = table.kind.shape[1]
    share = (table.kind == 0).sum(1) / (ranks - 1)
    for alone in (1.0, 1.5):
      clock = np.zeros(ranks)
      for tick, sends in zip(cost / (1 + (alone - 1) * share)[:, None],
                             table.sends.any(1)):
        clock = clock + tick
        if sends:
          clock[:] = clock.max() + 0.3
      assert lock_step(table, blocks, 0.3, alone) == pytest.approx(
          clock.max())
    assert lock_step(table, blocks, 0.3) <= table.makespan(blocks, 0.3)
  table = jaxpar.pipeline.tick_table(jaxpar.pipeline.gpipe(2, 1))
  assert table.sends.any(1).sum() == 2     # F, ., B send; the last F not
  assert _calibrate._alone_speedup(None, None, 1) == 1.0   # one process


def test_measure_times_the_spread_and_the_runners_up():
  """``--measure 6`` times 8: the 6 spread over the predicted range and
  the best's 2 runners-up (another mesh, schedule or microbatch count)."""
  spec = planner.ModelSpec.from_gpt(CONFIG)
  plan = jaxpar.plan(spec, batch=16, devices=8, profile='H100-SXM',
                     remat_policies=('dots', 'nothing'), compile=0)
  picked = _measure.chosen(plan.candidates, 6)
  spread = _measure._spread(plan.candidates, 6)
  assert len(picked) == 6 + _measure.RUNNERS_UP == 8
  assert len({c.layout[:5] for c in picked}) == 8
  assert all(c in picked for c in spread)
  fits = sorted((c for c in plan.candidates if c.fits),
                key=lambda c: c.predicted_s)
  others = [c for c in fits if c.layout[:5] not in
            {x.layout[:5] for x in spread}]
  assert others[0] in picked
  assert [c.predicted_s for c in picked] == sorted(
      c.predicted_s for c in picked)


def test_fresh_buffers_cost_their_temporaries_and_outputs_at_the_measured_rate():
  """``StepTime.alloc``: a pipeline's stash, work and outputs (not its
  arguments) over ``Profile.first_touch_bandwidth``, in ``total``; none on
  paper (0: a pooled allocator). Without a pipeline its outputs alone (the
  one-rank program's timed rate pays its temporaries)."""
  spec = planner.ModelSpec.from_gpt(CONFIG)
  layout = planner.Layout(1, 2, 1, 'gpipe', 4)
  paper = planner.PROFILES['H100-SXM']
  cpu = paper._replace(first_touch_bandwidth=2.0**30)
  mem = planner.memory(spec, layout, batch=8)
  plain = planner.step_time(spec, layout, batch=8, profile=paper)
  timed = planner.step_time(spec, layout, batch=8, profile=cpu)
  fresh = mem.stash + mem.work + mem.outputs
  assert plain.alloc == 0.0 and mem.fresh == fresh < mem.total
  assert timed.alloc == pytest.approx(fresh / 2.0**30, rel=1e-12)
  assert timed.total == pytest.approx(plain.total + timed.alloc, rel=1e-12)
  one_rank = planner.Layout(2, 1, 1, 'one_f_one_b', 1)
  outputs = planner.memory(spec, one_rank, batch=8).outputs
  got = planner.step_time(spec, one_rank, batch=8, profile=cpu).alloc
  assert got == pytest.approx(outputs / 2.0**30, rel=1e-12)


def test_w_under_w_recompute_is_the_measured_r_or_i_plus_w():
  """With ``w_recompute`` a ``W`` re-runs ``I``'s chain: its cost is the
  profile's measured ``R`` block, or ``I + W`` where ``R`` was not
  measured (a profile's ``kind_factors`` of four)."""
  spec = planner.ModelSpec.from_gpt(CONFIG)
  profile = planner.PROFILES['H100-SXM']._replace(
      block_overhead=0.0, kind_factors=((64.0, (0.3, 0.4, 0.35, 0.7)),))
  layout = planner.Layout(1, 2, 1, 'zero_bubble_h1', 4, w_recompute=True)
  blocks = lambda x, p: planner.step_time(spec, x, batch=8,
                                          profile=p).blocks
  base = blocks(layout._replace(w_recompute=False), profile)
  fallback = blocks(layout, profile)
  measured = blocks(layout, profile._replace(
      kind_factors=((64.0, (0.3, 0.4, 0.35, 0.7, 0.5)),)))
  assert fallback['W'] - base['W'] == pytest.approx(base['I'], rel=1e-9)
  plain = base['F'] / 0.3   # F is 0.3 of the one-rank program here
  assert measured['W'] - base['W'] == pytest.approx((0.5 - 0.35) * plain,
                                                    rel=1e-9)
  assert profile.block_factors(64.0)['R'] == pytest.approx(0.75)
