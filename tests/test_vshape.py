"""DualPipeV, V-Half, V-Min: orders, the papers' formulas, exactness."""

import pytest

from jaxpar import pipeline as pp
from jaxpar.pipeline.schedules import _building_block as building_block
from jaxpar.pipeline.schedules import _plot as plot_module
from helpers import (MB, NAN, loss_fn, mesh_for, model, reference, stage_fn,
                     tree_allclose)

UNIFORM = {'F': 1, 'I': 1, 'W': 1, 'B': 2}  # per logical stage


def v(p):
  return tuple(list(range(p)) + list(range(p - 1, -1, -1)))


@pytest.mark.parametrize('build', [pp.dualpipe_v, pp.v_half, pp.v_min])
@pytest.mark.parametrize('p, m', [(1, 1), (1, 3), (2, 1), (2, 4), (3, 5),
                                  (4, 8), (5, 13)])
def test_v_schedules_validate_on_a_v(build, p, m):
  s = build(p, m).validate()
  assert (s.num_ranks, s.num_stages, s.num_microbatches) == (p, 2 * p, m)
  assert s.placement == v(p)
  assert {a.kind for row in s.actions for a in row} <= set('FBIW')


def test_dualpipe_v_follows_deepseeks_eight_steps():
  # p=2, m=4, rank 0 (stages 0 and 3): 2(p-r-1)=2 F0; r+1=1 pair F0 F1;
  # p-r-1=1 triple I1 W1 F1; m-2p+r+1=1 round F0 B1 F1 B0; 1 round B1 F1 B0;
  # r+1=1 pair B1 B0 (rank 0 even: B0 split); 1 pair W I0; the last W.
  s = pp.dualpipe_v(2, 4)
  assert [str(a) for a in s.actions[0]] == (
      '0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 '
      '0W2 0I3 0W3').split()
  # Rank 1 (the turn of the V) has no step 1, 3, 5 or 7.
  assert [str(a) for a in s.actions[1]] == (
      '1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 '
      '1W3').split()


@pytest.mark.parametrize('p, m', [(2, 4), (3, 6), (4, 8), (4, 13), (6, 12)])
def test_dualpipe_v_bubble_and_memory_formulas(p, m):
  s = pp.dualpipe_v(p, m)
  # Bubble: the V sends microbatch 0 through 2p stages before rank 0 can
  # start a backward; every rank is busy 6m (2 F, 2 I, 2 W per microbatch at
  # F = I = W = 1) and idles exactly the p-1 forward hops its V-partner does
  # not cover: makespan 6m + p - 1 (as ZB-V).
  r = s.simulate(UNIFORM)
  assert r.busy == (6.0 * m,) * p
  assert r.bubble == (p - 1.0,) * p
  assert r.makespan == 6 * m + p - 1
  # 1F1B on the same model (a 1F1B stage = two logical stages: F=2, B=4)
  # idles (p-1)(F+B) = 6(p-1) per rank: DualPipeV cuts it 6x.
  one = pp.one_f_one_b(p, m).simulate({'F': 2, 'B': 4})
  assert one.bubble[0] == 6 * (p - 1) == 6 * r.bubble[0]
  # Memory: DualPipe's PP+1 activations with PP = 2p logical stages: rank r
  # stashes its 2(p-r-1) + 2(r+1) warm-up forwards plus one main-step F0.
  assert pp.peak_memory(s) == ((2 * p + 1) / 2,) * p


@pytest.mark.parametrize('p', [2, 3, 4, 5, 6, 8])
def test_v_half_and_v_min_memory_is_the_papers(p):
  # Qi et al. 2024, table 1: V-Half (p+2)//2, V-Min (p+4)//3 microbatches of
  # 1F1B-stage activations, against p for 1F1B (stashes held until W).
  for m in (p, 4 * p):
    assert max(pp.peak_memory(pp.v_half(p, m))) == (p + 2) // 2
    assert max(pp.peak_memory(pp.v_min(p, m))) == (p + 4) // 3
    assert max(pp.peak_memory(pp.one_f_one_b(p, m))) == p


@pytest.mark.parametrize('block', [building_block.v_half_block,
                                   building_block.v_min_block])
