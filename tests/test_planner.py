"""The layout planner (jaxpar.planner, ``jaxpar.plan``, ``python -m jaxpar
plan``): compiled memory by default, the ranking, the plan's trainer on the
model as written, bad input, the command line (predicted memory against
compiled steps: ``test_planner_memory.py``)."""

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
import jaxpar.cli
from jaxpar import planner
from jaxpar.cli import plan as plan_command
from jaxpar.models import gpt
from helpers import dense_of, tree_allclose

# Wide enough that the stashes are on the step's memory peak (with
# narrower ones the update's temporaries are, and no schedule changes it).
CONFIG = gpt.GPTConfig(vocab_size=32, seq_len=16, d_model=32, num_heads=4,
                       num_layers=2)
BATCH = 16


@pytest.fixture(scope='module')
def model():
  return gpt.GPT(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def batch():
  ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size,
                                          (BATCH, CONFIG.seq_len + 1))
  return ids[:, :-1].astype(np.int32), ids[:, 1:].astype(np.int32)


def test_compiled_memory_by_default_reranks(model, batch, monkeypatch):
  """With the devices here ``plan`` compiles by default: the best
  candidate's stage shape, then (ranked again) the best one's if it is not
  compiled yet. A shape whose step needs more than the cap gives way to
  the next, which is compiled in its turn; the plan's best is a compiled
  figure. On paper nothing is compiled."""
  from jaxpar.planner import _compile
  calls = []

  def step_bytes(src, devices, layout, optimizer, batch):
    calls.append(layout)   # the first shape compiles 10x its prediction
    return (10 if len(calls) == 1 else 1) * predicted[layout]
  monkeypatch.setattr(_compile, 'step_bytes', step_bytes)
  few = dict(batch=batch, devices=jax.devices()[:2], profile='H100-SXM',
             zero_stages=(0,), remat_policies=('dots',), max_microbatches=2)
  analytic = jaxpar.plan(model, **few, compile=0)
  predicted = {c.layout: c.memory_bytes for c in analytic.candidates}
  cap = 2 * analytic.best.memory_bytes
  plan = jaxpar.plan(model, **few, memory_per_device=cap)
  assert len(calls) == planner.DEFAULT_COMPILES == 2
  assert calls[0] == analytic.best.layout
  assert not next(c for c in plan.candidates
                  if c.layout == calls[0]).fits     # 10x: over the cap
  assert plan.best.compiled and plan.best.layout == calls[1]
  assert plan.best.memory_bytes == predicted[calls[1]]
  calls.clear()
  jaxpar.plan(model, **{**few, 'devices': 2})
  assert not calls


def test_a_stage_shape_runs_one_kind_of_backward():
  """A compiled step's work serves the candidates of its stage shape, which
  run the same kind of backward: interleaved v=2 and ZB-V at m=8 have the
  same 4 logical stages, but a fused ``B`` copies a slot's row (the 16:40
  planner run of 0.17.0's fix: interleaved took ZB-V's compiled work,
  140.6 MiB against 167.6 compiled); 1F1B's one weight slot takes ``I``'s
  ``kept`` in place, ZB-H1's two do not; the V schedules share."""
  from jaxpar.planner import _compile
  key = lambda name, **kw: _compile.shape_key(
      planner.Layout(1, 2, 1, name, 8, 0, 'dots', **kw))
  assert key('interleaved_one_f_one_b', virtual_stages=2) != key(
      'zero_bubble_v')
  assert key('one_f_one_b') != key('zero_bubble_h1')
  assert key('v_half') == key('zero_bubble_v') == key('dualpipe_v')


def test_a_compile_scales_only_the_candidates_like_it(model, batch,
                                                     monkeypatch):
  """A compiled shape whose temporaries are twice the analytic ones scales
  the candidates of its ``scale_group`` (pipelined or not, the same remat
  policy) not compiled, and leaves the others analytic."""
  from jaxpar.planner import _compile

  def step_bytes(src, devices, layout, optimizer, batch):
    mem = predicted[layout]
    return mem.total + mem.stash + mem.work      # twice the temporaries
  monkeypatch.setattr(_compile, 'step_bytes', step_bytes)
  few = dict(batch=batch, devices=jax.devices()[:2], profile='H100-SXM',
             zero_stages=(0,), remat_policies=('dots', 'nothing'),
             max_microbatches=2)
  analytic = jaxpar.plan(model, **few, compile=0)
  predicted = {c.layout: c.memory for c in analytic.candidates}
  plan = jaxpar.plan(model, **few, compile=1)
  group = _compile.scale_group(next(
      c for c in plan.candidates if c.compiled).layout)
  alike = [c for c in plan.candidates if not c.compiled
           and _compile.scale_group(c.layout) == group]
  others = [c for c in plan.candidates
            if _compile.scale_group(c.layout) != group]
  assert alike and others
  for c in alike:
    mem = predicted[c.layout]
    assert c.memory_bytes == pytest.approx(mem.total + mem.stash + mem.work,
                                           abs=2)
  assert all(c.memory == predicted[c.layout] for c in others)


