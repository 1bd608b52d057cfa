"""ZeRO-1/3 equal single-device optax training, with 1/N state per device."""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import PartitionSpec as P

import jaxpar
import jaxpar.hlo
from jaxpar import zero
from test_data_parallel import (assert_same_history, init_params, loss_fn,
                                loss_with_aux, make_batches, reference_run)

MESHES = {'data8': dict(data=8), 'data4': dict(data=4),
          'data2_stage2_tensor2': dict(data=2, stage=2, tensor=2)}


def mesh_of(name):
  sizes = MESHES[name]
  return jaxpar.make_mesh(**sizes, devices=jax.devices()[:math.prod(
      sizes.values())])


def start(params, optimizer, *, mesh, stage):
  state = jaxpar.TrainState.create(params, optimizer)
  return zero.shard_state(state, mesh=mesh, stage=stage) if stage else state


def zero_run(step, state, batches):
  history = []
  for batch in batches:
    state, stats = step(state, batch)
    assert not bool(stats.skipped)
    history.append((stats.loss, stats.grad_norm, zero.gather_params(state)))
  return state, history


def flat_leaves(tree):
  return [x for x in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, zero.FlatLeaf))
          if isinstance(x, zero.FlatLeaf)]


def wide_params(hidden=400):
  """Leaves big enough that padding is small next to 1/N of them."""
  k1, k2 = jax.random.split(jax.random.key(3))
  return {'hidden': {'w': jax.random.normal(k1, (5, hidden)) / 3,
                     'b': jnp.zeros(hidden)},
          'out': {'w': jax.random.normal(k2, (hidden, 3)) / hidden**0.5,
                  'b': jnp.full(3, 0.1)}}


@pytest.mark.parametrize('stage,mesh_name', [
    (0, 'data8'), (1, 'data8'), (3, 'data8'), (1, 'data4'), (3, 'data4'),
    (1, 'data2_stage2_tensor2'), (3, 'data2_stage2_tensor2')])
def test_matches_single_device_float64(x64, stage, mesh_name):
  mesh = mesh_of(mesh_name)
  params = init_params(dtype=jnp.float64)
  batches = make_batches(3, 16, dtype=np.float64)
  optimizer = optax.adamw(0.05, weight_decay=0.1)
  step = jaxpar.data_parallel_step(loss_fn, optimizer, mesh=mesh,
                                   zero_stage=stage, num_microbatches=2,
                                   max_grad_norm=0.5)
  state, got = zero_run(step, start(params, optimizer, mesh=mesh, stage=stage),
                        batches)
  assert_same_history(got, reference_run(params, batches, optimizer, 0.5),
                      rtol=1e-10)
  assert max(float(norm) for _, norm, _ in got) > 0.5  # clipping was active
  assert int(state.step) == len(batches)
  # Leaf sizes 35, 7, 21, 3 do not divide N: the padding exists and stays 0
  # under weight decay, in the params (stage 3) and Adam's moments.
  padded = flat_leaves(state)
  assert len(padded) == (12 if stage == 3 else 8 if stage == 1 else 0)
  for leaf in padded:
    tail = np.asarray(leaf.flat)[leaf.size:]
    assert tail.size and not tail.any()


def test_matches_single_device_float32_with_aux_compiles_once():
  traces = []

  def counted_loss(params, batch):
    traces.append(1)
    return loss_with_aux(params, batch)

  mesh = jaxpar.make_mesh(data=8)
  params, batches = init_params(), make_batches(3, 64)
  optimizer = optax.sgd(0.1, momentum=0.9)
  step = jaxpar.data_parallel_step(counted_loss, optimizer, mesh=mesh,
                                   zero_stage=3, num_microbatches=4,
                                   max_grad_norm=1.0, has_aux=True)
  want = reference_run(params, batches, optimizer, 1.0)
  state = start(params, optimizer, mesh=mesh, stage=3)
  got = []
  for batch, (want_loss, _, _) in zip(batches, want):
    state, stats = step(state, batch)
    np.testing.assert_allclose(stats.aux['loss_x2'], 2 * want_loss, rtol=1e-5)
    got.append((stats.loss, stats.grad_norm, zero.gather_params(state)))
    if len(got) == 1:
      after_first = len(traces)
  assert_same_history(got, want, rtol=1e-5)
  assert len(traces) == after_first   # no retrace on later steps


