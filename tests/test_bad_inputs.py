"""Bad-input sweep: public functions and demo flags fed wrong types, values,
sizes, NaN/inf and empty inputs (hypothesis).

Every call must raise a ``TypeError``/``ValueError`` whose message names the
argument, or return where the value is a valid one (each target says which
values are: ``valid``). A bad value that returns normally, another exception
type or a JAX internal error fails the sweep. Nothing here
compiles a program: validation happens before tracing. ``CASES`` counts the
calls made; the README quotes the count (``pytest -s`` prints it).
"""

import collections

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxpar
from jaxpar.checkpoint import _checkpoint as checkpoint
from jaxpar.cli import demo
from jaxpar import distributed
from jaxpar import pipeline, train_state

CASES = collections.Counter()
EXAMPLES = 25


@pytest.fixture(scope='module', autouse=True)
def report_count():
  """Prints the number of cases tried when the module is done."""
  yield
  print(f'\nbad-input sweep: {sum(CASES.values())} cases over {len(CASES)} '
        'functions and flags, 0 failures')

# Wrong types and values: numbers of every sign and size, NaN/inf, strings,
# None, bools, containers (empty too) and arrays.
BAD = st.one_of(
    st.integers(-3, 9), st.integers(10**6, 10**12), st.booleans(), st.none(),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.lists(st.integers(-2, 3), max_size=3),
    st.just(np.float32(np.nan)), st.just(np.array([1, 2])), st.just({}),
    st.just(np.int64(2)))


def _loss(params, batch):
  return jnp.mean((batch['x'] @ params - batch['y']) ** 2)


def _ps(**kw):
  args = dict(num_workers=2, max_staleness=1)
  args.update(kw)
  return jaxpar.AsyncParameterServer(_loss, optax.sgd(0.1), jnp.zeros(2),
                                     **args)


def _simulate(staleness):
  data = [{'x': np.ones((2, 2)), 'y': np.ones(2)}] * 3
  return jaxpar.async_ps.simulate(_loss, optax.sgd(0.1), jnp.zeros(2), data,
                                  staleness=staleness)


def _int(v) -> bool:
  """An int as the validators take it (NumPy ints too, never a bool)."""
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _int_at_least(low):
  return lambda v: _int(v) and v >= low


def _int_equal(n):
  return lambda v: _int(v) and v == n


def _never(v) -> bool:
  """The other arguments make the call fail: no value may return."""
  del v
  return False


def _staleness(v) -> bool:
  """``simulate``'s trace for 3 batches: ints with 0 <= s[i] <= i."""
  return (isinstance(v, list) and len(v) <= 3
          and all(_int(s) and 0 <= s <= i for i, s in enumerate(v)))