def test_ranking_follows_the_time_model():
  """On paper (no devices): fewer bubbles rank first at equal work; the
  table names the layouts; the memory parts add up."""
  spec = planner.ModelSpec.from_gpt(gpt.GPTConfig(
      d_model=1024, num_heads=16, seq_len=1024, num_layers=8))
  plan = jaxpar.plan(spec, batch=64, devices=8, profile='H100-SXM',
                     remat_policies=('dots',), max_microbatches=8)
  times = {(c.layout.schedule_name): c.predicted_s for c in plan.candidates
           if c.layout[:3] == (2, 4, 1) and c.layout.num_microbatches == 8
           and c.layout.zero_stage == 0 and not c.layout.w_recompute}
  # The executor runs in lock step: a tick lasts its slowest action, so
  # 1F1B's mixed ticks can cost more than GPipe's; ZB-H1 beats both.
  assert times['zero_bubble_h1'] < min(times['one_f_one_b'], times['gpipe'])
  assert all(c.fits for c in plan.candidates[:10])
  assert [c.predicted_s for c in plan.candidates[:10]] == sorted(
      c.predicted_s for c in plan.candidates[:10])
  assert '1F1B' in str(plan) or 'ZB' in str(plan)
  mem = plan.best.memory
  assert mem.total == sum(mem) and plan.best.memory_bytes == mem.total


def test_fixed_costs_per_layer_tick_and_microbatch():
  """The profile's fixed costs enter as counted: ``block_overhead`` once per
  layer of a block, ``tick_overhead`` once per tick of the table (stage >
  1), ``microbatch_overhead`` once per microbatch of one stage rank; the
  measured rate at the microbatch's tokens, ``tensor_efficiency`` on the
  split FLOPs, ``block_shares`` splitting ``F + I + W`` (a tick lasts its
  slowest rank's block)."""
  spec = planner.ModelSpec.from_gpt(CONFIG)
  zero = planner.PROFILES['H100-SXM']._replace(
      block_overhead=0.0, tick_overhead=0.0, microbatch_overhead=0.0)
  delta = lambda layout, **cost: (
      planner.step_time(spec, layout, batch=BATCH,
                        profile=zero._replace(**cost)),
      planner.step_time(spec, layout, batch=BATCH, profile=zero))
  piped = planner.Layout(1, 2, 1, 'one_f_one_b', 4)
  ticks = jaxpar.pipeline.tick_table(jaxpar.pipeline.one_f_one_b(2, 4))
  more, base = delta(piped, tick_overhead=1e-3)
  assert more.pipeline - base.pipeline == pytest.approx(
      ticks.num_ticks * 1e-3)
  more, base = delta(piped, microbatch_overhead=1e-3)
  assert more.total == base.total            # a pipeline runs ticks
  single = planner.Layout(2, 1, 1, 'one_f_one_b', 4)
  more, base = delta(single, microbatch_overhead=1e-3)
  assert more.pipeline - base.pipeline == pytest.approx(4e-3)
  more, base = delta(single, block_overhead=1e-3)   # 2 layers per block
  assert more.blocks['F'] - base.blocks['F'] == pytest.approx(2e-3)
  more, base = delta(single, tensor_efficiency=0.5)  # nothing split
  assert more.total == base.total
  tokens = BATCH // (2 * 4) * CONFIG.seq_len        # per microbatch
  curve = zero._replace(block_rates=((tokens / 4, 1e9), (tokens * 4, 3e9)))
  measured = planner.step_time(spec, single, batch=BATCH, profile=curve)
  assert measured.blocks['F'] == pytest.approx(   # measured rate at tokens
      2 * spec.flops.per_device(1) * tokens / 2e9)
  split = planner.Layout(1, 1, 2, 'one_f_one_b', 4)
  slow, fast = delta(split, tensor_efficiency=0.5)
  act = BATCH // 4 * CONFIG.seq_len * CONFIG.d_model * spec.act_bytes
  tp = 2 * 2 * zero.collective('all-reduce', act, 2)   # 2 layers, 2 each
  assert slow.blocks['F'] - fast.blocks['F'] == pytest.approx(
      fast.blocks['F'] - tp)                     # the FLOPs' time doubles
  pipelined = lambda **kw: planner.step_time(
      spec, piped, batch=BATCH, profile=curve._replace(**kw)).blocks
  equal, shared = pipelined(), pipelined(block_shares=(0.2, 0.5, 0.3))
  assert [shared[k] for k in 'FIWB'] == pytest.approx(   # I the longest,
      [x * equal['F'] for x in (0.6, 1.5, 0.9, 2.4)], rel=1e-3)  # as here
  factors = pipelined(kind_factors=((tokens, (0.4, 0.7, 0.5, 0.9)),))
  assert [factors[k] for k in 'FIWB'] == pytest.approx(  # measured apart:
      [x * 3 * equal['F'] for x in (0.4, 0.7, 0.5, 0.9)], rel=1e-3)
  one = planner.step_time(spec, single, batch=BATCH, profile=curve._replace(
      kind_factors=((tokens, (0.4, 0.7, 0.5, 0.9)),))).blocks
  assert one['F'] + one['B'] == pytest.approx(   # one rank: the plain
      one['F'] + one['I'] + one['W'])             # program, however cut
  assert one['F'] == pytest.approx(measured.blocks['F'])
  head = lambda **kw: planner.step_time(spec, single, batch=BATCH,
                                        profile=curve._replace(**kw))
  line = head(head_seconds=((tokens / 2, 1e-3), (tokens * 2, 4e-3)))
  assert line.pipeline - head().pipeline == pytest.approx(  # 4 microbatches
      4 * (2e-3 - 3 * spec.head_flops.per_device(1) * tokens / 2e9))
  lock = lambda shares: planner.step_time(spec, piped, batch=BATCH,
                                          profile=zero._replace(
                                              block_shares=shares)).pipeline
  assert lock((0.2, 0.5, 0.3)) > lock((1 / 3, 1 / 3, 1 / 3))  # ticks wait


