"""The real_parallel bench harness: N pinned processes, gloo; never on speed."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.cli.bench import _real_parallel_worker as worker
from jaxpar.cli.bench import real_parallel

TINY = dict(layers=4, width=32, microbatch=8, num_microbatches=4, repeats=2,
            warmup=1, timeout=300)


def _reference(w, head, x, t):
  """``value_and_grad`` of the whole model on the whole batch."""
  loss = lambda w, h, x: worker.loss_fn(h, worker.stage_fn({'w': w}, x), t)
  return jax.value_and_grad(loss, argnums=(0, 1))(w, head, x)


def _expected_schedules(p, m):
  return [getattr(jaxpar.pipeline, name)(p, m, *extra)
          for name, extra in worker.SCHEDULES
          if hasattr(jaxpar.pipeline, name)]


def test_end_to_end_two_pinned_processes():
  cores = sorted(os.sched_getaffinity(0))
  rows = real_parallel.measure(num_processes=2, **TINY,
                               timeline=['one_f_one_b'])
  if len(cores) < 2:
    assert [r['step'] for r in rows] == ['skipped']
    pytest.skip(f'{len(cores)} usable core(s): {rows[0]["note"]}')
  assert all(r['step'] != 'failed' for r in rows), rows
  schedules = _expected_schedules(2, 4)
  assert [r['step'] for r in rows] == (
      [worker.SEQUENTIAL] + [s.name for s in schedules]
      + [worker.DATA_PARALLEL, worker.MESSAGE])
  *rows, message = rows
  assert message['messages'] == 33 and message['speedup'] == 1
  for row in rows:
    assert row['median_ms'] > 0 and row['speedup'] > 0   # paired: below
    assert row['p10_ms'] <= row['median_ms'] <= row['p90_ms']
    assert row['efficiency'] == pytest.approx(row['speedup'] / row['ideal'])
    assert (row['m'], row['width'], row['microbatch']) == (4, 32, 8)
    assert row['cores'] == ','.join(map(str, cores[:row['ranks']]))
    assert row['pinned'] is True
    split = {part: row.get(f'{part}_ms') for part in worker.SPLIT}
    if row['step'] == '1F1B':   # the one timed: its time split adds up
      assert min(split.values()) >= 0 and split['bubble'] <= split['waiting']
      assert sum(split.values()) - split['bubble'] == pytest.approx(
          row['timeline_ms'])
    else:
      assert set(split.values()) == {None}
  ideal = {r['step']: r['ideal'] for r in rows}
  assert ideal[worker.SEQUENTIAL] == 1 and ideal[worker.DATA_PARALLEL] == 2
  # GPipe and 1F1B, F=1, B=2: 2*4*3 units of work in (m + p - 1) * 3 = 15.
  assert ideal['GPipe'] == ideal['1F1B'] == pytest.approx(24 / 15)
  for s in schedules:
    sim = s.simulate(worker.IDEAL_COSTS)
    assert ideal[s.name] == pytest.approx(sum(sim.busy) / sim.makespan)
    row = next(r for r in rows if r['step'] == s.name)
    assert row['stages'] == s.num_stages
    assert row['comm_ms'] == pytest.approx(
        row['messages'] * message['median_ms'] / 33)
  # 1F1B and GPipe on 2 ranks: a message per tick that sends (the two
  # directions share one offset) and the final psum; no input cotangents,
  # so no sums of their rows. 1F1B's I sends when it ends, folded with an F.
  assert {r['step']: r['messages'] for r in rows
          if r['step'] in ('GPipe', '1F1B')} == {'GPipe': 8 + 1, '1F1B': 5 + 1}


def test_one_core_policies_and_stage1_rows():
  """The ``one_core`` harness on a tiny case: each policy a row against the
  sequential step, the stage-size-1 step against the DP step."""
  rows = real_parallel.measure(
      num_processes=1, **{**TINY, 'layers': 2, 'num_microbatches': 2},
      variant='gelu', schedules=['one_f_one_b'], policies=['everything', 'dots'],
      data_parallel=False, stage1=True, pinned=False,
      xla_flags='--xla_cpu_multi_thread_eigen=false')
  dp = 'data_parallel.trainer (m=2)'
  assert [(r['step'], r['policy'], r['vs']) for r in rows] == [
      (worker.SEQUENTIAL, '', worker.SEQUENTIAL),
      ('1F1B [everything]', 'everything', worker.SEQUENTIAL),
      ('1F1B [dots]', 'dots', worker.SEQUENTIAL),
      (dp, '', dp), ('parallel.trainer, stage=1 (m=2)', '', dp)]
  for row in rows:
    assert row['variant'] == 'gelu' and row['cpu_ms'] > 0
    assert row['pinned'] is False
    assert row['cpu_ratio'] > 0   # paired by round: `worker.ratios`


def test_ratios_are_paired_by_round():
  """Each ratio is the median of its rounds' ratios, not the ratio of the
  medians: a slow round hits both steps of a ratio alike."""
  step = lambda **kw: worker.Step(None, (), 2, 2, 1.5, **kw)
  steps = {'1F1B': step(policy='dots'), 'GPipe': step(policy='dots'),
           worker.DATA_PARALLEL: step()}
  timing = lambda *seconds: worker.Timing(seconds, seconds, 1.0)
  timed = {'1F1B': timing(1.0, 2.0, 2.0), 'GPipe': timing(1.1, 1.0, 2.5),
           worker.DATA_PARALLEL: timing(0.9, 1.0, 1.8)}
  rows = [{'step': name, 'policy': s.policy, 'ideal': 2.0 if s.policy else
           1.0, 'messages': 1} for name, s in steps.items()]
  by_step = {r['step']: r for r in worker._relative(rows, steps, timed)}
  # The medians (1F1B 2.0, GPipe 1.1, DP 1.0) would give 1.82 and 0.5 / 2.
  assert by_step['GPipe']['vs_1f1b'] == pytest.approx(1.0 / 1.1)
  assert by_step['1F1B']['eff_vs_dp'] == pytest.approx(0.9 * 1.0 / 2.0)


def test_targets_side_by_side():
  """``real_parallel_targets``: a row per setting with the target measures."""
  row = lambda step, **kw: {'step': step, **kw}
  sections = {
      'real_parallel': [row(worker.SEQUENTIAL, variant='tanh', pinned=True),
                        row('GPipe', vs_1f1b=0.91), row('1F1B', vs_1f1b=1.0,
                                                        eff_vs_dp=0.96),
                        row('ZB-H1', vs_1f1b=0.96)],
      'real_parallel_gelu_unpinned': [row('failed', note='timeout')]}
  assert real_parallel.targets(sections) == [
      {'section': 'real_parallel', 'variant': 'tanh', 'pinned': True,
       'ZB-H1 vs_1f1b': 0.96, 'GPipe vs_1f1b': 0.91, '1F1B eff_vs_dp': 0.96,
       'met': '2/3'},
      {'section': 'real_parallel_gelu_unpinned', 'variant': None,
       'pinned': None, 'ZB-H1 vs_1f1b': None, 'GPipe vs_1f1b': None,
       '1F1B eff_vs_dp': None, 'met': '0/3'}]


def test_fewer_cores_than_ranks_is_a_skip_row(monkeypatch):
  monkeypatch.setattr(real_parallel.os, 'sched_getaffinity', lambda pid: {3})
  rows = real_parallel.measure(num_processes=2, **TINY)
  assert rows == [{'step': 'skipped', 'ranks': 2, 'note': (
      '1 core(s) usable by this process (os.sched_getaffinity), 2 ranks '
      'need one each')}]


def test_timeout_kills_the_processes_and_reports():
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip('needs 2 usable cores')
  rows = real_parallel.measure(num_processes=2, **{**TINY, 'timeout': 0.5})
  assert [r['step'] for r in rows] == ['failed']
  assert 'timeout=0.5s' in rows[0]['note']


@pytest.mark.parametrize('bad, match', [
    (dict(num_processes=0), 'num_processes=0 must be an int >= 1'),
    (dict(width=16.0), 'width=16.0 must be an int >= 1'),
    (dict(repeats=True), 'repeats=True must be an int >= 1'),
    (dict(timeout=0), 'timeout=0 must be > 0'),
    (dict(variant='relu'), "variant='relu' is not one of"),
])
def test_bad_sizes_raise(bad, match):
  with pytest.raises(ValueError, match=match):
    real_parallel.measure(**bad)


def test_sequential_and_data_parallel_steps_are_exact(x64):
  m, mb = 4, 3
  w, head, x, t = (a.astype(np.float64)
                   for a in worker.model(layers=4, width=8, batch=m * mb))
  loss, (dw, dh) = _reference(w, head, x, t)
  split = lambda a: a.reshape((m, mb) + a.shape[1:])

  seq_loss, (sw, sh) = jax.jit(worker.accumulated_grads)(
      w, head, split(x), split(t))
  mesh = jaxpar.make_mesh(data=2, devices=jax.devices()[:2])
  rep, by_rank = NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))
  dp_loss, (pw, ph) = worker.data_parallel_grads(mesh)(
      jax.device_put(w, rep), jax.device_put(head, rep),
      jax.device_put(split(x), by_rank), jax.device_put(split(t), by_rank))
  for got in ((seq_loss, sw, sh), (dp_loss, pw, ph)):
    np.testing.assert_allclose(got[0], loss, rtol=1e-10)
    for g, want in zip(got[1:], (dw, dh)):
      np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-14)

