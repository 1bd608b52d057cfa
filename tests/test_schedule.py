"""Pipeline schedules: constructors, validation, timing, pictures, CSV."""

import os

import matplotlib
import numpy as np
import pytest

from jaxpar import pipeline as pp
from jaxpar.pipeline import Action, Schedule, ScheduleError
from jaxpar.pipeline.schedules import _simulate as simulate_module
from helpers import tree_allclose

matplotlib.use('Agg')
DATA = os.path.join(os.path.dirname(__file__), 'data')
UNIT = {'F': 1, 'B': 1, 'I': 1, 'W': 1}
A = Action.parse


def rows(*texts):
  """``rows('0F0 0B0', '1F0 -')``: rank rows from strings, ``-`` = idle."""
  return tuple(tuple(None if c == '-' else A(c) for c in t.split())
               for t in texts)


def compact(schedule):
  return tuple(tuple(a for a in row if a is not None)
               for row in schedule.actions)


# --- Action ------------------------------------------------------------------


def test_action_string_form_is_pytorchs():
  assert str(Action(0, 'F', 3)) == '0F3'
  assert str(Action(12, 'W', 40)) == '12W40'
  for text in ('0F3', '4B1', '2I0', '2W0', ' 13F7 '):
    assert str(Action.parse(text)) == text.strip()
  assert Action.parse('4B1') == Action(stage=4, kind='B', microbatch=1)


@pytest.mark.parametrize('bad', ['0X3', 'F3', '0F', '0REDUCE_GRAD', '1SEND_F0',
                                 '0F3x', '', 3])
def test_action_parse_rejects(bad):
  with pytest.raises(ValueError, match='<stage><kind><microbatch>'):
    Action.parse(bad)


# --- constructors: exact orders ----------------------------------------------


def test_gpipe_order():
  s = pp.gpipe(2, 3)
  assert s.actions == rows('0F0 0F1 0F2 0B0 0B1 0B2', '1F0 1F1 1F2 1B0 1B1 1B2')
  assert (s.num_ranks, s.num_stages, s.num_microbatches, s.placement) == (
      2, 2, 3, (0, 1))


def test_one_f_one_b_order_including_m_below_p():
  assert pp.one_f_one_b(3, 4).actions == rows(
      '0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3',
      '1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3',
      '2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3')
  assert pp.one_f_one_b(4, 2).actions == rows(
      '0F0 0F1 0B0 0B1', '1F0 1F1 1B0 1B1', '2F0 2F1 2B0 2B1',
      '3F0 3B0 3F1 3B1')


def test_zero_bubble_h1_order():
  assert pp.zero_bubble_h1(3, 3).actions == rows(
      '0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2',
      '1F0 1F1 1I0 1F2 1I1 1W0 1I2 1W1 1W2',
      '2F0 2I0 2F1 2I1 2F2 2I2 2W0 2W1 2W2')


def test_placements():
  assert pp.interleaved_one_f_one_b(3, 3, 2).placement == (0, 1, 2, 0, 1, 2)
  assert pp.zero_bubble_v(3, 5).placement == (0, 1, 2, 2, 1, 0)
  assert pp.zero_bubble_v(3, 5).num_stages == 6


# --- constructors match PyTorch's exported orders ----------------------------