def test_tensor_shares_are_the_share_of_the_ideal_speed_up(monkeypatch):
  """``measure_profile``'s tensor shares: a stage split over 2 devices
  that takes as long as on one device (its all-reduces taken out) reaches
  0.5 of the ideal speed-up, at each size timed; one device measures
  nothing; the step's blocks read the share at their tokens."""
  from jaxpar.planner import _calibrate
  spec = planner.ModelSpec.from_gpt(CONFIG)
  probe = planner.Profile('probe', 1e9, 1.0, 1e9, 1e9, 1e-5)
  comm = lambda rows: 4 * 2 * probe.collective(   # 2 layers, 4 per layer
      'all-reduce', rows * CONFIG.seq_len * CONFIG.d_model * 4, 2)
  monkeypatch.setattr(_calibrate, '_block_seconds', lambda s, devices, rows,
                      *a: 0.1 * rows + (comm(rows) if len(devices) == 2
                                        else 0.0))
  two = jax.devices()[:2]
  shares = _calibrate._tensor_shares(spec, two[0], two, probe, 1)
  assert [t for t, _ in shares] == [r * CONFIG.seq_len
                                    for r in _calibrate._TENSOR_ROWS]
  assert [x for _, x in shares] == pytest.approx([0.5] * len(shares))
  assert _calibrate._tensor_shares(spec, two[0], two[:1], probe, 1) == ()
  split = planner.Layout(1, 1, 2, 'one_f_one_b', 4)
  tokens = BATCH // 4 * CONFIG.seq_len
  paper = planner.PROFILES['H100-SXM']
  at = lambda **kw: planner.step_time(
      spec, split, batch=BATCH, profile=paper._replace(**kw)).blocks['F']
  assert at(tensor_shares=((tokens / 2, 0.2), (tokens * 2, 0.6))) == (
      pytest.approx(at(tensor_efficiency=0.4)))   # log-midway: 0.4


def test_one_stage_rank_reads_the_policy_timed_not_its_recompute():
  """With ``policy_factors`` measured, one stage rank's blocks are the
  one-rank program under the policy (``'dots'`` times the factor; no
  forward again for ``'nothing'``); not measured, ``'nothing'`` adds the
  forward; a pipeline's blocks count the recompute either way."""
  spec = planner.ModelSpec.from_gpt(CONFIG)
  paper = planner.PROFILES['H100-SXM']._replace(block_overhead=0.0)
  timed = paper._replace(policy_factors=((1.0, (1.1, 1.3)),))
  blocks = lambda layout, profile: planner.step_time(
      spec, layout, batch=BATCH, profile=profile).blocks
  one = lambda policy: planner.Layout(2, 1, 1, 'one_f_one_b', 4,
                                      remat_policy=policy)
  dots = blocks(one('dots'), paper)
  for policy, factor in (('nothing', 1.1), ('everything', 1.3)):
    assert blocks(one(policy), timed)['F'] == pytest.approx(
        factor * dots['F'])
    assert blocks(one(policy), timed)['I'] == pytest.approx(
        factor * dots['I'])
  assert blocks(one('nothing'), paper)['I'] == pytest.approx(
      dots['I'] + dots['F'])
  piped = planner.Layout(1, 2, 1, 'one_f_one_b', 4, remat_policy='nothing')
  assert blocks(piped, timed) == blocks(piped, paper)


