"""ZeRO-1/3 equal single-device optax training, with 1/N state per device."""

import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
import jaxpar.hlo
from jaxpar import data_parallel as dp
from jaxpar.cli.bench import memory as memory_bench
from jaxpar.cli.bench import zero as zero_bench
from jaxpar.data_parallel import internal as dp_internal
from jaxpar.train_state import internal as ts_internal
from helpers import make_batches, mlp_loss, reference_run, tree_allclose

MESHES = {'data8': dict(data=8), 'data4': dict(data=4),
          'data2_stage2_tensor2': dict(data=2, stage=2, tensor=2)}


def mesh_of(name):
  sizes = MESHES[name]
  return jaxpar.make_mesh(**sizes, devices=jax.devices()[:math.prod(
      sizes.values())])


def normal(seed, *shapes, dtype):
  """NumPy draws: host arrays are placed on a mesh without a compiled slicing
  program (a one-device jax array would need one per shape)."""
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


def wide_params(hidden=16, dtype=jnp.float32):
  """Leaves that split 8 ways, but one (out.b, 3 elements) stored padded."""
  w1, w2 = normal(3, (5, hidden), (hidden, 3), dtype=dtype)
  return {'hidden': {'w': w1 / 3, 'b': np.zeros(hidden, dtype)},
          'out': {'w': w2 / hidden**0.5, 'b': np.full(3, 0.1, dtype)}}


def zero_run(trainer, state, batches):
  history = []
  for batch in batches:
    state, stats = trainer.step(state, batch)
    assert not bool(stats.skipped)
    history.append((stats.loss, stats.grad_norm, trainer.params(state)))
  return state, history


def logical(tree):
  """``tree`` on the host at its logical shapes (``np.asarray`` of each
  leaf: a ``Padded`` one without its padding)."""
  return jax.tree.map(np.asarray, tree,
                      is_leaf=lambda x: isinstance(x, dp.Padded))


def spec_of(x):
  """``x``'s PartitionSpec without trailing ``None``s (``P(None,) == P()``)."""
  entries = list(x.sharding.spec)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def spec_tree(tree):
  return jax.tree.map(spec_of, tree)


@pytest.mark.parametrize('stage,mesh_name', [
    (1, 'data8'), (3, 'data8'), (3, 'data2_stage2_tensor2')])
def test_matches_single_device_float64(x64, stage, mesh_name):
  mesh = mesh_of(mesh_name)
  params = wide_params(dtype=jnp.float64)
  batches = make_batches(3, 16, dtype=np.float64)
  optimizer = optax.adamw(0.05, weight_decay=0.1)
  trainer = dp.trainer(wide_loss, optimizer, mesh=mesh, zero_stage=stage,
                       num_microbatches=2, max_grad_norm=0.5)
  state = dp.shard_state(jaxpar.TrainState.create(params, optimizer),
                         mesh=mesh, zero_stage=stage)
  state, got = zero_run(trainer, state, batches)
  tree_allclose(got, adamw_reference(), rtol=1e-10)
  assert max(float(norm) for _, norm, _ in got) > 0.5  # clipping was active
  assert int(state.step) == len(batches)
  mu = state.opt_state[0].mu
  assert spec_of(mu['hidden']['w']) == P(None, 'data')
  # 3 does not split N ways: padded to N.
  assert isinstance(mu['out']['b'], dp.Padded)
  assert spec_of(mu['out']['b']) == P('data')
  params_spec = spec_of(state.params['out']['w'])
  assert params_spec == (P('data') if stage == 3 else P())


@functools.cache
def adamw_reference():
  """The float64 reference of ``test_matches_single_device_float64`` (call
  it under x64): computed once for its 3 cases."""
  return reference_run(wide_params(dtype=jnp.float64),
                       make_batches(3, 16, dtype=np.float64),
                       optax.adamw(0.05, weight_decay=0.1), 0.5,
                       loss_of=wide_loss)