@pytest.mark.parametrize('file, built', [
    ('torch_gpipe_p4_m8.csv', lambda: pp.gpipe(4, 8)),
    ('torch_interleaved_1f1b_p4_m8_v2.csv',
     lambda: pp.interleaved_one_f_one_b(4, 8, 2)),
    ('torch_interleaved_1f1b_p2_m4_v3.csv',
     lambda: pp.interleaved_one_f_one_b(2, 4, 3)),
    ('torch_zero_bubble_p4_m8.csv', lambda: pp.zero_bubble_h1(4, 8)),
    ('torch_zbv_p4_m8.csv', lambda: pp.zero_bubble_v(4, 8)),
    ('torch_zbv_p4_m5.csv', lambda: pp.zero_bubble_v(4, 5)),
])
def test_pytorch_export_loads_validates_and_equals_constructor(file, built):
  loaded = Schedule.from_csv(os.path.join(DATA, file))
  ours = built()
  assert loaded.name == file[:-4]
  assert compact(loaded) == ours.actions  # PyTorch pads with idle slots
  assert (loaded.num_ranks, loaded.num_stages, loaded.num_microbatches,
          loaded.placement) == (ours.num_ranks, ours.num_stages,
                                ours.num_microbatches, ours.placement)
  # Idle slots take no time: the timing is the constructor's.
  assert loaded.simulate().makespan == ours.simulate().makespan


@pytest.mark.parametrize('file, stages, bubble', [
    ('torch_interleaved_zero_bubble_p2_m4_v2.csv', 4, 1 / 25),
    ('torch_looped_bfs_p2_m4_v2.csv', 4, 1 / 9),
])
def test_other_pytorch_schedules_load_and_run(file, stages, bubble):
  s = Schedule.from_csv(os.path.join(DATA, file))
  assert (s.num_ranks, s.num_stages, s.num_microbatches) == (2, stages, 4)
  assert s.placement == (0, 1, 0, 1)
  tree_allclose(s.simulate().bubble_fraction, bubble, rtol=1e-12, atol=1e-15)


def test_pytorch_1f1b_pipeline_order_bug_is_caught():
  # PyTorch's Schedule1F1B.pipeline_order skips 3F0 and invents 3F8 on the
  # last rank (its runtime order is right, and equals ours).
  path = os.path.join(DATA, 'torch_1f1b_p4_m8.csv')
  with pytest.raises(ScheduleError, match=r"'range'") as e:
    Schedule.from_csv(path, num_microbatches=8)
  assert (e.value.action, e.value.rank, e.value.step) == (A('3F8'), 3, 14)
  assert '[3F8]' in str(e.value)
  with pytest.raises(ScheduleError, match="'missing'.*0F8 is missing"):
    Schedule.from_csv(path)  # m inferred as 9
  torch_rows = Schedule(4, 4, 9, (0, 1, 2, 3),
                        tuple(tuple(r) for r in _csv_rows(path))).actions
  assert torch_rows[:3] == pp.one_f_one_b(4, 8).actions[:3]


def _csv_rows(path):
  with open(path) as f:
    return [line.strip().split(',') for line in f]


# --- constructor arguments ---------------------------------------------------


@pytest.mark.parametrize('call, message', [
    (lambda: pp.gpipe(0, 4), r'gpipe\(num_ranks=0, num_microbatches=4\): '
     r'num_ranks=0 must be >= 1; nearest valid choice: num_ranks=1'),
    (lambda: pp.one_f_one_b(2, 0), 'num_microbatches=0 must be >= 1'),
    (lambda: pp.zero_bubble_h1(-1, 2), 'num_ranks=-1 must be >= 1'),
    (lambda: pp.zero_bubble_v(2, -3),
     r'zero_bubble_v\(.*num_microbatches=-3 must be >= 1'),
    (lambda: pp.interleaved_one_f_one_b(2, 4, 0),
     'virtual_stages=0 must be >= 1; nearest valid choice: virtual_stages=1'),
    (lambda: pp.interleaved_one_f_one_b(4, 6, 2), 'num_microbatches must be a '
     'multiple of num_ranks=4.*nearest valid choice: num_microbatches=4 or 8'),
    (lambda: pp.interleaved_one_f_one_b(4, 3, 2),
     'nearest valid choice: num_microbatches=4\\.'),
])
def test_constructor_bad_values(call, message):
  with pytest.raises(ValueError, match=message):
    call()


@pytest.mark.parametrize('call', [
    lambda: pp.gpipe(2.0, 4), lambda: pp.one_f_one_b(True, 4),
    lambda: pp.interleaved_one_f_one_b(2, 4, '2')])
