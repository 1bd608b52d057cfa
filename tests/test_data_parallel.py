"""Data parallelism equals single-device optax training on the global batch."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import (D_HID, D_IN, make_batches, mlp_loss, mlp_params,
                     reference_run, tree_allclose)


def loss_with_aux(params, batch):
  loss = mlp_loss(params, batch)
  return loss, {'loss_x2': 2.0 * loss}


@functools.cache
def adam_reference(max_grad_norm):
  """The float64 reference of ``test_matches_single_device_float64`` (call
  it under x64): computed once per ``max_grad_norm``."""
  return reference_run(mlp_params(dtype=jnp.float64),
                       make_batches(4, 32, dtype=np.float64), optax.adam(0.05),
                       max_grad_norm)


def parallel_run(step, params, batches, optimizer):
  state = jaxpar.TrainState.create(params, optimizer)
  history = []
  for batch in batches:
    state, stats = step(state, batch)
    assert not bool(stats.skipped)
    history.append((stats.loss, stats.grad_norm, state.params))
  return state, history


# Every pair of options together (4 runs, not all 8 triples: each is a
# program to compile); shard_map with clipping and 2 microbatches also in
# test_any_mesh_shape_float64 and in test_data_parallel_zero.py, on other
# meshes.
@pytest.mark.parametrize('backend,num_microbatches,max_grad_norm', [
    ('shard_map', 1, None), ('shard_map', 2, 0.5), ('pmap', 1, 0.5),
    ('pmap', 2, None)])
def test_matches_single_device_float64(x64, backend, num_microbatches,
                                       max_grad_norm):
  params = mlp_params(dtype=jnp.float64)
  batches = make_batches(4, 32, dtype=np.float64)
  optimizer = optax.adam(0.05)
  step = jaxpar.data_parallel.trainer(
      mlp_loss, optimizer, mesh=jaxpar.make_mesh(data=8), backend=backend,
      num_microbatches=num_microbatches, max_grad_norm=max_grad_norm).step
  state, got = parallel_run(step, params, batches, optimizer)
  tree_allclose(got, adam_reference(max_grad_norm), rtol=1e-10)
  assert int(state.step) == len(batches)
  if max_grad_norm is not None:  # the clipping really was exercised
    assert max(float(n) for _, n, _ in got) > max_grad_norm


@pytest.mark.parametrize('sizes', [dict(data=4), dict(data=2, stage=2, tensor=2),
                                   dict(data=1)])
def test_any_mesh_shape_float64(x64, sizes):
  n = sizes.get('data', 1) * sizes.get('stage', 1) * sizes.get('tensor', 1)
  mesh = jaxpar.make_mesh(**sizes, devices=jax.devices()[:n])
  params = mlp_params(dtype=jnp.float64)
  batches = make_batches(3, 16, dtype=np.float64)
  optimizer = optax.sgd(0.1, momentum=0.9)
  step = jaxpar.data_parallel.trainer(mlp_loss, optimizer, mesh=mesh,
                                   num_microbatches=2, max_grad_norm=0.5).step
  _, got = parallel_run(step, params, batches, optimizer)
  tree_allclose(got, reference_run(params, batches, optimizer, 0.5),
                rtol=1e-10)


def test_matches_single_device_float32():
  params = mlp_params()
  batches = make_batches(3, 64)
  optimizer = optax.adamw(0.01)
  step = jaxpar.data_parallel.trainer(mlp_loss, optimizer,
                                   mesh=jaxpar.make_mesh(data=8),
                                   num_microbatches=4, max_grad_norm=1.0).step
  _, got = parallel_run(step, params, batches, optimizer)
  tree_allclose(got, reference_run(params, batches, optimizer, 1.0), rtol=1e-5)


@pytest.mark.parametrize('backend', ['shard_map', 'pmap'])
def test_gradient_is_the_mean_not_n_times_it(x64, backend):
  """The shard_map pitfall: an implicit psum would make the step N x larger."""
  params = mlp_params(dtype=jnp.float64)
  batch = make_batches(1, 16, dtype=np.float64)[0]
  step = jaxpar.data_parallel.trainer(mlp_loss, optax.sgd(1.0),
                                   mesh=jaxpar.make_mesh(data=8),
                                   backend=backend).step
  state, _ = step(jaxpar.TrainState.create(params, optax.sgd(1.0)), batch)
  grads = jax.grad(mlp_loss)(params, batch)
  applied = jax.tree.map(jnp.subtract, params, state.params)
  tree_allclose(applied, grads, rtol=1e-12)


def test_aux_is_averaged(x64):
  params = mlp_params(dtype=jnp.float64)
  batch = make_batches(1, 16, dtype=np.float64)[0]
  step = jaxpar.data_parallel.trainer(loss_with_aux, optax.sgd(0.1),
                                   mesh=jaxpar.make_mesh(data=8),
                                   has_aux=True, num_microbatches=2).step
  _, stats = step(jaxpar.TrainState.create(params, optax.sgd(0.1)), batch)
  np.testing.assert_allclose(stats.aux['loss_x2'], 2 * mlp_loss(params, batch),
                             rtol=1e-12)


def test_accepts_numpy_and_unplaced_arrays_and_compiles_once():
  traces = []

  def counted_loss(params, batch):
    traces.append(1)
    return mlp_loss(params, batch)

  optimizer = optax.sgd(0.1)
  step = jaxpar.data_parallel.trainer(counted_loss, optimizer,
                                   mesh=jaxpar.make_mesh(data=8)).step
  state = jaxpar.TrainState.create(mlp_params(), optimizer)
  for i, batch in enumerate(make_batches(4, 16)):
    if i % 2:
      batch = jax.tree.map(jnp.asarray, batch)  # unplaced jax arrays
    state, _ = step(state, batch)
  after_first = len(traces)
  state, _ = step(state, make_batches(1, 16, seed=9)[0])
  assert len(traces) == after_first  # no retrace on later steps
  assert int(state.step) == 5


@pytest.mark.xla_defaults   # reads memory_analysis()
def test_microbatching_bounds_activation_memory():
  """Accumulating over k microbatches keeps one microbatch's activations."""
  wide, per_device = 256, 2048

  def big_loss(params, batch):
    h = jnp.tanh(batch['x'] @ params['w1'])   # [b, wide] activations
    h = jnp.tanh(h @ params['w2'])
    return (h.sum(-1) ** 2).mean()

  params = {'w1': jnp.ones((D_IN, wide)) / wide,
            'w2': jnp.ones((wide, wide)) / wide}
  batch = {'x': np.ones((8 * per_device, D_IN), np.float32)}
  state = jaxpar.TrainState.create(params, optax.sgd(0.1))
  temp = {}
  for k in (1, 8):
    step = jaxpar.data_parallel.trainer(big_loss, optax.sgd(0.1),
                                     mesh=jaxpar.make_mesh(data=8),
                                     num_microbatches=k).step
    temp[k] = step.lower(state, batch).compile().memory_analysis(
    ).temp_size_in_bytes
  activations = per_device * wide * 4  # one device's [b, wide] float32 activation
  assert temp[1] >= 2 * activations
  assert temp[8] < temp[1] / 3, temp