def wide_loss(params, batch):
  h = jnp.tanh(batch['x'] @ params['hidden']['w'] + params['hidden']['b'])
  y = h @ params['out']['w'] + params['out']['b']
  return optax.losses.squared_error(y, batch['y']).mean()


def test_float32_with_aux_compiles_once():
  traces = []

  def counted_loss(params, batch):
    traces.append(1)
    loss = wide_loss(params, batch)
    return loss, {'loss_x2': 2.0 * loss}

  mesh = jaxpar.make_mesh(data=8)
  params, batches = wide_params(), make_batches(3, 64)
  optimizer = optax.sgd(0.1, momentum=0.9)
  trainer = dp.trainer(counted_loss, optimizer, mesh=mesh,
                       zero_stage=3, num_microbatches=4,
                       max_grad_norm=1.0, has_aux=True)
  want = reference_run(params, batches, optimizer, 1.0, loss_of=wide_loss)
  state = trainer.init(params)
  got = []
  for batch, (want_loss, _, _) in zip(batches, want):
    state, stats = trainer.step(state, batch)
    np.testing.assert_allclose(stats.aux['loss_x2'], 2 * want_loss, rtol=1e-5)
    got.append((stats.loss, stats.grad_norm, trainer.params(state)))
    if len(got) == 1:
      after_first = len(traces)
  tree_allclose(got, want, rtol=1e-5)
  assert len(traces) == after_first   # no retrace on later steps


@pytest.mark.parametrize('stage', [1, 3])
def test_gradient_is_the_mean_not_n_times_it(x64, stage):
  """Reduce-scatter sums over devices: the step must divide by N once."""
  mesh = jaxpar.make_mesh(data=8)
  params = wide_params(dtype=jnp.float64)
  batch = make_batches(1, 16, dtype=np.float64)[0]
  trainer = dp.trainer(wide_loss, optax.sgd(1.0), mesh=mesh,
                       zero_stage=stage)
  state, _ = trainer.step(trainer.init(params), batch)
  applied = jax.tree.map(jnp.subtract, params, trainer.params(state))
  tree_allclose(applied, jax.grad(wide_loss)(params, batch), rtol=1e-12)


@pytest.fixture(scope='module')
def adam_steps():
  """One float32 Adam step per stage on data=8: (trainer, before, after)."""
  mesh = jaxpar.make_mesh(data=8)
  batch = make_batches(1, 16)[0]
  out = {}
  for stage in (0, 1, 3):
    trainer = dp.trainer(wide_loss, optax.adam(0.01), mesh=mesh,
                         zero_stage=stage)
    state = trainer.init(wide_params(400))
    out[stage] = (trainer, state, trainer.step(state, batch)[0])
  return out


def device_bytes(arrays):
  """(bytes on device 0, bytes of the global arrays)."""
  return (sum(x.addressable_shards[0].data.nbytes for x in arrays),
          sum(x.nbytes for x in arrays))