def test_constructor_bad_types(call):
  with pytest.raises(TypeError, match='must be an int'):
    call()


# --- closed forms ------------------------------------------------------------


@pytest.mark.parametrize('p, m', [(1, 3), (2, 1), (3, 5), (4, 4), (4, 9),
                                  (5, 2)])
def test_gpipe_and_1f1b_closed_forms(p, m):
  expected = (p - 1) / (m + p - 1)
  for build in (pp.gpipe, pp.one_f_one_b):
    s = build(p, m)
    # The uniform F = B = 1 and the default B = 2: same fraction.
    for costs, step in ((UNIT, 2), (None, 3)):
      r = s.simulate(costs)
      assert r.makespan == step * (m + p - 1)
      tree_allclose(r.bubble_fraction, expected, rtol=1e-12, atol=1e-15)
      assert r.bubble == tuple([step * (p - 1)] * p)
      assert r.peak_weight_grad_stash == (0,) * p
  assert pp.gpipe(p, m).simulate().peak_activations == (m,) * p
  assert pp.one_f_one_b(p, m).simulate().peak_activations == tuple(
      min(p - r, m) for r in range(p))


@pytest.mark.parametrize('p, m, v', [(2, 2, 3), (4, 8, 2), (3, 6, 1),
                                     (4, 4, 3)])