def test_non_finite_step_is_skipped():
  optimizer = optax.adam(0.1)
  step = jaxpar.data_parallel.trainer(mlp_loss, optimizer,
                                   mesh=jaxpar.make_mesh(data=8)).step
  state = jaxpar.TrainState.create(mlp_params(), optimizer)
  good, bad = make_batches(2, 16)
  bad['x'][3, 1] = np.nan
  new, stats = step(state, bad)
  assert bool(stats.skipped) and not np.isfinite(stats.loss)
  chex.assert_trees_all_equal(new, state)
  new, stats = step(new, good)
  assert not bool(stats.skipped) and int(new.step) == 1
  want = reference_run(mlp_params(), [good], optimizer)[0][2]
  tree_allclose(new.params, want, rtol=1e-5, atol=1e-6)


def test_infinite_gradient_is_skipped():
  def loss_inf_grad(params, batch):
    return jnp.sqrt(jnp.abs(params['out']['b'][0] - 0.1)) + mlp_loss(params, batch)

  step = jaxpar.data_parallel.trainer(loss_inf_grad, optax.sgd(0.1),
                                   mesh=jaxpar.make_mesh(data=8)).step
  state = jaxpar.TrainState.create(mlp_params(), optax.sgd(0.1))
  new, stats = step(state, make_batches(1, 16)[0])
  assert np.isfinite(stats.loss) and bool(stats.skipped)
  chex.assert_trees_all_equal(new.params, state.params)