@pytest.mark.parametrize('stage', [1, 3])
def test_each_device_holds_one_nth(adam_steps, stage):
  n = 8
  _, _, state = adam_steps[stage]
  split = 4 * (2000 + 400 + 1200)      # the leaves that split 8 ways
  odd = 4 * 3                          # out.b: padded to 8, one per device
  mu_nu = jax.tree.leaves((state.opt_state[0].mu, state.opt_state[0].nu))
  assert device_bytes(mu_nu) == (2 * (split // n + 4), 2 * (split + 4 * n))
  params = jax.tree.leaves(state.params)
  if stage == 3:
    assert device_bytes(params) == (split // n + 4, split + 4 * n)
    w = state.params['hidden']['w']
    assert w.sharding.shard_shape(w.shape) == (5, 50)
  else:
    assert device_bytes(params) == (split + odd, split + odd)  # replicated
  held = dp.bytes_per_device(state)
  assert held.params == device_bytes(params)[0]
  assert held.opt_state == device_bytes(mu_nu)[0] + 2 * 4  # + 2 counts
  plain = adam_steps[0][2]
  assert device_bytes(jax.tree.leaves(plain.opt_state[0].mu))[0] == split + odd


@pytest.mark.parametrize('stage', [1, 3])
def test_params_for_evaluation_stay_sharded(adam_steps, stage):
  """Trainer.params gives every leaf in its shards (but padded ones)."""
  trainer, _, state = adam_steps[stage]
  params = trainer.params(state)
  shard = lambda x: x.sharding.shard_shape(x.shape)
  assert params['out']['b'].shape == (3,)   # logical, whole
  del params['out']['b']
  stored = dict(state.params, out={'w': state.params['out']['w']})
  assert jax.tree.map(shard, params) == jax.tree.map(shard, stored)
  w = params['hidden']['w']
  assert shard(w) == ((5, 50) if stage == 3 else (5, 400))
  np.testing.assert_array_equal(w, state.params['hidden']['w'])
  # Plain jnp code evaluates them where they are (Auto axes).
  out = jax.jit(lambda p, x: jnp.tanh(x @ p['hidden']['w']))(
      params, np.ones((2, 5), np.float32))
  np.testing.assert_allclose(out, np.tanh(np.ones((2, 5)) @ np.asarray(w)),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('stage', [0, 1, 3])
def test_collectives_in_compiled_step(adam_steps, stage):
  """Byte for byte the theory of the zero_communication bench."""
  trainer, state, _ = adam_steps[stage]
  compiled = trainer.step.lower(state, make_batches(1, 16)[0]).compile()
  moved = jaxpar.hlo.collective_bytes(compiled)
  want = zero_bench.theory(wide_params(400), mesh=jaxpar.make_mesh(data=8),
                           zero_stage=stage)
  assert moved == {kind: want.get(kind, (0,))[0] for kind in jaxpar.hlo.KINDS}
  split, odd, loss = 4 * (2000 + 400 + 1200), 4 * 3, 4    # by hand, too
  if stage == 0:    # one all-reduce: every gradient and the loss
    assert moved['all-reduce'] == split + odd + loss
  else:             # the loss, 4 partial norms; out.b padded to 8
    assert moved['reduce-scatter'] == split + 4 * 8
    assert moved['all-reduce'] == loss + 4 * 4 + (odd if stage == 1 else 0)
    assert moved['all-gather'] == split + (0 if stage == 1 else 4 * 8)


def test_stage3_backward_regathers_instead_of_saving_params(capsys):
  mesh = jaxpar.make_mesh(data=8)
  params = wide_params()
  specs = dp.data_specs(params, mesh=mesh)
  sliced = jax.device_put(params, ts_internal.shardings(mesh, specs))
  batch = jax.device_put(make_batches(1, 16)[0], NamedSharding(mesh, P('data')))

  def residual_shapes(fn):
    """Shapes of what ``fn``'s backward pass keeps, on one device."""
    def body(local, batch):
      print_saved_residuals(fn, local, batch)
      return local
    with jax.set_mesh(mesh):
      jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P('data')),
                            out_specs=specs)).trace(sliced, batch)
    return {tuple(int(d) for d in dims.split(',') if d) for dims in
            re.findall(r'^f32\[([\d,]*)\]', capsys.readouterr().out, re.M)}

  full = {(5, 16), (16,), (16, 3)}   # gathered shapes
  plain = residual_shapes(
      lambda p, b: wide_loss(dp.gather(p, specs, data_axis='data'), b))
  remat = residual_shapes(dp.gathered(wide_loss, specs, data_axis='data'))
  assert full & plain           # without remat a gathered param is kept
  assert not full & remat       # with it, only the slices are
  assert {(5, 2), (2, 3)} <= remat


@pytest.mark.parametrize('stage', [1, 3])
def test_non_finite_step_is_skipped(adam_steps, stage):
  trainer, state, _ = adam_steps[stage]
  bad = make_batches(1, 16)[0]
  bad['x'][3, 1] = np.nan
  new, stats = trainer.step(state, bad)
  assert bool(stats.skipped) and not np.isfinite(stats.loss)
  chex.assert_trees_all_equal(new, state)


def test_layouts_and_round_trip():
  params = wide_params()
  plain = jaxpar.TrainState.create(params, optax.adam(0.1))
  for stage in (1, 3):
    for name in ('data8', 'data4', 'data2_stage2_tensor2'):
      mesh = mesh_of(name)
      state = dp.shard_state(plain, mesh=mesh, zero_stage=stage)
      chex.assert_trees_all_equal(logical(state.params), params)
      # Another stage or mesh: shard_state re-lays out any state.
      back = dp.shard_state(state, mesh=mesh, zero_stage=0)
      chex.assert_trees_all_equal(back, plain)
      assert all(s == P() for s in jax.tree.leaves(spec_tree(back)))
      again = dp.shard_state(state, mesh=mesh_of('data4'), zero_stage=1)
      chex.assert_trees_all_equal(logical(again), plain)
  assert dp.data_spec((8, 6), P(None, 'tensor'), mesh=mesh_of(
      'data2_stage2_tensor2')) == P('data', 'tensor')
  assert dp.data_spec((6, 3), mesh=mesh_of('data4')) == P()
  assert dp.data_spec((6, 3), mesh=mesh_of('data4'), pad=True) == P('data')
  assert dp.data_spec((3, 0), mesh=mesh_of('data4'), pad=True) == P()


def test_checkpoint_restores_onto_another_mesh_and_stage(tmp_path, x64):
  """A padded ZeRO-3 state on data=6 resumes as ZeRO-1 on 4 devices."""
  params = wide_params(dtype=jnp.float64)
  batches = make_batches(2, 24, dtype=np.float64)
  optimizer = optax.adam(0.05)
  trainer6 = dp.trainer(wide_loss, optimizer,
                        mesh=data6_mesh(), zero_stage=3)
  state, _ = trainer6.step(trainer6.init(params), batches[0])
  assert isinstance(state.params['hidden']['w'], dp.Padded)   # 16 rows
  trainer4 = dp.trainer(wide_loss, optimizer,
                        mesh=mesh_of('data4'), zero_stage=1)
  like = trainer4.init(params)
  jaxpar.checkpoint.save(tmp_path / 'ckpt', state)
  restored = jaxpar.checkpoint.restore(tmp_path / 'ckpt', like)
  chex.assert_trees_all_equal(logical(restored), logical(state))
  assert spec_tree(restored) == spec_tree(like)
  state, stats = trainer4.step(restored, batches[1])
  want = reference_run(params, batches, optimizer, loss_of=wide_loss)
  np.testing.assert_allclose(stats.loss, want[1][0], rtol=1e-10)
  tree_allclose(trainer4.params(state), want[1][2], rtol=1e-10)


# -- Leaves that no data size divides: padded, exact, 1/N per device --------


def data6_mesh():
  return jaxpar.make_mesh(data=6, devices=jax.devices()[:6])


def odd_params(dtype=jnp.float64):
  """No dim divides by 2..8 (but 7 for w1's 7), and two zero-size leaves."""
  w1, w2 = normal(5, (7, 13), (13, 5), dtype=dtype)
  return {'w1': w1 / 3, 'b1': np.full(13, 0.1, dtype), 'w2': w2 / 4,
          'b2': np.zeros(5, dtype),
          'empty': np.zeros((3, 0), dtype), 'none': np.zeros(0, dtype)}


def odd_loss(params, batch):
  h = jnp.tanh(batch['x'] @ params['w1'] + params['b1'])
  y = h @ params['w2'] + params['b2'] + jnp.sum(params['empty'])
  return optax.losses.squared_error(y, batch['y']).mean()


def per_leaf_optimizer():
  """Adam, LAMB (trust ratio per leaf) and Adafactor (factored moments of
  w1): padding must not enter their statistics."""
  labels = {'w1': 'adafactor', 'b1': 'adam', 'w2': 'lamb', 'b2': 'lamb',
            'empty': 'adam', 'none': 'adam'}
  return optax.partition(
      {'adam': optax.adamw(0.05, weight_decay=0.1), 'lamb': optax.lamb(0.05),
       'adafactor': optax.adafactor(0.05, min_dim_size_to_factor=4)}, labels)


def odd_batches(dtype=np.float64):
  rng = np.random.default_rng(2)
  return [{'x': rng.normal(size=(24, 7)).astype(dtype),
           'y': rng.normal(size=(24, 5)).astype(dtype)} for _ in range(2)]


def padding_entries(tree):
  """Every stored entry of every Padded leaf outside its logical shape."""
  out = []
  for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, dp.Padded)):
    if isinstance(x, dp.Padded):
      value = np.array(x.value)
      value[tuple(slice(0, s) for s in x.shape)] = 0
      out.append(value)
  return out