def test_the_large_microbatch_blocks_are_timed_inside_a_step(monkeypatch):
  """With 2 devices the blocks at the larger size timed are their seconds
  inside a 2-rank step (``_in_step.in_step_costs``) per second of the
  one-rank program, ``R`` scaled as ``W``; the smaller size stays apart;
  the 2-rank costs are what a real step's timeline measures (each > 0)."""
  from jaxpar.planner import _calibrate, _in_step
  spec = planner.ModelSpec.from_gpt(CONFIG)
  apart = ((16.0, (0.3, 0.4, 0.3, 0.7, 0.8)),
           (256.0, (0.25, 0.4, 0.35, 0.7, 0.6)))
  seen = []

  def costs(stage_fn, stage, devices, x, *, repeats, specs):
    seen.append(x.shape)
    return {'F': 0.3, 'I': 0.4, 'W': 0.5, 'B': 0.8}
  monkeypatch.setattr(_calibrate, 'in_step_costs', costs)
  monkeypatch.setattr(_calibrate, '_block_seconds', lambda *a: 1.0)
  two = jax.devices()[:2]
  got = _calibrate._in_step_factors(spec, two[0], two, apart, 1)
  assert seen == [(_calibrate._FACTOR_ROWS[-1], CONFIG.seq_len,
                   CONFIG.d_model)]
  assert got[0] == apart[0]
  assert got[1][0] == 256.0
  assert got[1][1] == pytest.approx((0.3, 0.4, 0.5, 0.8, 0.6 * 0.5 / 0.35))
  stage = _calibrate._host_stage(spec)[1]
  real = _in_step.in_step_costs(
      gpt.stage_fn, stage, two,
      np.ones((2, CONFIG.seq_len, CONFIG.d_model), np.float32), repeats=1,
      specs=jaxpar.tensor_parallel.param_specs(stage, rules=gpt.TENSOR_RULES))
  assert sorted(real) == ['B', 'F', 'I', 'W'] and min(real.values()) > 0


def test_nothing_fits_names_the_smallest_need_and_the_fixes():
  with pytest.raises(ValueError, match=r'(?s)smallest.*needs .*GiB.*more '
                     r'devices.*zero_stage 3.*remat_policy'):
    jaxpar.plan(CONFIG, batch=BATCH, devices=8, profile='H100-SXM',
                memory_per_device=1000)


def test_bad_input():
  with pytest.raises(ValueError, match='profile'):
    jaxpar.plan(CONFIG, batch=BATCH, devices=8)        # no devices, no profile
  with pytest.raises(ValueError, match='not one of'):
    jaxpar.plan(CONFIG, batch=BATCH, devices=8, profile='TPU-v9')
  with pytest.raises(TypeError, match='model must be'):
    jaxpar.plan('gpt', batch=BATCH, devices=8, profile='H100-SXM')
  with pytest.raises(ValueError, match=r'search=-1 must be an int >= 0'):
    jaxpar.plan(CONFIG, batch=BATCH, devices=8, profile='H100-SXM', search=-1)


@pytest.mark.parametrize('options, error, match', [
    ({'zero_stages': [2]}, ValueError, r'holds 2: .*ZeRO stages \(0, 1, 3\)'),
    ({'zero_stages': [5]}, ValueError, r'holds 5: .*pass a subset'),
    ({'zero_stages': [-1]}, ValueError, r'holds -1'),
    ({'zero_stages': ['x']}, TypeError, r"holds 'x', a str: .*\(0, 1, 3\)"),
    ({'zero_stages': 1}, TypeError, r'must be a sequence'),
    ({'remat_policies': ['bogus']}, ValueError,
     r"'bogus', not a remat policy.*REMAT_POLICIES, \('everything', 'dots'"),
    ({'remat_policies': 'dots'}, TypeError, r"e.g. remat_policies=\('dots'"),
    ({'memory_per_device': -1}, ValueError, r'=-1 must be a positive finite'),
    ({'memory_per_device': 0}, ValueError, r'=0 must be a positive finite'),
    ({'memory_per_device': float('nan')}, ValueError, r'=nan must be a pos'),
    ({'memory_per_device': '2 parsecs'}, ValueError, r"not a size: .*'80GiB'"),
    ({'memory_per_device': [1]}, TypeError, r'must be bytes, got a list'),
    ({'max_microbatches': 0}, ValueError, r'max_microbatches=0 must be an '
     r'int >= 1'),
    ({'batch': 0}, ValueError, r'batch=0 sequences: a step needs at least'),
    ({'compile': -1}, ValueError, r'compile=-1 must be an int >= 0'),
])
def test_bad_input_names_its_cause(options, error, match):
  """Each bad argument is refused before any work, by a message naming the
  value, the rule and the fix (never the batch for another cause)."""
  with pytest.raises(error, match=match):
    jaxpar.plan(CONFIG, **{'batch': BATCH, **options}, devices=8,
                profile='H100-SXM')