@pytest.mark.parametrize('backend', ['shard_map', 'pmap'])
def test_integer_param_leaf_is_named(backend):
  """An int32 leaf in params: a TypeError naming its path and the fix, from
  ``init`` and from ``step`` on a state built elsewhere, before any trace
  (``jax.grad`` would fail naming no leaf)."""
  params = dict(mlp_params(), counts={'seen': jnp.zeros(3, jnp.int32)})
  trainer = jaxpar.data_parallel.trainer(
      mlp_loss, optax.adam(0.1), mesh=jaxpar.make_mesh(data=8),
      backend=backend)
  match = r"params leaf 'counts/seen' has dtype int32.*astype.*in the batch"
  with pytest.raises(TypeError, match=match):
    trainer.init(params)
  state = jaxpar.TrainState.create(params, optax.adam(0.1))
  with pytest.raises(TypeError, match=match):
    trainer.step(state, make_batches(1, 16)[0])


# -- The options shared with the 3D trainer: key, compute_dtype, remat_policy


KEY = 42


def dropout_loss(params, batch, key):
  """``mlp_loss`` with dropout on the hidden units: the key matters."""
  keep = jax.random.bernoulli(key, 0.7, (batch['x'].shape[0], D_HID))
  h = jnp.tanh(batch['x'] @ params['hidden']['w'] + params['hidden']['b'])
  y = (h * keep / 0.7) @ params['out']['w'] + params['out']['b']
  return optax.losses.squared_error(y, batch['y']).mean()


def keyed_reference_loss(num_microbatches):
  """What ``trainer(key=...)`` computes, on one device: step ``s``'s key
  ``fold_in(key, s)``, microbatch ``g`` of ``M`` (consecutive rows) with
  ``fold_in(that, g)``, the mean over the ``M`` microbatches."""
  def loss(params, batch, step):
    step_key = jax.random.fold_in(jax.random.key(KEY), step)
    mbs = jax.tree.map(lambda x: x.reshape(num_microbatches, -1,
                                           *x.shape[1:]), batch)
    losses = [dropout_loss(params, jax.tree.map(lambda x: x[g], mbs),
                           jax.random.fold_in(step_key, g))
              for g in range(num_microbatches)]
    return sum(losses) / num_microbatches
  return loss


@functools.cache
def keyed_reference():
  """Float64, 8 microbatches in all (call it under x64)."""
  return reference_run(mlp_params(dtype=jnp.float64),
                       make_batches(3, 32, dtype=np.float64), optax.adam(0.05),
                       loss_of=keyed_reference_loss(8), with_step=True)


# N x k = 8 microbatches in all, spread over devices differently: the masks
# follow the rows, not the mesh.
@pytest.mark.parametrize('backend,data,num_microbatches,zero_stage', [
    ('shard_map', 8, 1, 0), ('shard_map', 4, 2, 3), ('shard_map', 2, 4, 1),
    ('pmap', 4, 2, 0)])