def test_interleaved_closed_form(p, m, v):
  s = pp.interleaved_one_f_one_b(p, m, v)
  for costs in (UNIT, None):  # every chunk F = B, or B = 2F
    r = s.simulate(costs)
    tree_allclose(r.bubble_fraction, (p - 1) / (v * m + p - 1), rtol=1e-12,
                  atol=1e-15)
  assert r.peak_activations == tuple(
      min((v - 1) * p + 2 * (p - r) - 1, v * m) for r in range(p))
  # v times less bubble time than 1F1B on the same model (chunks cost 1/v).
  one = pp.one_f_one_b(p, m).simulate({'F': v, 'B': 2 * v})
  tree_allclose(r.bubble[0] * v, one.bubble[0], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize('p, m', [(2, 2), (4, 4), (4, 9), (6, 7)])
def test_zero_bubble_h1_closed_form(p, m):
  r = pp.zero_bubble_h1(p, m).simulate(UNIT)
  ref = pp.one_f_one_b(p, m).simulate()  # B = I + W = 2
  tree_allclose(r.bubble_fraction, (p - 1) / (3 * m + p - 1), rtol=1e-12,
                atol=1e-15)
  assert r.bubble_fraction <= ref.bubble_fraction / 2
  assert r.peak_activations == ref.peak_activations
  assert r.peak_weight_grad_stash == tuple(min(i + 1, m) for i in range(p))


def test_zero_bubble_h1_below_p_microbatches_still_beats_1f1b():
  r = pp.zero_bubble_h1(4, 2).simulate()
  assert r.bubble_fraction < pp.one_f_one_b(4, 2).simulate().bubble_fraction


@pytest.mark.parametrize('p, m', [(1, 2), (2, 3), (3, 5), (4, 8)])
def test_zero_bubble_v_closed_form(p, m):
  r = pp.zero_bubble_v(p, m).simulate(UNIT)
  tree_allclose(r.bubble_fraction, (p - 1) / (6 * m + p - 1), rtol=1e-12,
                atol=1e-15)
  assert r.peak_activations == (2 * p,) * p


# --- simulation --------------------------------------------------------------


def check_timing(s, r, costs, comm):
  """Each action starts exactly when its rank and dependencies allow."""
  costs = simulate_module.check_costs(costs)
  graph = simulate_module.dependency_graph(s)
  rank_of = {a: r_ for r_, row in enumerate(s.actions) for a in row if a}
  for rank, row in enumerate(s.actions):
    prev_end = 0.0
    for a in (a for a in row if a is not None):
      ready = max([prev_end] + [
          r.end[d] + (comm if rank_of[d] != rank else 0) for d in graph[a]])
      assert r.start[a] == ready, a
      assert r.end[a] == r.start[a] + costs[a.kind]
      prev_end = r.end[a]
  assert r.makespan == max(r.end.values())
  tree_allclose([r.busy[i] + r.bubble[i] for i in range(s.num_ranks)],
                [r.makespan] * s.num_ranks, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize('build, costs, comm', [
    (lambda: pp.one_f_one_b(4, 6), {'F': 1.5, 'B': 2.5}, 0.25),
    (lambda: pp.interleaved_one_f_one_b(2, 4, 2), None, 0.5),
    (lambda: pp.zero_bubble_v(3, 4), {'F': 1, 'I': 0.5, 'W': 2}, 1.0),
])
def test_simulation_is_as_early_as_possible(build, costs, comm):
  s = build()
  check_timing(s, s.simulate(costs, comm), costs, comm)


def test_comm_delay_closed_form_and_same_rank_is_free():
  p, m, c = 4, 5, 0.5
  r = pp.gpipe(p, m).simulate(UNIT, comm=c)
  assert r.makespan == 2 * m + 2 * (p - 1) * (1 + c)
  # ZB-V on one rank: both stages local, no communication, no bubble.
  r = pp.zero_bubble_v(1, 3).simulate(UNIT, comm=5.0)
  assert (r.makespan, r.bubble_fraction) == (18.0, 0.0)


def test_idle_slots_take_no_time():
  s = pp.one_f_one_b(2, 2)
  padded = Schedule(2, 2, 2, (0, 1), rows('0F0 - 0F1 - - 0B0 0B1',
                                          '- 1F0 1B0 1F1 1B1 -'))
  assert padded.simulate() == s.simulate()


@pytest.mark.parametrize('costs, comm, message', [
    ({'X': 1}, 0.0, "unknown kind 'X'"),
    ({'F': -1}, 0.0, r"costs\['F'\]=-1 must be a finite number >= 0"),
    ({'B': float('nan')}, 0.0, 'finite number'),
    ({'F': '1'}, 0.0, 'finite number'),
    (None, -1.0, 'comm=-1.0 must be a finite number >= 0'),
    (None, float('inf'), 'comm=inf'),
])
def test_simulate_bad_arguments(costs, comm, message):
  with pytest.raises(ValueError, match=message):
    pp.gpipe(2, 2).simulate(costs, comm)


def test_simulate_costs_must_be_a_mapping():
  with pytest.raises(TypeError, match='must be a mapping'):
    pp.gpipe(2, 2).simulate([1, 2])


# --- validation: every rule --------------------------------------------------


def _bad(p, s, m, placement, *texts):
  return Schedule(p, s, m, placement, rows(*texts), 'bad')


@pytest.mark.parametrize('schedule, rule, cell', [
    (_bad(2, 2, 1, (0,), '0F0 0B0', '1F0 1B0'), 'structure', None),
    (_bad(2, 2, 1, (0, 2), '0F0 0B0', '1F0 1B0'), 'structure', None),
    (_bad(2, 2, 1, (0, 1), '0F0 0B0'), 'structure', None),
    (Schedule(0, 1, 1, (0,), ()), 'structure', None),
    (_bad(2, 2, 1, (0, 1), '0F0 0B0', '1F0 1B0 1F1'), 'range', '[1F1]'),
    (_bad(2, 2, 1, (0, 1), '0F0 0B0 2F0', '1F0 1B0'), 'range', '[2F0]'),
    (_bad(2, 2, 1, (0, 1), '0F0 0B0 1F0', '1B0'), 'placement', '[1F0]'),
    (_bad(2, 2, 1, (0, 1), '0F0 0B0', '1F0 1B0 1F0'), 'duplicate', '[1F0]'),
    (_bad(2, 2, 1, (0, 1), '0F0 0B0', '1F0'), 'missing', '1B0 is missing'),
    (_bad(2, 2, 1, (0, 1), '0B0', '1F0 1B0'), 'missing', '0F0 is missing'),
    (_bad(2, 2, 1, (0, 1), '0F0 0I0', '1F0 1B0'), 'missing', '0W0 is missing'),
    (_bad(2, 2, 1, (0, 1), '0F0 0B0 0W0', '1F0 1B0'), 'split', '[0W0]'),
    (_bad(2, 2, 1, (0, 1), '0F0 0B0', '1B0 1F0'), 'order', '[1B0]'),
    (_bad(2, 2, 1, (0, 1), '0F0 0B0', '1F0 1W0 1I0'), 'order', '[1W0]'),
    # The V turns on rank 0 here: stage 1 needs stage 0's forward first.
    (_bad(1, 2, 1, (0, 0), '1F0 0F0 1B0 0B0'), 'order', '[1F0]'),
    (_bad(2, 2, 2, (0, 1), '0F0 0B0 0F1 0B1', '1F0 1F1 1B0 1B1'), 'deadlock',
     '[0B0]'),
])
def test_validate_names_the_rule_and_marks_the_cell(schedule, rule, cell):
  with pytest.raises(ScheduleError, match=f"breaks rule '{rule}'") as e:
    schedule.validate()
  assert e.value.rule == rule
  assert isinstance(e.value, ValueError)
  assert 'Fix: ' in str(e.value)
  if cell is not None:
    assert cell in str(e.value)


def test_deadlock_message_names_every_stuck_rank():
  s = _bad(2, 2, 2, (0, 1), '0F0 0B0 0F1 0B1', '1F0 1F1 1B0 1B1')
  with pytest.raises(ScheduleError) as e:
    s.validate()
  assert 'rank 0 waits at step 1 (0B0) for 1B0 on rank 1' in str(e.value)
  assert 'rank 1 waits at step 1 (1F1) for 0F1 on rank 0' in str(e.value)
  assert '[0B0]' in str(e.value) and '[1F1]' in str(e.value)
  assert (e.value.action, e.value.rank, e.value.step) == (A('0B0'), 0, 1)


def test_error_grid_of_a_long_schedule_shows_a_window():
  s = pp.one_f_one_b(3, 40)
  row = list(s.actions[1])
  i, j = row.index(A('1F30')), row.index(A('1B30'))
  row[i], row[j] = row[j], row[i]
  broken = Schedule(3, 3, 40, s.placement, (s.actions[0], row, s.actions[2]))
  with pytest.raises(ScheduleError, match="'order'") as e:
    broken.validate()
  lines = str(e.value).splitlines()
  assert lines[1].split()[1:] == [str(t) for t in range(i - 4, i + 20)]
  assert '[1B30]' in lines[3]
  assert lines[-1] == f'(steps {i - 4}..{i + 19} of 0..79 shown)'
  missing = Schedule(3, 3, 40, s.placement,
                     (s.actions[0][:-1],) + s.actions[1:])
  with pytest.raises(ScheduleError, match='0B39 is missing') as e:
    missing.validate()
  assert '(steps 0..23 of 0..79 shown)' in str(e.value)


def test_schedule_normalises_and_type_checks():
  s = Schedule(2, 2, 1, [0, 1], [['0F0', '0B0'], [(1, 'F', 0), '1B0']])
  assert s.actions == rows('0F0 0B0', '1F0 1B0') and s.placement == (0, 1)
  assert s.validate() is s
  with pytest.raises(TypeError, match=r'actions\[1\]\[0\] = 3.5'):
    Schedule(2, 2, 1, (0, 1), (('0F0',), (3.5,)))
  s = Schedule(np.int64(2), 2, 1, np.arange(2),
               [[Action(np.int32(0), 'F', np.int64(0)), '0B0'], ['1F0', '1B0']])
  assert s.num_ranks == 2 and type(s.num_ranks) is int
  assert type(s.placement[1]) is int and type(s.actions[0][0].stage) is int
  assert s.validate().actions == rows('0F0 0B0', '1F0 1B0')
  with pytest.raises(TypeError, match='num_ranks=2.0 must be an int'):
    Schedule(2.0, 2, 1, (0, 1), ((), ()))
  with pytest.raises(TypeError, match=r'placement\[1\]=None must be an int'):
    Schedule(2, 2, 1, (0, None), ((), ()))
  with pytest.raises(TypeError, match=r'actions\[0\]\[0\].stage=0.5'):
    Schedule(1, 1, 1, (0,), (((0.5, 'F', 0),),))
  with pytest.raises(ValueError, match='<stage><kind><microbatch>'):
    Schedule(1, 1, 1, (0,), (('0F0', '0Q0'),))


# --- CSV ---------------------------------------------------------------------


def test_csv_round_trip_keeps_idle_slots_and_empty_rows(tmp_path):
  s = Schedule(3, 2, 1, (0, 2), rows('- 0F0 - 0B0 -', '', '- 1F0 1B0'),
               'padded').validate()
  path = tmp_path / 'padded.csv'
  s.to_csv(path)
  assert path.read_text().splitlines() == [',0F0,,0B0,', '', ',1F0,1B0']
  assert Schedule.from_csv(path) == s


def test_from_csv_rejects_communication_actions(tmp_path):
  path = tmp_path / 'comms.csv'
  path.write_text('0F0,0B0\n1F0,1SEND_B0,1B0\n')
  with pytest.raises(ValueError, match=r'rank 1 column 1: .*1SEND_B0'):
    Schedule.from_csv(path)


def test_from_csv_rejects_a_gap_in_stage_numbers(tmp_path):
  path = tmp_path / 'gap.csv'
  path.write_text('0F0,0B0\n2F0,2B0\n')
  with pytest.raises(ValueError, match='stage 1 has no actions'):
    Schedule.from_csv(path)


def test_from_csv_reports_a_stage_on_two_ranks(tmp_path):
  path = tmp_path / 'two.csv'
  path.write_text('0F0,1F0\n1B0,0B0\n')
  with pytest.raises(ScheduleError, match="'placement'") as e:
    Schedule.from_csv(path)
  assert e.value.action == A('1B0')


# --- pictures ----------------------------------------------------------------


def test_render_timed_and_in_rank_order():
  s = pp.one_f_one_b(2, 2)
  assert s.render({'B': 2}).splitlines()[1:] == [
      't        0   1   2   3   4   5   6   7   8',
      'rank 0 0F0 0F1         0B0   ~     0B1   ~',
      'rank 1     1F0 1B0   ~ 1F1 1B1   ~']
  assert str(s).splitlines() == [
      '1F1B: p=2, stages=2, m=2, actions in rank order',
      'step     0   1   2   3',
      'rank 0 0F0 0F1 0B0 0B1',
      'rank 1 1F0 1B0 1F1 1B1']
  with pytest.raises(ValueError, match='whole number of steps'):
    s.render({'B': 1.5})


def test_plot_gantt_chart():
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  s = pp.zero_bubble_h1(3, 4)
  fig = s.plot(costs=UNIT)
  ax, = fig.axes
  assert 'ZB-H1: p=3, m=4, bubble' in ax.get_title()
  assert f'{s.simulate(UNIT).bubble_fraction:.1%}' in ax.get_title()
  assert len(ax.collections) == 3 * 3 * 4  # one box per action
  assert ax.get_xlim() == (0.0, s.simulate(UNIT).makespan)
  assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == [
      'F', 'I', 'W']
  target = Figure().add_subplot()
  assert pp.zero_bubble_v(2, 3).plot(ax=target) is target.figure