@pytest.mark.parametrize('stage', [1, 3])
def test_gradient_is_the_mean_not_n_times_it(x64, stage):
  """Reduce-scatter sums over devices: the step must divide by N once."""
  mesh = jaxpar.make_mesh(data=8)
  params = init_params(dtype=jnp.float64)
  batch = make_batches(1, 16, dtype=np.float64)[0]
  step = jaxpar.data_parallel_step(loss_fn, optax.sgd(1.0), mesh=mesh,
                                   zero_stage=stage)
  state, _ = step(start(params, optax.sgd(1.0), mesh=mesh, stage=stage), batch)
  applied = jax.tree.map(jnp.subtract, params, zero.gather_params(state))
  chex.assert_trees_all_close(applied, jax.grad(loss_fn)(params, batch),
                              rtol=1e-12)


@pytest.fixture(scope='module')
def adam_steps():
  """One float32 Adam step per stage on data=8: (step, state before, after)."""
  mesh = jaxpar.make_mesh(data=8)
  optimizer = optax.adam(0.01)
  batch = make_batches(1, 16)[0]
  out = {}
  for stage in (0, 1, 3):
    step = jaxpar.data_parallel_step(loss_fn, optimizer, mesh=mesh,
                                     zero_stage=stage)
    state = start(wide_params(), optimizer, mesh=mesh, stage=stage)
    out[stage] = (step, state, step(state, batch)[0])
  return out


def device_bytes(arrays):
  """(bytes on device 0, bytes of the global arrays)."""
  return (sum(x.addressable_shards[0].data.nbytes for x in arrays),
          sum(x.nbytes for x in arrays))


@pytest.mark.parametrize('stage', [1, 3])
def test_each_device_holds_one_nth(adam_steps, stage):
  n = 8
  _, _, state = adam_steps[stage]
  sizes = [x.size for x in jax.tree.leaves(wide_params())]   # 2000, 400, ...
  total = 4 * sum(sizes)                                      # float32 bytes
  slices = 4 * sum(-(-s // n) for s in sizes)                # ceil(size/N)
  for leaf in flat_leaves(state):
    c = -(-leaf.size // n)
    assert leaf.flat.sharding.shard_shape(leaf.flat.shape) == (c,)
    assert leaf.flat.sharding.spec == P('data')
  mu_nu = [x.flat for x in flat_leaves(state.opt_state)]
  assert device_bytes(mu_nu) == (2 * slices, 2 * n * slices)
  assert 2 * slices <= 2 * total / n * 1.01   # padding aside: 1/N of Adam's
  params = jax.tree.leaves(state.params)
  if stage == 3:
    assert device_bytes(params) == (slices, n * slices)
    assert slices <= total / n * 1.01
  else:
    assert device_bytes(params) == (total, total)    # replicated
  # The stage-0 state holds everything on every device.
  plain = adam_steps[0][2]
  assert device_bytes(jax.tree.leaves(plain.opt_state[0].mu))[0] == total


@pytest.mark.parametrize('stage', [0, 1, 3])
def test_collectives_in_compiled_step(adam_steps, stage):
  """DP all-reduces the gradient; ZeRO reduce-scatters and all-gathers it."""
  step, state, _ = adam_steps[stage]
  compiled = step.lower(state, make_batches(1, 16)[0]).compile()
  moved = jaxpar.hlo.collective_bytes(compiled)
  sizes = [x.size for x in jax.tree.leaves(wide_params())]
  grads = 4 * sum(sizes)
  padded = 4 * sum(zero.padded_size(s, 8) for s in sizes)
  if stage == 0:
    assert moved['all-reduce'] >= grads
    assert moved['reduce-scatter'] == moved['all-gather'] == 0
  else:
    assert moved['all-reduce'] <= 16   # scalars only: loss, squared norm
    assert moved['reduce-scatter'] == padded
    assert moved['all-gather'] >= padded   # stage 3: >1 gather per leaf


def test_stage3_backward_regathers_instead_of_saving_params(capsys):
  mesh = jaxpar.make_mesh(data=8)
  params = init_params()
  flat = zero.shard_state(jaxpar.TrainState.create(params, optax.sgd(0.1)),
                          mesh=mesh, stage=3).params
  specs = zero.state_specs(flat)
  batch = jax.device_put(make_batches(1, 16)[0],
                         jax.sharding.NamedSharding(mesh, P('data')))

  def residual_shapes(fn):
    """Shapes of what ``fn``'s backward pass keeps, on one device."""
    def body(local, batch):
      print_saved_residuals(fn, local, batch)
      return local
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P('data')),
                          out_specs=specs)).trace(flat, batch)
    return {tuple(int(d) for d in dims.split(',') if d) for dims in
            re.findall(r'^f32\[([\d,]*)\]', capsys.readouterr().out, re.M)}

  full = {(5, 7), (7,), (7, 3)}   # gathered shapes (out.b's (3,) is a slice's)
  plain = residual_shapes(
      lambda p, b: loss_fn(zero.all_gather(p, axis='data'), b))
  remat = residual_shapes(zero.gathered_loss(loss_fn, axis='data'))
  assert full & plain           # without remat a gathered param is kept
  assert not full & remat       # with it, only the slices are
  assert {(5,), (1,), (3,)} <= remat    # ceil(35/8), ceil(7/8), ceil(21/8)