def test_key_matches_single_device_float64(x64, backend, data,
                                           num_microbatches, zero_stage):
  trainer = jaxpar.data_parallel.trainer(
      dropout_loss, optax.adam(0.05), backend=backend, zero_stage=zero_stage,
      mesh=jaxpar.make_mesh(data=data, devices=jax.devices()[:data]),
      num_microbatches=num_microbatches, key=jax.random.key(KEY))
  state = trainer.init(mlp_params(dtype=jnp.float64))
  got = []
  for batch in make_batches(3, 32, dtype=np.float64):
    state, stats = trainer.step(state, batch)
    got.append((stats.loss, stats.grad_norm, trainer.params(state)))
  tree_allclose(got, keyed_reference(), rtol=1e-10)


def test_key_is_folded_with_the_step_and_the_microbatch(x64):
  """The reference above is not a fixed point: other key handling (one
  key for every step or every microbatch) gives other losses."""
  params = mlp_params(dtype=jnp.float64)
  batch = make_batches(1, 32, dtype=np.float64)[0]
  want = keyed_reference_loss(8)
  key = jax.random.key(KEY)
  assert abs(want(params, batch, 0) - want(params, batch, 1)) > 1e-3
  assert abs(want(params, batch, 0) - dropout_loss(
      params, batch, jax.random.fold_in(key, 0))) > 1e-3


def bf16_reference(params, batch, num_microbatches=1):
  """Loss and gradient of ``mlp_loss`` on params cast to bfloat16, on one
  device: the mean over ``num_microbatches`` consecutive slices of
  ``batch`` (each slice's gradient is rounded to bfloat16 by the cast's
  transpose, then they are averaged in float32, as the step does)."""
  def cast(p, mb):
    return mlp_loss(optax.tree.cast(p, jnp.bfloat16), mb).astype(jnp.float32)
  mbs = jax.tree.map(lambda x: x.reshape(num_microbatches, -1, *x.shape[1:]),
                     batch)
  loss, grads = jax.vmap(jax.value_and_grad(cast), in_axes=(None, 0))(
      params, mbs)
  return loss.mean(), jax.tree.map(lambda g: g.mean(0), grads)


@pytest.mark.parametrize('backend,zero_stage', [
    ('shard_map', 0), ('shard_map', 3), ('pmap', 0)])
def test_compute_dtype_casts_params_inside_the_loss(backend, zero_stage):
  """float32 batch: the maths is float32 on bfloat16-rounded params, so the
  step equals the one-device reference (16 microbatches: 8 devices x 2) to
  float32 rounding, and differs from the uncast loss's gradient."""
  params = mlp_params()
  batch = make_batches(1, 32)[0]
  trainer = jaxpar.data_parallel.trainer(
      mlp_loss, optax.sgd(1.0), mesh=jaxpar.make_mesh(data=8), backend=backend,
      zero_stage=zero_stage, num_microbatches=2, compute_dtype=jnp.bfloat16)
  state = trainer.init(params)
  assert state.params['out']['w'].dtype == jnp.float32
  new, stats = trainer.step(state, batch)
  want_loss, want_grads = bf16_reference(params, batch, 16)
  applied = jax.tree.map(jnp.subtract, params, trainer.params(new))
  np.testing.assert_allclose(stats.loss, want_loss, rtol=1e-5)
  tree_allclose(applied, want_grads, rtol=1e-5, atol=1e-6)
  plain = jax.grad(mlp_loss)(params, batch)
  assert max(jax.tree.leaves(jax.tree.map(
      lambda a, b: float(jnp.max(jnp.abs(a - b))), applied, plain))) > 1e-4
  assert stats.loss.dtype == jnp.float32
  assert all(x.dtype == jnp.float32
             for x in jax.tree.leaves((new.params, new.opt_state)))