def test_bad_input_of_the_model_names_the_layers():
  """A 1-layer model with ``where=stage > 1`` is refused for its layers;
  a size string is a cap; data-parallel rows have no schedule."""
  one = CONFIG._replace(num_layers=1)
  with pytest.raises(ValueError, match=r'1 layer\(s\), so stage is at most '
                     r'1.*meshes data x stage x tensor are 2x1x4, 4x1x2, 8x1x1'):
    jaxpar.plan(one, batch=BATCH, devices=8, profile='H100-SXM',
                where=lambda x: x.stage > 1)
  with pytest.raises(ValueError, match=r'with batch 3: a mesh needs data '
                     r'dividing the batch.*none does'):
    jaxpar.plan(one, batch=3, devices=8, profile='H100-SXM')
  plan = jaxpar.plan(CONFIG, batch=BATCH, devices=8, profile='H100-SXM',
                     memory_per_device='2GiB')
  assert plan.memory_per_device == 2 * 2**30
  rows = plan.rows()
  assert {r['schedule'] for r in rows if r['stage'] == 1} == {'-'}
  assert all(' - m=' in c.layout.describe() for c in plan.candidates
             if c.layout.stage == 1)


def test_measure_spreads_over_the_predicted_range():
  """``measure`` times the best, then evenly spaced places of the ranking
  up to ``SPREAD`` x the best's time, one per mesh, schedule and
  microbatch count where it can; ``summary`` gives the mean absolute
  error and Spearman."""
  from jaxpar.planner import _measure
  spec = planner.ModelSpec.from_gpt(CONFIG)
  plan = jaxpar.plan(spec, batch=BATCH, devices=8, profile='H100-SXM',
                     remat_policies=('dots', 'nothing'), compile=0)
  fits = [c for c in plan.candidates if c.fits]
  top = min(c.predicted_s for c in fits)
  chosen = _measure._spread(plan.candidates, 6)
  assert len(chosen) == 6 and chosen[0].predicted_s == top
  assert len({c.layout[:5] for c in chosen}) == 6
  inside = [c.predicted_s for c in fits
            if c.predicted_s <= _measure.SPREAD * top]
  assert chosen[-1].predicted_s > np.quantile(inside, 0.9)  # the far end
  rows = [planner.Measured(c, 2 * c.predicted_s, 1) for c in chosen]
  out = planner.summary(rows)
  assert out['mean_abs_error'] == pytest.approx(0.5)
  assert out['spearman'] == pytest.approx(1.0)
  assert out['best_vs_fastest'] == 0.0


def test_measure_predicts_again_at_the_block_rates_timed_beside_the_steps(
    batch, monkeypatch):
  """Each round of ``measure`` times the calibration's one-rank programs
  (``block_calls``) again: where they run twice as long as when the
  profile was measured, each row's ``retimed_s`` is the plan's
  ``step_time`` at half the block rates, and ``summary`` gives its error."""
  from jaxpar.planner import _calibrate, _measure
  spec = planner.ModelSpec.from_gpt(CONFIG)
  calibrated = planner.PROFILES['H100-SXM']._replace(
      name='measured (test)', block_rates=_calibrate.block_rates(
          spec, [0.01] * 6))
  plan = jaxpar.plan(CONFIG, batch=BATCH, devices=jax.devices()[:2],
                     profile=calibrated, compile=0, zero_stages=(0,),
                     remat_policies=('dots',), max_microbatches=2,
                     where=lambda x: x.data == 2 and x.num_microbatches == 1)
  monkeypatch.setattr(_calibrate, 'block_calls', lambda spec, device: [
      (functools.partial(time.sleep, 0.02), 1)] * 6)
  measured = planner.measure(plan, 1, optax.sgd(0.1), batch, repeats=3)
  slower = calibrated._replace(block_rates=_calibrate.block_rates(
      spec, [0.02] * 6))
  for m in measured:
    again = planner.step_time(spec, m.candidate.layout, batch=BATCH,
                              profile=slower).total
    assert m.retimed_s == pytest.approx(again, rel=0.1)
    assert m.retimed_s > 1.5 * m.candidate.predicted_s
  out = planner.summary(measured)
  assert out['mean_abs_retimed_error'] == pytest.approx(np.mean(
      [abs(m.retimed_s / m.seconds - 1) for m in measured]))
  named = plan._replace(profile=planner.PROFILES['H100-SXM'])
  assert _measure._block_calls(named) == []    # no rates measured


def test_spearman():
  assert planner.spearman([1, 2, 3], [5, 6, 7]) == pytest.approx(1.0)
  assert planner.spearman([1, 2, 3], [7, 6, 5]) == pytest.approx(-1.0)