@functools.cache
def odd_reference():
  """One device, float64 (call it with x64 on): clipping and the per-leaf
  optimizers, ``reference_run``'s jitted optax step."""
  return reference_run(odd_params(), odd_batches(), per_leaf_optimizer(),
                       0.5, loss_of=odd_loss)


@pytest.mark.parametrize('stage,num_microbatches', [(0, 2), (1, 1), (3, 2)])
def test_padded_leaves_exact_float64(x64, stage, num_microbatches):
  params, batches = odd_params(), odd_batches()
  optimizer = per_leaf_optimizer()
  trainer = dp.trainer(
      odd_loss, optimizer, mesh=data6_mesh(), zero_stage=stage,
      num_microbatches=num_microbatches, max_grad_norm=0.5)
  state = trainer.init(params)
  got = []
  for batch in batches:
    state, stats = trainer.step(state, batch)
    got.append((stats.loss, stats.grad_norm, trainer.params(state)))
  tree_allclose(got, odd_reference(), rtol=1e-10)
  assert jax.tree.map(np.shape, got[-1][2]) == jax.tree.map(np.shape, params)
  stored = padding_entries(state)
  # mu, nu of b1 (adam), w2 and b2 (lamb); ZeRO-3: w1, b1, w2, b2 too.
  assert len(stored) == {0: 0, 1: 6, 3: 10}[stage]
  assert all(not v.any() for v in stored)           # padding stays zero