# name -> (argument named in the message, call(value), valid(value): the
# values the call may return for). Each call passes one bad value in one
# argument, valid values in the others; where the others are left invalid
# on purpose (a negative step, keep=0, port=0, no batches), it must raise
# for every value and may name either argument.
TARGETS = {
    'make_mesh(data)': ('data', lambda v: jaxpar.make_mesh(data=v),
                        _int_equal(8)),
    'make_mesh(tensor)': ('tensor', lambda v: jaxpar.make_mesh(
        data=2, stage=2, tensor=v), _int_equal(2)),
    'gpipe(num_ranks)': ('num_ranks', lambda v: pipeline.gpipe(v, 4),
                         _int_at_least(1)),
    'one_f_one_b(num_microbatches)': (
        'num_microbatches', lambda v: pipeline.one_f_one_b(2, v),
        _int_at_least(1)),
    'interleaved_one_f_one_b(num_virtual)': (
        'virtual', lambda v: pipeline.interleaved_one_f_one_b(2, 4, v),
        _int_at_least(1)),
    'zero_bubble_h1(num_ranks)': ('num_ranks',
                                  lambda v: pipeline.zero_bubble_h1(v, 4),
                                  _int_at_least(1)),
    'zero_bubble_v(num_microbatches)': (
        'num_microbatches', lambda v: pipeline.zero_bubble_v(2, v),
        _int_at_least(1)),
    'TrainState.create(optimizer)': ('optimizer', lambda v: (
        jaxpar.TrainState.create({'w': jnp.zeros(2)}, v)), _never),
    'AsyncParameterServer(num_workers)': (
        'num_workers', lambda v: _ps(num_workers=v), _int_at_least(1)),
    'AsyncParameterServer(max_staleness)': (
        'max_staleness', lambda v: _ps(max_staleness=v), _int_at_least(0)),
    'AsyncParameterServer.run(num_updates)': (
        'num_updates', lambda v: _ps().run([], v), _never),
    'AsyncParameterServer.run(max_skipped)': (
        ('max_skipped', 'num_updates'),
        lambda v: _ps().run([], 1, max_skipped=v), _never),
    'async_ps.simulate(staleness)': ('staleness', _simulate, _staleness),
    'checkpoint.save(step)': (('step', 'keep'), lambda v: checkpoint.save(
        '/nonexistent/jaxpar-sweep', {'a': np.ones(2)}, step=v, keep=0),
                              _never),
    'checkpoint.save(keep)': (('keep', 'step'), lambda v: checkpoint.save(
        '/nonexistent/jaxpar-sweep', {'a': np.ones(2)}, step=-1, keep=v),
                              _never),
    'checkpoint.save(directory)': (('directory', 'step'),
                                   lambda v: checkpoint.save(
                                       v, {'a': np.ones(2)}, step=-1), _never),
    'checkpoint.restore(like)': ('like', lambda v: checkpoint.restore(
        '/nonexistent/jaxpar-sweep', {'a': v}), _never),
    # A string names a directory that does not exist: no step, None.
    'checkpoint.latest_step(directory)': (
        'directory', lambda v: checkpoint.latest_step(
            f'/nonexistent/{v}' if isinstance(v, str) else v),
        lambda v: isinstance(v, str)),
    'train_state.count_skipped(skipped)': (
        'skipped', lambda v: train_state.count_skipped(
            train_state.SkipCount(), v),
        lambda v: isinstance(v, (bool, np.bool_))),
    'train_state.count_skipped(max_skipped)': (
        'max_skipped', lambda v: train_state.count_skipped(
            train_state.SkipCount(), False, max_skipped=v),
        _int_at_least(1)),
    'distributed.launch(num_processes)': (
        ('num_processes', 'port'),
        lambda v: distributed.launch(v, ['demo'], port=0), _never),
    'distributed.launch(argv)': (('argv', 'port'), lambda v: distributed.launch(
        1, v, port=0), _never),
    'distributed.launch(timeout)': (('timeout', 'port'),
                                    lambda v: distributed.launch(
                                        1, ['demo'], timeout=v, port=0),
                                    _never),
}


def _check(label, names, call, valid, value):
  CASES[label] += 1
  names = (names,) if isinstance(names, str) else names
  if valid(value) and _int(value) and value > 1000:
    return   # a valid size too large to build here (10**6 pipeline ranks)
  try:
    call(value)
  except (TypeError, ValueError) as e:
    assert any(n.lower() in str(e).lower() for n in names), (
        f'{label}: {value!r} raised {type(e).__name__} without naming '
        f'{names}: {e}')
    return
  except FileNotFoundError:
    return   # a valid call that reached the (missing) directory: documented
  if not valid(value):
    pytest.fail(f'{label}: {value!r} returned normally; a bad value must '
                f'raise a TypeError or ValueError naming {names}')


@pytest.mark.parametrize('label', sorted(TARGETS))
def test_public_functions(label):
  name, call, valid = TARGETS[label]

  @settings(max_examples=EXAMPLES, derandomize=True, deadline=None,
            database=None, suppress_health_check=list(HealthCheck))
  @given(BAD)
  def sweep(value):
    _check(label, name, call, valid, value)
  sweep()


FLAGS = ['--mesh', '--schedule', '--microbatches', '--virtual-stages',
         '--steps', '--layers', '--batch', '--lr', '--seed', '--devices',
         '--max-skipped', '--num-processes', '--process-id']


@pytest.mark.parametrize('flag', FLAGS)
def test_demo_flags(flag, capsys):
  """Any value of one flag: parsed, or exit code 2 with a line naming it."""

  @settings(max_examples=EXAMPLES, derandomize=True, deadline=None,
            database=None, suppress_health_check=list(HealthCheck))
  @given(st.one_of(BAD.map(str), st.sampled_from(
      ['', '0', '-1', 'nan', 'inf', '1e9', 'data=0', 'data=2,pipe=2',
       'gpipe', 'x'])))
  def sweep(text):
    CASES[f'demo {flag}'] += 1
    capsys.readouterr()
    try:
      demo.parse_args([flag, text])
    except SystemExit as e:
      err = capsys.readouterr().err
      assert e.code == 2, (flag, text, e.code)
      assert len(err.strip().splitlines()) == 1, err
      assert (flag in err or flag.lstrip('-').replace('-', '_') in err
              or 'argument' in err), (flag, text, err)
  sweep()


def test_lr_flag_rejects_non_finite(capsys):
  for text in ('nan', 'inf', '-inf', '0'):
    with pytest.raises(SystemExit):
      demo.parse_args(['--lr', text])
    assert '--lr' in capsys.readouterr().err