def test_compute_dtype_bfloat16_batch_loosely():
  """A bfloat16 batch: the loss runs in bfloat16 (each device, each
  microbatch), comes back float32, and follows the reference loosely."""
  params = mlp_params()
  batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                       make_batches(1, 32)[0])
  trainer = jaxpar.data_parallel.trainer(
      mlp_loss, optax.sgd(1.0), mesh=jaxpar.make_mesh(data=8),
      num_microbatches=2, compute_dtype='bfloat16')
  new, stats = trainer.step(trainer.init(params), batch)
  want_loss, want_grads = bf16_reference(params, batch)
  assert stats.loss.dtype == jnp.float32
  np.testing.assert_allclose(stats.loss, want_loss, rtol=2e-2)
  applied = jax.tree.map(jnp.subtract, params, trainer.params(new))
  tree_allclose(applied, want_grads, rtol=5e-2, atol=2e-2)


@pytest.mark.parametrize('remat_policy,zero_stage', [
    ('nothing', 0), ('dots', 3), ('everything', 1),
    (jax.checkpoint_policies.dots_with_no_batch_dims_saveable, 0)])
def test_remat_policy_matches_single_device_float64(x64, remat_policy,
                                                    zero_stage):
  trainer = jaxpar.data_parallel.trainer(
      mlp_loss, optax.adam(0.05), mesh=jaxpar.make_mesh(data=8),
      num_microbatches=2, max_grad_norm=0.5, zero_stage=zero_stage,
      remat_policy=remat_policy)
  state = trainer.init(mlp_params(dtype=jnp.float64))
  got = []
  for batch in make_batches(4, 32, dtype=np.float64):
    state, stats = trainer.step(state, batch)
    got.append((stats.loss, stats.grad_norm, trainer.params(state)))
  tree_allclose(got, adam_reference(0.5), rtol=1e-10)


def test_remat_policy_decides_what_the_backward_keeps(capsys):
  """``remat_policy`` is ``jax.checkpoint`` of the loss: with ``'nothing'``
  the backward keeps only the inputs, without remat the [b, D_HID]
  activations too."""
  from jax.ad_checkpoint import print_saved_residuals
  from jaxpar.data_parallel import _trainer

  def saved(remat_policy):
    options = _trainer._check_options(
        mlp_loss, optax.sgd(0.1), carries_state=False,
        mesh=jaxpar.make_mesh(data=8), data_axis='data', max_grad_norm=None,
        num_microbatches=1, zero_stage=0, has_aux=False, backend='shard_map',
        key=None, compute_dtype=None, remat_policy=remat_policy)
    print_saved_residuals(
        _trainer._differentiated(mlp_loss, options, lifted=()),
        mlp_params(), None, make_batches(1, 16)[0], None)
    return capsys.readouterr().out

  assert 'f32[16,7]' in saved(None)
  assert 'f32[16,7]' not in saved('nothing')


class TestErrors:
  mesh = None

  def step(self, fn=mlp_loss, **kw):
    kw.setdefault('mesh', jaxpar.make_mesh(data=8))
    return jaxpar.data_parallel.trainer(fn, optax.sgd(0.1), **kw).step

  def state(self):
    return jaxpar.TrainState.create(mlp_params(), optax.sgd(0.1))

  def test_batch_not_divisible(self):
    step = self.step(num_microbatches=2)
    with pytest.raises(ValueError, match=r'batch size 24 .* data size 8 x '
                       r'num_microbatches 2 = 16'):
      step(self.state(), make_batches(1, 24)[0])

  def test_mesh_without_axis(self):
    with pytest.raises(ValueError, match="no axis 'batch'.*'data', 'stage', "
                       "'tensor'"):
      self.step(data_axis='batch')

  def test_non_scalar_loss(self):
    step = self.step(fn=lambda p, b: (b['x'] @ p['hidden']['w']).sum(-1))
    with pytest.raises(TypeError, match='must return a scalar'):
      step(self.state(), make_batches(1, 16)[0])

  def test_ragged_batch(self):
    batch = make_batches(1, 16)[0]
    batch['y'] = batch['y'][:8]
    with pytest.raises(ValueError, match=r"different leading.*\['x'\]: 16.*"
                       r"\['y'\]: 8"):
      self.step()(self.state(), batch)

  def test_not_an_optax_optimizer(self):
    with pytest.raises(TypeError, match='optax.GradientTransformation'):
      jaxpar.data_parallel.trainer(mlp_loss, lambda g: g,
                                mesh=jaxpar.make_mesh(data=8)).step

  def test_bad_options(self):
    with pytest.raises(ValueError, match='num_microbatches=0'):
      self.step(num_microbatches=0)
    with pytest.raises(ValueError, match='max_grad_norm=-1'):
      self.step(max_grad_norm=-1)
    with pytest.raises(ValueError, match="backend='vmap'"):
      self.step(backend='vmap')
    with pytest.raises(ValueError, match='zero_stage=2'):
      self.step(zero_stage=2)
    with pytest.raises(TypeError, match='key must be one PRNG key'):
      self.step(key=0)
    with pytest.raises(TypeError, match="compute_dtype='int8'"):
      self.step(compute_dtype='int8')
    with pytest.raises(ValueError, match="remat_policy='some'"):
      self.step(remat_policy='some')

  def test_key_needs_a_key_keyword(self):
    with pytest.raises(TypeError, match=r'loss_fn\(params, batch\) does not '
                       r'take key=.*calls loss_fn\(params, batch, key=k\)'):
      self.step(key=jax.random.key(0))