def test_cli_plan_writes_the_table_and_json(capfd, tmp_path):
  out = tmp_path / 'plan.json'
  capfd.readouterr()
  small = ['--devices', '8', '--layers', '4', '--d-model', '64', '--batch',
           '16', '--profile', 'H100-SXM']
  code = plan_command.main([*small, '--memory', '2GiB', '--json', str(out)])
  text, err = capfd.readouterr()
  assert code == 0, err
  assert text.splitlines()[0].split()[:3] == ['#', 'd', 'x']
  saved = json.loads(out.read_text())
  assert saved['rows'][0]['fits'] and saved['rows'][0]['rank'] == 1
  assert saved['memory_per_device'] == 2 * 2**30
  code = plan_command.main([*small, '--memory', '1KiB'])
  assert code == 2 and 'smallest' in capfd.readouterr().err
  wide = ['--devices', '4', '--layers', '8', '--d-model', '1024', '--heads',
          '16', '--seq-len', '1024', '--batch', '16', '--profile', 'H100-SXM']
  searched = []
  for k in (0, 1):
    assert plan_command.main([*wide, '--search', str(k), '--json',
                              str(out)]) == 0
    searched.append([r['schedule'] for r in json.loads(out.read_text())[
        'rows'] if r['schedule'].startswith('Search(memory=')])
  assert searched[0] == [] and len(searched[1]) == 1
  with pytest.raises(SystemExit):
    plan_command.main([*small, '--search', '-1'])
  assert '--search must be >= 0' in capfd.readouterr().err
  with pytest.raises(SystemExit) as exit_:
    jaxpar.cli.main(['plan', '--help'])
  assert exit_.value.code == 0
  assert 'usage: python -m jaxpar plan' in capfd.readouterr().out
  with pytest.raises(SystemExit):
    jaxpar.cli.main(['--help'])
  assert 'plan' in capfd.readouterr().out