def test_building_blocks_tile_the_steady_state(block):
  # Repeated every 6 slots, a block's four passes and the two W that fill
  # its gaps leave no slot empty: the passes fall on distinct slots mod 6.
  for p in range(1, 13):
    for first in block(p):
      assert len({t % 6 for t in first}) == 4, (p, first)
  # So in the middle of a long run every rank is busy in every slot.
  p, m = 4, 24
  s = pp.v_min(p, m) if block is building_block.v_min_block else pp.v_half(
      p, m)
  start = s.simulate(UNIFORM).start
  for row in s.actions:
    times = sorted(start[a] for a in row)
    middle = times[len(times) // 3: 2 * len(times) // 3]
    assert middle == list(range(int(middle[0]), int(middle[0]) + len(middle)))


@pytest.mark.parametrize('p', [2, 3, 4, 5, 6, 7, 8])
def test_bubbles_are_the_papers_and_below_1f1bs(p):
  # Qi et al. 2024, table 1, F = I = W = 1 per logical stage (one slot):
  # bubble rate ~ p/(2m) for V-Half and ~ 2p/(3m) for V-Min of the 6m slots
  # a rank is busy, i.e. about 3p and 4p idle slots, against 1F1B's
  # (p-1)(F+B) = 6(p-1) slots (a 1F1B stage is two logical stages). The
  # warm-up and cool-down shave a few slots off the paper's estimate.
  for m in (2 * p, 4 * p):
    half = pp.v_half(p, m).simulate(UNIFORM).makespan - 6 * m
    least = pp.v_min(p, m).simulate(UNIFORM).makespan - 6 * m
    assert 3 * p - 7 <= half <= 3 * p
    assert 4 * p - 7 <= least <= 4 * p
    assert half <= least < 6 * (p - 1)
  # Never slower than 1F1B, also for few microbatches (F = 1, B = 2).
  for m in range(1, p + 2):
    one = pp.one_f_one_b(p, m).simulate({'F': 1, 'B': 2}).makespan
    for build in (pp.v_half, pp.v_min):
      assert build(p, m).simulate({'F': .5, 'I': .5, 'W': .5}).makespan <= one


@pytest.mark.parametrize('build, p, m', [
    (pp.dualpipe_v, 2, 4), (pp.dualpipe_v, 2, 3), (pp.v_half, 2, 4),
    (pp.v_min, 2, 3), (pp.dualpipe_v, 4, 8)])
def test_exact_in_the_executor(x64, build, p, m):
  schedule = build(p, m)
  args = model(schedule.num_stages, m * MB)
  step = pp.pipeline_value_and_grad(stage_fn, loss_fn, schedule=schedule,
                          mesh=mesh_for(p), bubble_fill=NAN)
  out = step(*args)
  tree_allclose((out.loss, out.grads[:3]), reference(*args, m), rtol=1e-10,
                atol_scale='leaf')


def test_bad_sizes():
  with pytest.raises(ValueError, match=r'dualpipe_v\(.*num_ranks=0 must be'):
    pp.dualpipe_v(0, 4)
  with pytest.raises(TypeError, match='must be an int'):
    pp.v_half(2.0, 4)
  with pytest.raises(ValueError, match='num_microbatches=0'):
    pp.v_min(2, 0)


def test_plot_frames_the_f_and_b_pairs():
  import matplotlib
  matplotlib.use('Agg')
  s = pp.dualpipe_v(2, 4)
  pairs = plot_module.fb_pairs(s)
  # Steps 4 and 5 of each rank: F0&B1, F1&B0 per main-step round, F1&B0
  # per step-5 round: rank 0 has 2 + 1, rank 1 has 2 * 2 + 0.
  assert len(pairs) == 7
  assert all(f.kind == 'F' and b.kind == 'B' and f.stage != b.stage
             for f, b in pairs)
  ax = s.plot().axes[0]
  assert len(ax.collections) == sum(map(len, s.actions)) + len(pairs)
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  assert labels == ['F', 'B', 'I', 'W', 'F&B']
  assert plot_module.fb_pairs(pp.one_f_one_b(4, 8)) == []  # one stage a rank
