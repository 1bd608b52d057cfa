"""Asynchronous parameter server: simulator vs hand-rolled stale SGD, threaded
runtime vs simulator replay, bounded staleness, convergence, faults, errors."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar
from jaxpar import async_ps
from helpers import tree_allclose

FEATURES = 4
W_TRUE = np.linspace(-1.0, 2.0, FEATURES)


def loss_fn(params, batch):
  pred = batch['x'] @ params['w'] + params['b']
  return jnp.mean((pred - batch['y']) ** 2)


def make_batches(n, *, rows=8, seed=0, dtype=np.float64):
  """n least-squares batches, y = x @ W_TRUE + 0.5 exactly (no noise)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    x = rng.normal(size=(rows, FEATURES))
    out.append({'x': x.astype(dtype), 'y': (x @ W_TRUE + 0.5).astype(dtype)})
  return out


def init_params(dtype=jnp.float64):
  return {'w': jnp.zeros(FEATURES, dtype), 'b': jnp.zeros((), dtype)}


def stale_reference(optimizer, params, batches, staleness):
  """Plain Python, no jit: update i uses the gradient at version i - s[i]."""
  versions = [params]
  opt_state = optimizer.init(params)
  losses = []
  for i, (s, batch) in enumerate(zip(staleness, batches)):
    loss, grads = jax.value_and_grad(loss_fn)(versions[i - s], batch)
    updates, opt_state = optimizer.update(grads, opt_state, versions[i])
    versions.append(optax.apply_updates(versions[i], updates))
    losses.append(loss)
  return versions[-1], np.asarray(losses)


def sequential(optimizer, params, batches):
  """Plain sequential optax training (no staleness at all)."""
  opt_state = optimizer.init(params)
  for batch in batches:
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def run_guarded(fn, timeout=60.0):
  """Calls fn() in a thread; fails (instead of hanging) if it deadlocks."""
  out = {}
  x64 = jax.enable_x64.value  # config contexts are thread-local

  def target():
    try:
      with jax.enable_x64(x64):
        out['value'] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      out['error'] = e
  t = threading.Thread(target=target, daemon=True)
  t.start()
  t.join(timeout)
  assert not t.is_alive(), f'run did not return within {timeout} s (deadlock)'
  if 'error' in out:
    raise out['error']
  return out['value']


def worker_threads():
  return [t for t in threading.enumerate()
          if t.name.startswith('jaxpar-async-ps-worker')]


def test_simulate_matches_stale_reference(x64):
  n = 12
  batches = make_batches(n)
  opt = optax.adam(0.1)
  rng = np.random.default_rng(1)
  patterns = {
      'zero': np.zeros(n, int),
      'constant3': np.minimum(3, np.arange(n)),
      'cyclic': np.minimum(np.arange(n) % 4, np.arange(n)),
      'random': np.minimum(rng.integers(0, 5, n), np.arange(n)),
  }
  seq = sequential(opt, init_params(), batches)
  for name, staleness in patterns.items():
    res = async_ps.simulate(loss_fn, opt, init_params(), batches,
                            staleness=staleness)
    ref_params, ref_losses = stale_reference(opt, init_params(), batches,
                                             staleness)
    tree_allclose(res.params, ref_params, rtol=1e-10)
    np.testing.assert_allclose(res.losses, ref_losses, rtol=1e-10)
    np.testing.assert_array_equal(res.staleness, staleness)
    assert res.params['w'].dtype == jnp.float64, name
    # Staleness must matter, or the comparison above proves nothing.
    moved = np.abs(np.asarray(res.params['w'] - seq['w'])).max()
    assert (moved < 1e-12) if name == 'zero' else (moved > 1e-6), (name, moved)


def test_zero_staleness_is_sequential_training(x64):
  batches = make_batches(24)
  opt = optax.adam(0.05)
  sim = async_ps.simulate(loss_fn, opt, init_params(), batches,
                          staleness=np.zeros(24, int))
  tree_allclose(sim.params, sequential(opt, init_params(), batches),
                rtol=1e-10)

  ps = jaxpar.AsyncParameterServer(loss_fn, opt, init_params(),
                                   num_workers=8, max_staleness=0)
  res = run_guarded(lambda: ps.run(iter(batches), 24))
  np.testing.assert_array_equal(res.staleness, 0)
  np.testing.assert_array_equal(np.sort(res.batch_ids), np.arange(24))
  ordered = [batches[j] for j in res.batch_ids]
  tree_allclose(res.params, sequential(opt, init_params(), ordered),
                rtol=1e-10)


