"""Bad-input sweep: public functions and demo flags fed wrong types, values,
sizes, NaN/inf and empty inputs (hypothesis).

Every call must either return (the input happened to be valid) or raise a
``TypeError``/``ValueError`` whose message names the argument. Anything else
(another exception type, a JAX internal error) fails the sweep. Nothing here
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
from jaxpar import train_state as guard, pipeline

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


# name -> (argument named in the message, call(value)). Each call passes one
# bad value in one argument, valid values in the others.
TARGETS = {
    'make_mesh(data)': ('data', lambda v: jaxpar.make_mesh(data=v)),
    'make_mesh(tensor)': ('tensor', lambda v: jaxpar.make_mesh(
        data=2, stage=2, tensor=v)),
    'gpipe(num_ranks)': ('num_ranks', lambda v: pipeline.gpipe(v, 4)),
    'one_f_one_b(num_microbatches)': (
        'num_microbatches', lambda v: pipeline.one_f_one_b(2, v)),
    'interleaved_one_f_one_b(num_virtual)': (
        'virtual', lambda v: pipeline.interleaved_one_f_one_b(2, 4, v)),
    'zero_bubble_h1(num_ranks)': ('num_ranks',
                                  lambda v: pipeline.zero_bubble_h1(v, 4)),
    'zero_bubble_v(num_microbatches)': ('num_microbatches', lambda v: pipeline.zero_bubble_v(2, v)),
    'TrainState.create(optimizer)': ('optimizer', lambda v: (
        jaxpar.TrainState.create({'w': jnp.zeros(2)}, v))),
    'AsyncParameterServer(num_workers)': ('num_workers',
                                          lambda v: _ps(num_workers=v)),
    'AsyncParameterServer(max_staleness)': ('max_staleness',
                                            lambda v: _ps(max_staleness=v)),
    'AsyncParameterServer.run(num_updates)': (
        'num_updates', lambda v: _ps().run([], v)),
    'AsyncParameterServer.run(max_skipped)': (
        ('max_skipped', 'num_updates'),
        lambda v: _ps().run([], 1, max_skipped=v)),
    'async_ps.simulate(staleness)': ('staleness', _simulate),
    'checkpoint.save(step)': (('step', 'keep'), lambda v: checkpoint.save(
        '/nonexistent/jaxpar-sweep', {'a': np.ones(2)}, step=v, keep=0)),
    'checkpoint.save(keep)': (('keep', 'step'), lambda v: checkpoint.save(
        '/nonexistent/jaxpar-sweep', {'a': np.ones(2)}, step=-1, keep=v)),
    'checkpoint.save(directory)': (('directory', 'step'), lambda v: checkpoint.save(
        v, {'a': np.ones(2)}, step=-1)),
    'checkpoint.restore(like)': ('like', lambda v: checkpoint.restore(
        '/nonexistent/jaxpar-sweep', {'a': v})),
    'checkpoint.latest_step(directory)': (
        'directory', lambda v: checkpoint.latest_step(
            f'/nonexistent/{v}' if isinstance(v, str) else v)),
    'guard.count_skipped(skipped)': ('skipped', lambda v: guard.count_skipped(
        guard.SkipCount(), v)),
    'guard.count_skipped(max_skipped)': (
        'max_skipped', lambda v: guard.count_skipped(guard.SkipCount(), False,
                                                     max_skipped=v)),
    'distributed.launch(num_processes)': (
        ('num_processes', 'port'), lambda v: distributed.launch(v, ['demo'], port=0)),
    'distributed.launch(argv)': (('argv', 'port'), lambda v: distributed.launch(
        1, v, port=0)),
    'distributed.launch(timeout)': (('timeout', 'port'), lambda v: distributed.launch(
        1, ['demo'], timeout=v, port=0)),
}


def _check(label, names, call, value):
  CASES[label] += 1
  names = (names,) if isinstance(names, str) else names
  try:
    call(value)
  except (TypeError, ValueError) as e:
    assert any(n.lower() in str(e).lower() for n in names), (
        f'{label}: {value!r} raised {type(e).__name__} without naming '
        f'{names}: {e}')
  except FileNotFoundError:
    pass   # a valid call that reached the (missing) directory: documented


@pytest.mark.parametrize('label', sorted(TARGETS))
def test_public_functions(label):
  name, call = TARGETS[label]

  @settings(max_examples=EXAMPLES, derandomize=True, deadline=None,
            database=None, suppress_health_check=list(HealthCheck))
  @given(BAD)
  def sweep(value):
    _check(label, name, call, value)
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