@pytest.mark.xla_defaults   # reads memory_analysis()
def test_each_device_holds_one_nth_on_data6():
  """data=6 and leaves no mesh size divides: 1/6 per device, + one row."""
  embed, w = normal(0, (1003, 61), (61, 257), dtype=np.float32)
  params = {'embed': embed / 8, 'w': w / 8, 'b': np.zeros(257, np.float32)}
  rows = 4 * (61 + 61 + 1)   # one padded row (embed) / column (w) / entry
  total = 4 * (1003 * 61 + 61 * 257 + 257)

  def loss(p, batch):
    y = p['embed'][batch['ids']] @ p['w'] + p['b']
    return jnp.mean(jnp.square(y))

  batch = {'ids': np.arange(12, dtype=np.int32)}
  held = {}
  for stage in (0, 1, 3):
    trainer = dp.trainer(loss, optax.adam(0.1),
                         mesh=data6_mesh(), zero_stage=stage)
    state = trainer.init(params)
    held[stage] = dp.bytes_per_device(state)
  counts = 4 + 4   # step, adam count
  assert held[0] == (total, 2 * total + counts)
  assert held[1].params == total
  assert held[1].opt_state <= 2 * (1.1 * total / 6 + rows) + counts
  assert held[3].params <= 1.1 * total / 6 + rows
  assert held[3].opt_state == held[1].opt_state
  # The compiled ZeRO-3 step holds the same: its arguments are the state
  # (1/6 + padding) and the batch.
  new, _ = trainer.step(state, batch)
  assert dp.bytes_per_device(new) == held[3]
  args = trainer.step.lower(state, batch).compile().memory_analysis(
      ).argument_size_in_bytes
  assert args <= sum(held[3]) + batch['ids'].nbytes