class Straggler:
  """Batches (flagged ``slow``) of which batch ``slow`` is a straggler.

  Its first gradient waits in a host callback until every batch has been
  handed out, so the other workers apply many updates meanwhile and its push
  is certainly too stale, however the threads are scheduled.
  """

  def __init__(self, batches, slow=None):
    self.batches = [dict(b, slow=np.int32(i == slow))
                    for i, b in enumerate(batches)]
    self.taken = 0
    self.waited = threading.Event()

  def __iter__(self):
    for batch in self.batches:
      self.taken += 1
      yield batch

  def _wait(self, flag):
    if flag and not self.waited.is_set():
      self.waited.set()
      deadline = time.monotonic() + 30
      while self.taken < len(self.batches) and time.monotonic() < deadline:
        time.sleep(0.01)
    return np.zeros((), np.int32)

  def loss(self, params, batch):
    wait = jax.pure_callback(self._wait, jax.ShapeDtypeStruct((), jnp.int32),
                             batch['slow'])
    return loss_fn(params, batch) + 0.0 * wait


def test_threaded_run_bounded_staleness_and_replay(x64):
  """A straggler forces stale pushes; the bound holds and the run replays."""
  n, bound = 48, 2
  straggler = Straggler(make_batches(n, seed=3), slow=2)
  opt = optax.sgd(0.05, momentum=0.5)
  ps = jaxpar.AsyncParameterServer(straggler.loss, opt, init_params(),
                                   num_workers=8, max_staleness=bound)
  res = run_guarded(lambda: ps.run(straggler, n))

  assert res.staleness.max() <= bound
  assert res.staleness.min() >= 0
  np.testing.assert_array_equal(np.sort(res.batch_ids), np.arange(n))
  assert set(res.workers) <= set(range(8))
  # The slow batch's first gradient was > bound updates old: recomputed.
  assert res.retries[list(res.batch_ids).index(2)] >= 1
  assert int(ps.state.step) == n
  assert res.params['w'].dtype == jnp.float64  # workers inherit x64

  replay = async_ps.simulate(straggler.loss, opt, init_params(),
                             [straggler.batches[j] for j in res.batch_ids],
                             staleness=res.staleness)
  tree_allclose(res.params, replay.params, rtol=1e-10)
  np.testing.assert_allclose(res.losses, replay.losses, rtol=1e-10)

  # A second run continues from the server's state.
  more = run_guarded(lambda: ps.run(iter(Straggler(make_batches(8, seed=4))), 8))
  assert int(ps.state.step) == n + 8
  np.testing.assert_array_equal(np.sort(more.batch_ids), np.arange(8))
  assert more.staleness.max() <= bound


