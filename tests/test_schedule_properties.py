"""Property tests: every constructor validates, CSV round-trips, corruptions
fail."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from jaxpar import pipeline as pp
from jaxpar.pipeline import Schedule, ScheduleError
from jaxpar.pipeline.schedules._simulate import dependency_graph

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def schedules(draw):
  """Any constructor's output for random p, m, v."""
  p = draw(st.integers(1, 6))
  build = draw(st.sampled_from([
      pp.gpipe, pp.one_f_one_b, pp.interleaved_one_f_one_b, pp.zero_bubble_h1,
      pp.zero_bubble_v, pp.dualpipe_v, pp.v_half, pp.v_min]))
  if build is pp.interleaved_one_f_one_b:
    return build(p, p * draw(st.integers(1, 3)), draw(st.integers(1, 3)))
  return build(p, draw(st.integers(1, 12)))


def replace_row(s, rank, row):
  actions = list(s.actions)
  actions[rank] = tuple(row)
  return Schedule(s.num_ranks, s.num_stages, s.num_microbatches, s.placement,
                  tuple(actions), s.name)


def rule_of(s):
  try:
    s.validate()
  except ScheduleError as e:
    return e.rule
  return None


@SETTINGS
@given(schedules())
def test_constructors_validate_with_every_action_once(s):
  assert s.validate() is s
  flat = [a for row in s.actions for a in row]
  assert None not in flat and len(set(flat)) == len(flat)
  # F and B, or F, I and W, per (stage, microbatch) (DualPipeV mixes both).
  splits = sum(a.kind == 'W' for a in flat)
  assert splits == sum(a.kind == 'I' for a in flat)
  assert len(flat) == 2 * s.num_stages * s.num_microbatches + splits
  for rank, row in enumerate(s.actions):
    assert all(s.placement[a.stage] == rank for a in row)


@SETTINGS
@given(schedules(), st.data())
def test_csv_round_trip_is_identity(tmp_path_factory, s, data):
  # Sprinkle explicit idle slots: they must survive the round trip too.
  padded = tuple(
      tuple(x for a in row for x in
            ((None, a) if data.draw(st.booleans()) else (a,)))
      + ((None,) if data.draw(st.booleans()) else ())
      for row in s.actions)
  s = Schedule(s.num_ranks, s.num_stages, s.num_microbatches, s.placement,
               padded, s.name)
  path = tmp_path_factory.mktemp('csv') / 's.csv'
  s.to_csv(path)
  assert Schedule.from_csv(path, name=s.name) == s


@SETTINGS
@given(schedules(), st.data())
def test_swapping_dependent_actions_breaks_order(s, data):
  graph = dependency_graph(s)
  rank_of = {a: r for r, row in enumerate(s.actions) for a in row}
  pairs = [(d, a) for a, deps in graph.items() for d in deps
           if rank_of[d] == rank_of[a]]
  dep, action = data.draw(st.sampled_from(sorted(pairs)))
  row = list(s.actions[rank_of[action]])
  i, j = row.index(dep), row.index(action)
  row[i], row[j] = action, dep
  assert rule_of(replace_row(s, rank_of[action], row)) == 'order'


@SETTINGS
@given(schedules(), st.data())
def test_missing_or_duplicated_action_is_named(s, data):
  rank = data.draw(st.sampled_from(
      [r for r, row in enumerate(s.actions) if row]))
  row = list(s.actions[rank])
  i = data.draw(st.integers(0, len(row) - 1))
  removed = row[:i] + row[i + 1:]
  with pytest.raises(ScheduleError) as e:
    replace_row(s, rank, removed).validate()
  assert (e.value.rule, e.value.action) == ('missing', row[i])
  j = data.draw(st.integers(0, len(row)))
  assert rule_of(replace_row(s, rank, row[:j] + [row[i]] + row[j:])) == (
      'duplicate')


@settings(max_examples=25, deadline=None)
@given(schedules(), st.dictionaries(
    st.sampled_from('FBIW'), st.floats(0.125, 4.0), min_size=4),
       st.sampled_from([0.0, 0.5, 2.0]))
def test_simulation_bounds(s, costs, comm):
  r = s.simulate(costs, comm)
  assert 0.0 <= r.bubble_fraction < 1.0
  assert math.isclose(sum(r.busy), sum(costs[a.kind] for row in s.actions
                                       for a in row))
  assert r.makespan >= max(r.busy)
  # Each microbatch's forward and backward chain is a lower bound.
  back = min(costs[a.kind] for row in s.actions for a in row
             if a.kind in 'BI')
  assert r.makespan >= s.num_stages * (costs['F'] + back) - 1e-9
  assert all(0 < n <= s.num_microbatches * s.num_stages
             for n in r.peak_activations)