def test_global_norm_over_two_axes():
  mesh = jaxpar.make_mesh(data=4, tensor=2)
  rng = np.random.default_rng(0)
  tree = {'a': rng.normal(size=(16, 3)), 'b': rng.normal(size=(8,))}
  spec = P(('data', 'tensor'))
  norm = jax.jit(jax.shard_map(
      lambda t: zero.global_norm(t, axis=('data', 'tensor')), mesh=mesh,
      in_specs=(spec,), out_specs=P()))(
          jax.device_put(tree, jax.sharding.NamedSharding(mesh, spec)))
  np.testing.assert_allclose(norm, optax.tree.norm(tree), rtol=1e-6)


@pytest.mark.parametrize('stage', [1, 3])
def test_non_finite_step_is_skipped(adam_steps, stage):
  step, state, _ = adam_steps[stage]
  bad = make_batches(1, 16)[0]
  bad['x'][3, 1] = np.nan
  new, stats = step(state, bad)
  assert bool(stats.skipped) and not np.isfinite(stats.loss)
  chex.assert_trees_all_equal(new, state)


def test_round_trip_and_reshard(x64):
  params = init_params(dtype=jnp.float64)
  plain = jaxpar.TrainState.create(params, optax.adam(0.1))
  for stage in (1, 3):
    for name in ('data8', 'data4'):
      state = zero.shard_state(plain, mesh=mesh_of(name), stage=stage)
      chex.assert_trees_all_equal(zero.gather_params(state), params)
      back = zero.unshard_state(state)
      assert jax.tree.structure(back) == jax.tree.structure(plain)
      chex.assert_trees_all_equal(back, plain)
  specs = zero.state_specs(state)   # stage 3, data=4
  assert specs.params['hidden']['w'].flat == P('data') and specs.step == P()
  assert zero.logical_shapes(state.params)['hidden']['w'].shape == (5, 7)
  assert state.params['hidden']['w'].flat.shape == (zero.padded_size(35, 4),)