def test_threaded_run_converges_on_least_squares():
  batches = make_batches(400, rows=16, seed=5, dtype=np.float32)
  ps = jaxpar.AsyncParameterServer(loss_fn, optax.sgd(0.05),
                                   init_params(jnp.float32), num_workers=8,
                                   max_staleness=4)
  res = run_guarded(lambda: ps.run(iter(batches), 400))
  assert res.staleness.max() <= 4
  np.testing.assert_allclose(res.params['w'], W_TRUE, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(res.params['b'], 0.5, rtol=1e-4)
  assert res.losses[-20:].mean() < 1e-6 * res.losses[:8].mean()


def failing_batches(n, bad):
  for i, batch in enumerate(make_batches(n, dtype=np.float32)):
    if i == bad:
      raise RuntimeError(f'bad batch {i}')
    yield batch


def test_iterator_fault_is_reraised_promptly():
  ps = jaxpar.AsyncParameterServer(loss_fn, optax.sgd(0.05),
                                   init_params(jnp.float32), num_workers=8,
                                   max_staleness=3)
  with pytest.raises(RuntimeError, match='bad batch 5') as info:
    run_guarded(lambda: ps.run(failing_batches(50, bad=5), 50), timeout=30)
  assert any('worker' in note for note in info.value.__notes__)
  assert int(ps.state.step) <= 5  # only batches 0..4 existed
  assert not worker_threads()


def test_loss_fault_is_reraised_and_server_stays_usable():
  def marked_loss(params, batch):
    if batch['x'].shape[0] == 3:
      raise ValueError('marked batch reached the loss')
    return loss_fn(params, batch)
  batches = make_batches(30, dtype=np.float32)
  batches[10] = make_batches(1, rows=3, dtype=np.float32)[0]
  ps = jaxpar.AsyncParameterServer(marked_loss, optax.sgd(0.05),
                                   init_params(jnp.float32), num_workers=4,
                                   max_staleness=2)
  with pytest.raises(ValueError, match='marked batch'):
    run_guarded(lambda: ps.run(batches, 30), timeout=30)
  assert not worker_threads()
  applied = int(ps.state.step)
  assert applied < 30
  res = run_guarded(lambda: ps.run(make_batches(6, dtype=np.float32), 6))
  assert int(ps.state.step) == applied + 6 and len(res.losses) == 6


def nan_batches(n, bad, *, seed=0):
  """n float64 batches; batch ``bad`` has a NaN input (a NaN gradient)."""
  batches = make_batches(n, seed=seed)
  batches[bad] = dict(batches[bad], x=batches[bad]['x'].copy())
  batches[bad]['x'][0, 0] = np.nan
  return batches


def test_nan_batch_never_reaches_the_params(x64):
  """One NaN batch among 21: dropped, listed, replaced; 20 clean updates."""
  batches, opt = nan_batches(21, bad=7), optax.adam(0.05)
  ps = jaxpar.AsyncParameterServer(loss_fn, opt, init_params(), num_workers=4,
                                   max_staleness=2)
  res = run_guarded(lambda: ps.run(iter(batches), 20))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(
      ps.state))
  np.testing.assert_array_equal(res.skipped, [7])
  assert 7 not in res.batch_ids and len(res.batch_ids) == 20
  np.testing.assert_array_equal(
      np.sort(np.concatenate([res.batch_ids, res.skipped])), np.arange(21))
  assert int(ps.state.step) == 20 and np.isfinite(res.losses).all()
  # The applied updates replay exactly without the NaN batch.
  replay = async_ps.simulate(loss_fn, opt, init_params(),
                             [batches[j] for j in res.batch_ids],
                             staleness=res.staleness)
  tree_allclose(res.params, replay.params, rtol=1e-10)
  assert replay.skipped.size == 0
  # A list with no batch to spare runs out rather than apply the NaN.
  ps = jaxpar.AsyncParameterServer(loss_fn, opt, init_params(), num_workers=2,
                                   max_staleness=1)
  with pytest.raises(ValueError, match='ran out after 20 batches'):
    run_guarded(lambda: ps.run(batches[:20], 20))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(
      ps.state))


def test_run_stops_after_max_skipped_non_finite_pushes():
  """Every batch NaN: run raises after K pushes in a row instead of taking
  batches forever; the state of the last applied update is kept."""
  ps = jaxpar.AsyncParameterServer(loss_fn, optax.adam(0.05),
                                   init_params(jnp.float32), num_workers=2,
                                   max_staleness=1)
  run_guarded(lambda: ps.run(make_batches(3, dtype=np.float32), 3))
  before = jax.device_get(ps.state)
  bad = make_batches(1, dtype=np.float32)[0]
  bad = dict(bad, x=np.full_like(bad['x'], np.nan))
  forever = iter(lambda: bad, None)           # an endless stream of NaN batches
  with pytest.raises(jaxpar.TooManySkippedError,
                     match=r'3 pushes in a row.*max_skipped=3.*step 3'):
    run_guarded(lambda: ps.run(forever, 5, max_skipped=3), timeout=30)
  assert not worker_threads()
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(ps.state), before)
  # The server goes on from there; a good update resets the count: with one
  # worker, NaN batches alternating with good ones never make 2 in a row.
  good = make_batches(4, dtype=np.float32)
  mixed = [b for pair in zip([bad] * 4, good) for b in pair]
  ps1 = jaxpar.AsyncParameterServer(loss_fn, optax.adam(0.05), before.params,
                                    num_workers=1, max_staleness=0)
  res = run_guarded(lambda: ps1.run(mixed, 4, max_skipped=2))
  np.testing.assert_array_equal(res.skipped, [0, 2, 4, 6])
  assert int(ps1.state.step) == 4