# -- An NNX model with BatchNorm: params and running statistics ---------------


class BatchNormMLP(nnx.Module):
  """``x -> linear -> BatchNorm -> relu -> linear``, float64 (BatchNorm's
  running statistics are float32, as Flax stores them)."""

  def __init__(self, axis_name=None, *, rngs):
    f64 = {'param_dtype': jnp.float64, 'rngs': rngs}
    self.l1 = nnx.Linear(4, 8, use_bias=False, **f64)  # BN cancels a bias
    self.bn = nnx.BatchNorm(8, axis_name=axis_name, dtype=jnp.float64, **f64)
    self.l2 = nnx.Linear(8, 2, **f64)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.bn(self.l1(x))))


# Flax stores BatchNorm's statistics in float32 and warns when a float64
# forward writes them (its behaviour; the values are exact to float32).
flax_float32_stats = pytest.mark.filterwarnings(
    'ignore:scatter inputs have incompatible types:FutureWarning')


def bn_loss(m, batch):
  return jnp.mean((m(batch[0]) - batch[1]) ** 2)


def bn_batches(num):
  rng = np.random.default_rng(0)
  return [(rng.normal(size=(32, 4)), rng.normal(size=(32, 2)))
          for _ in range(num)]


@functools.cache
def bn_reference(num_microbatches, n=8):
  """The model as written on one device, ``nnx.Optimizer`` on the global
  batch; with ``k`` microbatches the step's loss is the mean over the ``k``
  global microbatches (microbatch ``i``: every device's ``i``-th), run in
  order through the one model (its statistics updated after each)."""
  model = BatchNormMLP(rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  k = num_microbatches

  def micro(x, i):
    return x.reshape(n, k, -1, *x.shape[1:])[:, i].reshape(-1, *x.shape[1:])

  @nnx.jit
  def step(model, opt, batch):
    loss = lambda m: sum(bn_loss(m, (micro(batch[0], i), micro(batch[1], i)))
                         for i in range(k)) / k
    opt.update(model, nnx.grad(loss)(model))

  for batch in bn_batches(2):
    step(model, opt, batch)
  return nnx.to_pure_dict(nnx.state(model))


@flax_float32_stats
@pytest.mark.parametrize('zero_stage,num_microbatches', [(0, 1), (1, 2),
                                                         (3, 2)])
def test_nnx_batchnorm_synced_matches_one_device(x64, zero_stage,
                                                 num_microbatches):
  """``from_nnx`` of a model whose BatchNorm syncs over ``data``: params and
  running statistics come back equal to the one-device ``nnx.Optimizer``
  loop (float64; the statistics float32, to the bit), the statistics
  threaded through the microbatches in order; the up-front check traces the
  loss with the ``data`` axis bound."""
  model = BatchNormMLP('data', rngs=nnx.Rngs(0))
  m = jaxpar.data_parallel.from_nnx(model, loss=bn_loss)
  trainer = jaxpar.data_parallel.model_trainer(
      m, optax.adam(1e-2), mesh=jaxpar.make_mesh(data=8),
      zero_stage=zero_stage, num_microbatches=num_microbatches)
  state = trainer.init(m.params, m.model_state)
  for batch in bn_batches(2):
    state, stats = trainer.step(state, batch)
  m.update(model, trainer.params(state), state.model_state)
  want = bn_reference(num_microbatches)
  tree_allclose(nnx.to_pure_dict(nnx.state(model)), want, rtol=1e-9,
                atol=1e-12)
  assert float(jnp.abs(model.bn.mean[...]).max()) > 1e-3   # they moved
  np.testing.assert_array_equal(model.bn.var[...], want['bn']['var'])


@flax_float32_stats
def test_nnx_batchnorm_unsynced_statistics_are_averaged(x64):
  """Without ``axis_name`` each device normalises its own shard; the running
  statistics that come back are the mean over ``data`` of the devices':
  the running mean that of the global batch, the running variance the mean
  of the shards' (biased) variances."""
  model = BatchNormMLP(rngs=nnx.Rngs(0))
  m = jaxpar.data_parallel.from_nnx(model, loss=bn_loss)
  trainer = jaxpar.data_parallel.model_trainer(m, optax.sgd(0.1),
                                               mesh=jaxpar.make_mesh(data=8))
  x, y = bn_batches(1)[0]
  state, _ = trainer.step(trainer.init(m.params, m.model_state), (x, y))
  h = model.l1(x).reshape(8, 4, 8)                  # [device, row, feature]
  momentum = model.bn.momentum
  want_mean = (1 - momentum) * h.mean(axis=(0, 1))
  want_var = momentum + (1 - momentum) * h.var(axis=1).mean(0)
  np.testing.assert_allclose(state.model_state['bn']['mean'], want_mean,
                             rtol=1e-6)
  np.testing.assert_allclose(state.model_state['bn']['var'], want_var,
                             rtol=1e-6)
  assert not np.allclose(want_var, momentum + (1 - momentum) * h.reshape(
      32, 8).var(0), rtol=1e-3)   # not the global batch's variance


@flax_float32_stats
def test_from_nnx_bad_inputs(x64):
  model = BatchNormMLP(rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match='must be a Flax NNX module'):
    jaxpar.data_parallel.from_nnx(lambda x: x, loss=bn_loss)
  with pytest.raises(TypeError, match=r'loss must be a function loss\(m, '):
    jaxpar.data_parallel.from_nnx(model, loss=None)
  m = jaxpar.data_parallel.from_nnx(model, loss=bn_loss)
  # A model and a loss function train through different entries.
  with pytest.raises(TypeError, match=r'trains with data_parallel\.'
                     r'model_trainer\(model, optimizer, mesh=\.\.\.\)'):
    jaxpar.data_parallel.trainer(m, optax.sgd(0.1),
                                 mesh=jaxpar.make_mesh(data=8))
  with pytest.raises(TypeError, match=r'got function; a loss function '
                     r'trains with data_parallel\.trainer\(loss_fn'):
    jaxpar.data_parallel.model_trainer(mlp_loss, optax.sgd(0.1),
                                       mesh=jaxpar.make_mesh(data=8))

  def grows(m, batch):       # a forward that adds a variable
    m.extra = nnx.BatchStat(jnp.zeros(3))
    return bn_loss(m, batch)
  trainer = jaxpar.data_parallel.model_trainer(
      jaxpar.data_parallel.from_nnx(model, loss=grows), optax.sgd(0.1),
      mesh=jaxpar.make_mesh(data=8))
  state = jaxpar.TrainState.create(m.params, optax.sgd(0.1), m.model_state)
  with pytest.raises(ValueError, match='may update variables but not add'):
    trainer.step(state, bn_batches(1)[0])