def test_checkpoint_restore_then_continue_on_another_mesh(tmp_path, x64):
  """A ZeRO-3 state saved with orbax restores sharded and trains on."""
  params = init_params(dtype=jnp.float64)
  batches = make_batches(2, 16, dtype=np.float64)
  optimizer = optax.adam(0.05)
  mesh8 = mesh_of('data8')
  step8 = jaxpar.data_parallel_step(loss_fn, optimizer, mesh=mesh8,
                                    zero_stage=3)
  state, _ = step8(start(params, optimizer, mesh=mesh8, stage=3), batches[0])
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / 'ckpt', state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / 'ckpt', jax.tree.map(
        ocp.utils.to_shape_dtype_struct, state))
  chex.assert_trees_all_equal(restored, state)
  assert all(x.flat.sharding.spec == P('data') for x in flat_leaves(restored))
  mesh4 = mesh_of('data4')
  step4 = jaxpar.data_parallel_step(loss_fn, optimizer, mesh=mesh4,
                                    zero_stage=1)
  state, stats = step4(zero.shard_state(zero.unshard_state(restored),
                                        mesh=mesh4, stage=1), batches[1])
  want = reference_run(params, batches, optimizer)
  np.testing.assert_allclose(stats.loss, want[1][0], rtol=1e-10)
  chex.assert_trees_all_close(zero.gather_params(state), want[1][2],
                              rtol=1e-10, atol=1e-10)


class TestErrors:

  def state(self, optimizer=optax.adam(0.1), **shard):
    state = jaxpar.TrainState.create(init_params(), optimizer)
    return zero.shard_state(state, **shard) if shard else state

  def step(self, zero_stage, optimizer=optax.adam(0.1), **kw):
    kw.setdefault('mesh', jaxpar.make_mesh(data=8))
    return jaxpar.data_parallel_step(loss_fn, optimizer, zero_stage=zero_stage,
                                     **kw)

  def test_shard_state_arguments(self):
    mesh = jaxpar.make_mesh(data=8)
    with pytest.raises(ValueError, match=r'stage=2; ZeRO stages are \(1, 3\)'):
      zero.shard_state(self.state(), mesh=mesh, stage=2)
    with pytest.raises(ValueError, match="no axis 'batch'"):
      zero.shard_state(self.state(), mesh=mesh, axis='batch')
    with pytest.raises(TypeError, match='needs a jaxpar.TrainState'):
      zero.shard_state(init_params(), mesh=mesh)
    with pytest.raises(ValueError, match='already ZeRO-sharded.*unshard_state'):
      zero.shard_state(self.state(mesh=mesh), mesh=mesh, stage=3)
    ints = jaxpar.TrainState.create({'w': jnp.ones(3), 'n': jnp.arange(3)},
                                    optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"params leaf \['n'\] has dtype int"):
      zero.shard_state(ints, mesh=mesh)

  def test_step_needs_the_matching_layout(self):
    batch = make_batches(1, 16)[0]
    mesh = jaxpar.make_mesh(data=8)
    with pytest.raises(ValueError, match=r'zero_stage=3 needs params sharded.*'
                       r'4 of 4 .*zero.shard_state\(state, mesh=mesh, stage=3'):
      self.step(3)(self.state(), batch)
    with pytest.raises(ValueError, match=r'optimizer state sharded.*'
                       r'shard_state\(state, mesh=mesh, stage=1\)'):
      self.step(1)(self.state(), batch)
    with pytest.raises(ValueError, match='zero_stage=1 needs replicated params'):
      self.step(1)(self.state(mesh=mesh, stage=3), batch)
    with pytest.raises(ValueError, match='ZeRO-sharded .* but zero_stage=0'):
      self.step(0)(self.state(mesh=mesh, stage=1), batch)

  def test_state_sharded_for_another_mesh(self):
    four = self.state(mesh=mesh_of('data4'), stage=3)
    with pytest.raises(ValueError, match=r'shape \(5, 7\) with flat shape '
                       r'\(36,\), but data size 8 needs \(40,\).*Re-shard'):
      self.step(3)(four, make_batches(1, 16)[0])

  def test_non_elementwise_optimizer(self):
    mesh = jaxpar.make_mesh(data=8)
    adafactor = optax.adafactor(0.1, min_dim_size_to_factor=2)
    with pytest.raises(ValueError, match='elementwise optimizers only'):
      self.step(1, adafactor)(self.state(adafactor, mesh=mesh, stage=1),
                              make_batches(1, 16)[0])

  def test_pmap_backend(self):
    with pytest.raises(ValueError, match="zero_stage=3 needs backend='shard_map'"):
      self.step(3, backend='pmap')