def test_simulate_skips_nan_updates(x64):
  batches, opt = nan_batches(10, bad=4), optax.adam(0.05)
  res = async_ps.simulate(loss_fn, opt, init_params(), batches,
                          staleness=np.zeros(10, int))
  np.testing.assert_array_equal(res.skipped, [4])
  assert np.isnan(res.losses[4]) and np.isfinite(np.delete(res.losses, 4)).all()
  tree_allclose(res.params, sequential(opt, init_params(),
                                       batches[:4] + batches[5:]), rtol=1e-10)
  # An inf loss (finite gradient) is skipped too.
  inf_loss = lambda p, b: loss_fn(p, b) + jnp.where(b['x'][0, 0] > 1e300,
                                                    jnp.inf, 0.0)
  big = [dict(b) for b in make_batches(3)]
  big[1]['x'] = big[1]['x'].copy()
  big[1]['x'][0, 0] = 1e301
  res = async_ps.simulate(inf_loss, opt, init_params(), big,
                          staleness=[0, 0, 0])
  np.testing.assert_array_equal(res.skipped, [1])


def test_worker_fault_surfaces_within_a_second():
  raised = []

  def batches():
    for i, batch in enumerate(make_batches(40, dtype=np.float32)):
      if i == 12:
        raised.append(time.monotonic())
        raise RuntimeError('iterator broke')
      yield batch
  ps = jaxpar.AsyncParameterServer(loss_fn, optax.sgd(0.05),
                                   init_params(jnp.float32), num_workers=4,
                                   max_staleness=2)
  run_guarded(lambda: ps.run(make_batches(4, dtype=np.float32), 4))  # compile
  with pytest.raises(RuntimeError, match='iterator broke'):
    run_guarded(lambda: ps.run(batches(), 40), timeout=30)
  assert time.monotonic() - raised[0] < 1.0


def test_too_few_batches():
  ps = jaxpar.AsyncParameterServer(loss_fn, optax.sgd(0.05),
                                   init_params(jnp.float32), num_workers=2,
                                   max_staleness=1)
  with pytest.raises(ValueError, match='has 5 batches but run'):
    ps.run(make_batches(5, dtype=np.float32), 10)
  with pytest.raises(ValueError, match='ran out after 5 batches'):
    run_guarded(lambda: ps.run(iter(make_batches(5, dtype=np.float32)), 10))
  assert int(ps.state.step) <= 5 and not worker_threads()
  with pytest.raises(ValueError, match='ran out after 2 batches'):
    async_ps.simulate(loss_fn, optax.sgd(0.1), init_params(jnp.float32),
                      make_batches(2, dtype=np.float32), staleness=[0, 1, 1])


def test_invalid_arguments():
  opt = optax.sgd(0.1)
  p = init_params(jnp.float32)
  make = lambda **kw: jaxpar.AsyncParameterServer(
      loss_fn, kw.pop('opt', opt), p, **{'num_workers': 2, 'max_staleness': 1,
                                         **kw})
  for bad, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError),
                     (True, TypeError)):
    with pytest.raises(error, match=f'num_workers={bad!r} must be an int'):
      make(num_workers=bad)
  with pytest.raises(ValueError, match='max_staleness=-1 must be an int >= 0'):
    make(max_staleness=-1)
  with pytest.raises(ValueError, match='num_workers=9 is more than the 8'):
    make(num_workers=9)
  with pytest.raises(ValueError, match='num_workers=3 is more than the 2'):
    make(num_workers=3, devices=jax.devices()[:2])
  with pytest.raises(ValueError, match='device twice'):
    make(devices=[jax.devices()[0]] * 2)
  with pytest.raises(TypeError, match='optax.GradientTransformation'):
    make(opt='adam')
  with pytest.raises(TypeError, match='loss_fn must be a callable'):
    jaxpar.AsyncParameterServer(None, opt, p, num_workers=1, max_staleness=0)
  with pytest.raises(ValueError, match='num_updates=0 must be an int >= 1'):
    make().run(make_batches(2), 0)

  batches = make_batches(3, dtype=np.float32)
  for staleness, match in [([0, 2, 0], r'staleness\[1\]=2 must be in \[0, 1\]'),
                           ([0, -1], r'staleness\[1\]=-1'),
                           ([], 'non-empty 1-D'), ([[0]], 'non-empty 1-D'),
                           ([0.0, 1.0], 'sequence of ints')]:
    with pytest.raises(ValueError, match=match):
      async_ps.simulate(loss_fn, opt, p, batches, staleness=staleness)
  with pytest.raises(TypeError, match='optax.GradientTransformation'):
    async_ps.simulate(loss_fn, 'sgd', p, batches, staleness=[0])
  with pytest.raises(TypeError, match='batches must be an iterable'):
    async_ps.simulate(loss_fn, opt, p, 3, staleness=[0])
  with pytest.raises(TypeError, match='batches must be an iterable'):
    make().run(None, 2)