def test_masked_states_split_like_plain_ones(x64):
  """optax.masked and multi_transform states: 1/N per device, exact."""
  params = wide_params(hidden=400, dtype=jnp.float64)
  frozen = {'hidden': 'train', 'out': {'w': 'train', 'b': 'frozen'}}
  optimizer = optax.chain(
      optax.masked(optax.trace(0.9), {'hidden': {'w': True, 'b': False},
                                      'out': {'w': True, 'b': False}}),
      optax.multi_transform({'train': optax.adam(0.05),
                             'frozen': optax.set_to_zero()}, frozen))
  mesh = jaxpar.make_mesh(data=8)
  trainer = dp.trainer(wide_loss, optimizer, mesh=mesh,
                       zero_stage=1)
  batches = make_batches(2, 16, dtype=np.float64)
  state = trainer.init(params)
  got = []
  for batch in batches:
    state, stats = trainer.step(state, batch)
    got.append((stats.loss, stats.grad_norm, trainer.params(state)))
  tree_allclose(got, reference_run(params, batches, optimizer,
                                   loss_of=wide_loss), rtol=1e-10)
  # Every params-shaped optimizer leaf is split over data.
  trace = state.opt_state[0].inner_state.trace
  adam = state.opt_state[1].inner_states['train'].inner_state[0]
  leaves = jax.tree.leaves((trace, adam.mu, adam.nu))
  assert len(leaves) == 2 + 3 + 3
  for leaf in leaves:
    assert dp.data_dim(leaf.sharding.spec) is not None, leaf.shape
  split = 8 * (5 * 400 + 400 + 400 * 3)   # float64 w1, b1, w2
  held = dp.bytes_per_device(state).opt_state
  trace_bytes = 8 * (5 * 400 + 400 * 3)
  assert held <= (trace_bytes + 2 * split) / 8 + 8 * 4  # + counts


def test_masked_state_specs_follow_the_params():
  """The 3D layout too: a multi_transform state is split like the params
  (over tensor/stage always, over data with ZeRO), MaskedNodes kept."""
  params = {'w': jnp.ones((4, 8)), 'b': jnp.ones(8)}
  optimizer = optax.multi_transform(
      {'train': optax.adam(0.1), 'frozen': optax.set_to_zero()},
      {'w': 'train', 'b': 'frozen'})
  state = jaxpar.TrainState.create(params, optimizer)
  base = {'w': P(None, 'tensor'), 'b': P('tensor')}
  split = {'w': P('data', 'tensor'), 'b': P(('tensor', 'data'))}
  for zero_stage, want in ((0, base), (1, split)):
    specs = dp.state_specs(state, zero_stage=zero_stage, param_specs=base,
                           zero_specs=split)
    adam = specs.opt_state.inner_states['train'].inner_state[0]
    assert adam.mu == adam.nu == {'w': want['w'], 'b': optax.MaskedNode()}
    assert adam.count == P()


# -- ZeRO-3 gathers one layer at a time ---------------------------------------


def layer_params(layers=3, width=6, dtype=np.float64):
  """``memory_bench.stacked_params``: ``[L, ...]`` leaves; on data=8 the
  ``[L, 6]`` bias is stored padded to ``[L, 8]``, split on its second dim."""
  return jax.tree.map(lambda a: a.astype(dtype),
                      memory_bench.stacked_params(layers, width))


def layer_batches(num, size, width=6, dtype=np.float64):
  rng = np.random.default_rng(2)
  return [tuple(rng.standard_normal((size, width)).astype(dtype)
                for _ in range(2)) for _ in range(num)]