class _Block(nnx.Module):
  def __init__(self, rngs, dtype=jnp.float32):
    self.norm = nnx.RMSNorm(8, param_dtype=dtype, rngs=rngs)
    self.mlp = nnx.Linear(8, 8, param_dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return x + self.mlp(self.norm(x))


class _Net(nnx.Module):
  def __init__(self, rngs, dtype=jnp.float32):
    self.embed = nnx.Embed(16, 8, param_dtype=dtype, rngs=rngs)
    self.layers = nnx.List([_Block(rngs, dtype) for _ in range(4)])
    self.out = nnx.Linear(8, 16, param_dtype=dtype, rngs=rngs)


def _head_loss(m, y, t):
  return optax.losses.softmax_cross_entropy_with_integer_labels(
      m.out(y), t).mean()


def _as_written(net, ids, targets):
  """The loss of ``_Net`` as its author runs it, on one device."""
  x = net.embed(ids)
  for block in net.layers:
    x = block(x)
  return _head_loss(net, x, targets)


def _plan_net(net, ids, **options):
  return jaxpar.plan(
      net, optax.sgd(0.1), profile='H100-SXM', blocks='layers',
      embed=lambda m, x: m.embed(x), head_loss=_head_loss,
      **{'devices': jax.devices(), 'batch': (ids, ids), 'compile': 0,
         **options})


def test_an_nnx_model_is_planned_through_from_nnx():
  net = _Net(nnx.Rngs(0))
  ids = np.zeros((8, 4), np.int32)
  plan = _plan_net(net, ids)
  assert plan.spec.num_layers == 4 and plan.spec.tensor_sizes(8) == (1,)
  assert plan.spec.num_params == sum(
      x.size for x in jax.tree.leaves(nnx.state(net, nnx.Param)))
  layout = plan.best.layout
  assert layout.tensor == 1
  params = plan.params()
  assert params.stages['mlp']['kernel'].shape[0] == layout.num_stages
  plan.trainer(optax.sgd(0.1))    # builds; the GPT's trainer runs above


def test_a_pipeline_model_is_planned_for_its_own_cut():
  """A ``PipelineModel`` is cut already: only layouts with its logical
  stage count (its params as they are); another cut is refused."""
  net = _Net(nnx.Rngs(0))
  ids = np.zeros((8, 4), np.int32)
  pm = jaxpar.parallel.from_nnx(net, blocks='layers', num_stages=2,
                                embed=lambda m, x: m.embed(x),
                                head_loss=_head_loss)
  plan = jaxpar.plan(pm, optax.sgd(0.1), batch=(ids, ids),
                     devices=jax.devices(), profile='H100-SXM', compile=0)
  assert {c.layout.num_stages for c in plan.candidates} == {2}
  assert plan.params() is pm.params
  with pytest.raises(ValueError, match='cut for 2 logical stages, not 4'):
    plan.source.pipeline(4)
  with pytest.raises(ValueError, match="PipelineModel's cut"):
    jaxpar.plan(pm, batch=(ids, ids), devices=jax.devices(),
                profile='H100-SXM', where=lambda x: x.num_stages == 4,
                compile=0)


class _NormedBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.BatchNorm(8, use_running_average=False, rngs=rngs)
    self.mlp = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return x + self.mlp(self.norm(x))


def test_plan_gives_the_model_state_of_its_cut():
  """An NNX model's BatchNorm statistics come split like the params:
  ``trainer.init(plan.params(), plan.model_state())`` trains the model as
  written (one microbatch, no data split: the whole batch's statistics),
  its loss and running statistics those of the model on one device. The
  GPT has none."""
  net = _Net(nnx.Rngs(0))
  net.layers = nnx.List([_NormedBlock(nnx.Rngs(i)) for i in range(4)])
  rng = np.random.default_rng(0)
  ids, targets = (rng.integers(0, 16, (8, 4)).astype(np.int32)
                  for _ in range(2))
  plan = _plan_net(net, ids, devices=jax.devices()[:2], where=lambda x: (
      x.data, x.num_microbatches) == (1, 1))
  assert plan.best.layout.num_stages == 2
  stats = plan.model_state()
  assert stats.stages['norm']['mean'].shape == (2, 2, 8)
  trainer = plan.trainer(optax.sgd(0.1))
  state, got = trainer.step(trainer.init(plan.params(), stats),
                            (ids, targets))
  want = _as_written(net, ids, targets)     # updates net's running stats
  np.testing.assert_allclose(got.loss, want, rtol=1e-5)
  mean = np.asarray(state.model_state.stages['norm']['mean'])
  for i, block in enumerate(net.layers):
    np.testing.assert_allclose(mean[i // 2, i % 2], block.norm.mean.get_value(),
                               rtol=1e-5, atol=1e-7)
  assert jaxpar.plan(CONFIG, batch=BATCH, devices=jax.devices(),
                     profile='H100-SXM', compile=0).model_state() is None


def test_a_searched_schedule_is_a_candidate(model, batch):
  """With ``F``, ``I`` and ``W`` of unequal cost (a CPU's shares),
  ``pipeline.search`` finds a schedule of the 4x2x1 mesh with 4
  microbatches that no constructor builds (it wins in its event-driven
  simulation): the plan adds it, ranked by the same lock-step model as the
  built-ins (its stash slots counted as theirs are), and its trainer gives
  the loss and gradients of the model as written (``test_search`` holds
  searched schedules exact in the executor)."""
  profile = planner.PROFILES['H100-SXM']._replace(
      block_shares=(0.28, 0.4, 0.32))
  plan = jaxpar.plan(
      model, optax.sgd(1.0), batch=batch, devices=jax.devices(),
      profile=profile, remat_policies=('dots',), zero_stages=(0,),
      where=lambda x: (x.data, x.stage, x.tensor, x.num_microbatches) == (
          4, 2, 1, 4), search=1, compile=0)
  best = next(c for c in plan.candidates
              if c.layout.schedule_name == 'search')
  assert best.layout.schedule().name.startswith('Search(memory=')
  assert best.fits and best.layout.w_recompute is False
  trainer = plan.trainer(optax.sgd(1.0), best)
  new, stats = trainer.step(trainer.init(plan.params(best)), batch)
  params = gpt.gpt_params(model)
  want, grads = jax.jit(jax.value_and_grad(gpt.gpt_loss),
                        static_argnames='config')(params, batch,
                                                  config=CONFIG)
  np.testing.assert_allclose(stats.loss, want, rtol=1e-5)
  _, split = gpt.split_for_pipeline(params, num_stages=best.layout.num_stages)
  stepped = dense_of(trainer, new, split)   # sgd(1): params - grads
  tree_allclose(stepped, jax.tree.map(lambda p, g: p - g, params, grads),
                rtol=1e-5, atol=1e-6)


def _normed_net():
  net = _Net(nnx.Rngs(0))
  net.layers = nnx.List([_NormedBlock(nnx.Rngs(i)) for i in range(4)])
  return net


def test_batch_statistics_mark_the_layouts_that_change_the_model():
  """An unsynced BatchNorm normalises what one device runs at once: the
  layouts that split the batch (over data or microbatches) are marked, in
  ``Candidate.changes`` and the table, and rank after the ones that compute
  the model as written unless ``prefer_as_written=False``."""
  ids = np.zeros((8, 4), np.int32)
  few = dict(devices=jax.devices()[:2], compile=0, max_microbatches=2,
             remat_policies=('dots',))
  plan = _plan_net(_normed_net(), ids, **few)
  for c in plan.candidates:
    split = c.layout.data * c.layout.num_microbatches
    assert c.as_written == (split == 1), c.layout
    assert c.changes == ('' if split == 1 else
                         f'BatchNorm statistics over {8 // split} of 8 rows')
  assert plan.best.as_written
  table = plan.table(len(plan.candidates))
  assert 'BatchNorm statistics over 4 of 8 rows' in table   # m=2 or d=2
  assert plan.rows()[-1]['changes'] == plan.candidates[-1].changes
  fastest = _plan_net(_normed_net(), ids, **few, prefer_as_written=False)
  assert fastest.best.predicted_s == min(c.predicted_s
                                         for c in fastest.candidates)
  assert not fastest.best.as_written
  plain = _plan_net(_Net(nnx.Rngs(0)), ids, **few)
  assert all(c.as_written for c in plain.candidates)


# Megatron's MLP split for _Block: the output features over tensor.
_RULES = {'mlp/kernel': (None, 'tensor'), 'mlp/bias': ('tensor',)}


def _check_one_step(plan, net, batch, layout):
  """``layout``'s trainer from ``plan``: one SGD(1) step gives the loss and
  the params of the model as written on one device (float64)."""
  candidate = next(c for c in plan.candidates if c.layout == layout)
  trainer = plan.trainer(optax.sgd(1.0), candidate)
  new, stats = trainer.step(trainer.init(plan.params(candidate)), batch)
  graphdef, params = nnx.split(net, nnx.Param)
  loss, grads = jax.value_and_grad(
      lambda p: _as_written(nnx.merge(graphdef, p), *batch))(params)
  np.testing.assert_allclose(stats.loss, loss, rtol=1e-10)
  pm = plan.source.pipeline(layout.num_stages)[1]
  got = nnx.to_pure_dict(pm.to_state(jax.device_get(trainer.params(new))))
  want = jax.tree.map(lambda p, g: p - g, nnx.to_pure_dict(params),
                      nnx.to_pure_dict(grads))
  tree_allclose(got, want)


def test_tensor_rules_give_a_model_its_tensor_candidates(x64):
  """``tensor_rules`` as ``from_nnx`` takes them: a model without Flax
  sharding metadata gets ``tensor`` candidates (the split dims' sizes
  divide), and the plan's tensor-parallel layout trains it as written."""
  net = _Net(nnx.Rngs(0), jnp.float64)
  rng = np.random.default_rng(1)
  batch = tuple(rng.integers(0, 16, (8, 4)).astype(np.int32)
                for _ in range(2))
  plan = _plan_net(net, batch[0], tensor_rules=_RULES, compile=0,
                   devices=jax.devices()[:4], batch=batch, max_microbatches=2,
                   remat_policies=('dots',), zero_stages=(0,))
  assert plan.spec.tensor_sizes(8) == (1, 2, 4, 8)
  assert plan.spec.layer.split == 8 * 8 + 8
  split = {c.layout.tensor for c in plan.candidates}
  assert split == {1, 2, 4}
  _check_one_step(plan, net, batch, planner.Layout(1, 2, 2, 'one_f_one_b',
                                                   2))
  with pytest.raises(ValueError, match='tensor_rules are for a Flax NNX'):
    jaxpar.plan(CONFIG, batch=BATCH, devices=8, profile='H100-SXM',
                tensor_rules=_RULES)


_FACTORY = '''
import jax.numpy as jnp, numpy as np, optax
from flax import nnx

class Block(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.RMSNorm(8, param_dtype=jnp.float64, rngs=rngs)
    self.mlp = nnx.Linear(8, 8, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    return x + self.mlp(self.norm(x))

class Net(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(16, 8, param_dtype=jnp.float64, rngs=rngs)
    self.layers = nnx.List([Block(rngs) for _ in range(4)])
    self.out = nnx.Linear(8, 16, param_dtype=jnp.float64, rngs=rngs)

def head_loss(m, y, t):
  return optax.losses.softmax_cross_entropy_with_integer_labels(
      m.out(y), t).mean()

def factory():
  ids = np.random.default_rng(1).integers(0, 16, (8, 5)).astype(np.int32)
  return dict(model=Net(nnx.Rngs(0)), batch=(ids[:, :-1], ids[:, 1:]),
              blocks='layers', embed=lambda m, x: m.embed(x),
              head_loss=head_loss, optimizer=optax.sgd(1.0),
              tensor_rules={'mlp/kernel': (None, 'tensor')})
'''


def test_cli_plans_a_model_of_your_own(x64, capfd, tmp_path):
  """``python -m jaxpar plan --model FILE.py:factory`` plans the factory's
  NNX model (its tensor rules give tensor candidates); the same keywords
  give ``jaxpar.plan`` a plan whose best layout trains it as written; a
  factory of the wrong kind, or GPT flags beside it, are refused."""
  path = tmp_path / 'my_model.py'
  path.write_text(_FACTORY)
  out = tmp_path / 'plan.json'
  spec = f'{path}:factory'
  capfd.readouterr()
  code = plan_command.main(['--model', spec, '--devices', '4', '--profile',
                            'H100-SXM', '--json', str(out)])
  assert code == 0, capfd.readouterr().err
  rows = json.loads(out.read_text())['rows']
  assert {r['tensor'] for r in rows} == {1, 2, 4}
  kw = plan_command.load_factory(spec)
  plan = jaxpar.plan(**kw, devices=jax.devices()[:4], profile='H100-SXM',
                     compile=0)
  best = plan.rows(1)[0]
  assert {k: best[k] for k in rows[0]} == rows[0]     # the CLI's plan
  _check_one_step(plan, kw['model'], kw['batch'], plan.best.layout)
  path.write_text(_FACTORY + '\ndef bad():\n  return 3\n')
  assert plan_command.main(['--model', f'{path}:bad', '--devices', '4',
                            '--profile', 'H100-SXM']) == 2
  assert "must return a dict of jaxpar.plan keywords" in capfd.readouterr().err
  with pytest.raises(SystemExit):
    plan_command.main(['--model', spec, '--layers', '4'])
  assert 'leave out the GPT flags --layers' in capfd.readouterr().err