@pytest.mark.parametrize('written,remat', [('scanned', 'dots'),
                                           ('unrolled', 'everything')])
def test_zero3_per_layer_matches_single_device_float64(x64, written, remat):
  """The layers in one ``lax.scan`` over stacked leaves (gathered per
  iteration, a padded leaf too; the remat policy per layer) or a Python
  loop over ``w[j]`` of the same stacked leaves: the one-device numbers,
  with clipping."""
  loss = {'scanned': memory_bench.scanned_loss,
          'unrolled': lambda p, b: memory_bench.unrolled_loss(
              [jax.tree.map(lambda a: a[j], p) for j in range(3)], b)}[written]
  params, batches = layer_params(), layer_batches(2, 16)
  optimizer = optax.sgd(0.1, momentum=0.9)
  trainer = dp.trainer(loss, optimizer, mesh=jaxpar.make_mesh(data=8),
                       zero_stage=3, num_microbatches=2, max_grad_norm=0.5,
                       remat_policy=remat)
  state = trainer.init(params)
  assert spec_of(state.params['w1']) == P(None, None, 'data')
  assert isinstance(state.params['b2'], dp.Padded)
  _, got = zero_run(trainer, state, batches)
  want = reference_run(params, batches, optimizer, 0.5, loss_of=loss)
  tree_allclose(got, want, rtol=1e-10)
  assert min(float(norm) for _, norm, _ in got) > 0.5   # clipped


def gathers(text, kind='all-gather'):
  """Output bytes of each ``kind`` collective in compiled HLO text (of a
  loop body's once)."""
  sizes = {'f32': 4, 'bf16': 2, 'f64': 8}
  return [sizes[dtype] * math.prod(int(d) for d in dims.split(',') if d)
          for dtype, dims in re.findall(
              r'= (\w+)\[([\d,]*)\]\S* ' + kind + r'\(', text)]


@pytest.mark.xla_defaults   # reads memory_analysis()
def test_zero3_scanned_memory_at_most_fsdp_and_zero1():
  """Compiled, per device: ZeRO-3 on a scanned stack takes no more memory
  (arguments + temp) than GSPMD's FSDP or ZeRO-1, gathers one layer at a
  time and reduce-scatters each layer's gradient in the loop; with
  ``compute_dtype=bfloat16`` it gathers bfloat16 and reduce-scatters the
  float32 gradients (the lowered program: XLA:CPU runs bfloat16
  collectives in float32)."""
  layers, width = 8, 32
  params, batch = layer_params(layers, width, np.float32), layer_batches(
      1, 16, width, np.float32)[0]
  fsdp = memory_bench.gspmd_fsdp(memory_bench.scanned_loss, params, batch,
                                 stacked=True)
  zero1, zero3 = (memory_bench.jaxpar_step(
      memory_bench.scanned_loss, params, batch, zero_stage=stage)
                  for stage in (1, 3))
  total = lambda c: (c.memory_analysis().argument_size_in_bytes
                     + c.memory_analysis().temp_size_in_bytes)
  assert total(zero3) <= total(fsdp)
  assert total(zero3) <= total(zero1)
  assert (zero3.memory_analysis().temp_size_in_bytes
          <= fsdp.memory_analysis().temp_size_in_bytes)
  layer = 4 * width * 4 * width      # one layer's w1, the largest leaf
  text = zero3.as_text()
  assert max(gathers(text)) == layer
  assert max(gathers(text, 'reduce-scatter')) == layer // 8   # its slice
  trainer = dp.trainer(memory_bench.scanned_loss, optax.adam(0.1),
                       mesh=jaxpar.make_mesh(data=8), zero_stage=3,
                       compute_dtype=jnp.bfloat16)
  lowered = trainer.step.lower(trainer.init(params), batch).as_text()
  types = lambda op: set(re.findall(
      r'stablehlo\.' + op + r'.*?-> tensor<[\dx]*(\w+)>', lowered, re.S))
  assert types('all_gather') == {'bf16'}
  assert types('reduce_scatter') == {'f32'}


@pytest.mark.xla_defaults   # reads memory_analysis()
def test_remat_policies_order_the_memory_of_a_scanned_stack():
  """Compiled temp of a scanned pre-norm stack, the policy applied per
  layer: ``'nothing'`` < ``'dots'`` < ``'everything'`` (checkpointed whole,
  ``'dots'`` took more than ``'everything'``: 2.00 against 1.70 MiB)."""
  params, batch = layer_params(8, 32, np.float32), layer_batches(
      1, 512, 32, np.float32)[0]
  temp = {policy: memory_bench.jaxpar_step(
      memory_bench.normed_scanned_loss, params, batch, zero_stage=1,
      remat_policy=policy).memory_analysis().temp_size_in_bytes
          for policy in ('everything', 'dots', 'nothing')}
  assert temp['nothing'] < temp['dots'] < temp['everything'], temp


class TestErrors:

  def test_shard_state_arguments(self):
    mesh = jaxpar.make_mesh(data=8)
    state = jaxpar.TrainState.create(wide_params(), optax.adam(0.1))
    with pytest.raises(ValueError, match=r'zero_stage=2; choose 0 .*, 1 .* '
                       r'or 3'):
      dp.shard_state(state, mesh=mesh, zero_stage=2)
    with pytest.raises(TypeError, match=r'zero_stage=True must be an int '
                       r'>= 0, got a bool'):
      dp.shard_state(state, mesh=mesh, zero_stage=True)
    with pytest.raises(ValueError, match="no axis 'batch'"):
      dp.shard_state(state, mesh=mesh, data_axis='batch')
    with pytest.raises(TypeError, match='needs a jaxpar.TrainState'):
      dp.shard_state(wide_params(), mesh=mesh)
    assert dp_internal.check_zero_stage(np.int64(3)) == 3

  def test_state_of_another_optimizer(self):
    step = dp.trainer(wide_loss, optax.adam(0.1),
                      mesh=jaxpar.make_mesh(data=8),
                      zero_stage=1).step
    sgd = jaxpar.TrainState.create(wide_params(), optax.sgd(0.1, 0.9))
    with pytest.raises(ValueError, match=r'structure and shapes of '
                       r'optimizer.init\(state.params\).*create the state '
                       'with this optimizer'):
      step(sgd, make_batches(1, 16)[0])

  def test_pmap_backend(self):
    with pytest.raises(ValueError, match="zero_stage=3 needs backend='shard_map'"):
      dp.trainer(mlp_loss, optax.sgd(0.1), zero_stage=3,
                 mesh=jaxpar.make_mesh(data=8), backend='pmap').step


def test_padded_gradient_of_a_leaf_xla_also_splits():
  """ZeRO padding inside a ``shard_map`` manual over ``data`` only, of a leaf
  that an axis XLA partitions also splits (an NNX model's ``'tensor'``
  annotations): the logical shape is the global one (was ``NameError:
  unbound axis name: tensor`` while lowering the planner's 3x1x2 layout)."""
  mesh = jaxpar.make_mesh(data=3, tensor=2, devices=jax.devices()[:6])
  spec, shapes = P('data', 'tensor'), []

  def local(g):
    out = dp.reduce_gradients({'w': g}, {'w': spec}, data_axis='data')['w']
    shapes.append(out.shape)
    return out.value

  g = jnp.arange(40.0).reshape(5, 8)
  out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P('data'),
                              out_specs=P('data'),
                              axis_names=frozenset({'data'})))(
      jnp.tile(g, (3, 1)))
  assert shapes == [(5, 8)]
  np.testing.assert_allclose(np.asarray(out)[:5], g)   # mean of 3 equal ones
