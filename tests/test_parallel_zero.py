"""ZeRO-1 in the 3D train step: exact, ~1/N optimizer state, checkpointable."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_parallel import batches, dense_params, reference

import jaxpar
from jaxpar.models import gpt


def make_trainer(mesh_sizes, schedule, optimizer, *, zero_stage,
                 max_grad_norm=None):
  n = int(np.prod(list(mesh_sizes.values())))
  mesh = jaxpar.make_mesh(**mesh_sizes, devices=jax.devices()[:n])
  _, layout = gpt.split_for_pipeline(dense_params(jnp.float32),
                                     num_stages=schedule.num_stages)
  return jaxpar.parallel.train_step(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optimizer,
      schedule=schedule, mesh=mesh, stage_mask=layout.mask,
      max_grad_norm=max_grad_norm, zero_stage=zero_stage), layout


def opt_state_bytes(state):
  """Bytes of the optimizer state on one device."""
  return sum(x.addressable_shards[0].data.nbytes
             for x in jax.tree.leaves(state.opt_state))


@functools.cache
def reference_run():
  """3 steps of one-device sgd+momentum, clipped at 0.5 (inside x64 tests)."""
  optimizer = optax.sgd(0.3, momentum=0.9)
  return optimizer, reference(dense_params(jnp.float64), batches(3),
                              optimizer, 0.5)


CASES = {
    '2x2x2-1f1b': (dict(data=2, stage=2, tensor=2),
                   lambda: jaxpar.pipeline.one_f_one_b(2, 2)),
    '4x2x1-interleaved': (dict(data=4, stage=2, tensor=1),
                          lambda: jaxpar.pipeline.interleaved_1f1b(2, 2, 2)),
}


@pytest.mark.parametrize('case', list(CASES))
def test_matches_single_device_float64(x64, case, tmp_path):
  """Same losses, norms, params as one-device optax; checkpoint round trip."""
  mesh_sizes, make_schedule = CASES[case]
  schedule = make_schedule()
  params, data = dense_params(jnp.float64), batches(3)
  # sgd + momentum: linear in the gradient (see test_parallel.py on adam).
  optimizer, want = reference_run()
  trainer, layout = make_trainer(mesh_sizes, schedule, optimizer, zero_stage=1,
                                 max_grad_norm=0.5)
  assert float(want[0][1]) > 0.5   # clipping is exercised
  pp, _ = gpt.split_for_pipeline(params, num_stages=schedule.num_stages)
  state = trainer.init(pp)
  for batch, (ref_loss, ref_norm, ref_p) in zip(data[:2], want):
    state, stats = trainer.step(state, batch)
    assert not bool(stats.skipped)
    np.testing.assert_allclose(stats.loss, ref_loss, rtol=1e-10)
    np.testing.assert_allclose(stats.grad_norm, ref_norm, rtol=1e-10)
    chex.assert_trees_all_close(
        gpt.merge_from_pipeline(trainer.params(state), layout), ref_p,
        rtol=1e-9, atol=1e-11)
  # Momentum traces are non-zero now; a restored state is bit-identical and
  # its next step equals the reference's third step.
  jaxpar.checkpoint.save(tmp_path, state)
  restored = jaxpar.checkpoint.restore(tmp_path, trainer.init(pp))
  chex.assert_trees_all_equal(restored, state)
  assert all(jax.tree.leaves(jax.tree.map(
      lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim), restored,
      state)))
  _, stats = trainer.step(restored, data[2])
  np.testing.assert_allclose(stats.loss, want[2][0], rtol=1e-10)


def test_checkpoint_with_schedule_moves_the_moments_too(tmp_path):
  """schedule= saves the ZeRO moments' stage rows in model order as well."""
  optimizer = optax.sgd(0.1, momentum=0.9)
  sizes = dict(data=2, stage=2, tensor=1)
  inter_schedule = jaxpar.pipeline.interleaved_1f1b(2, 2, 2)  # [[0, 2], [1, 3]]
  v_schedule = jaxpar.pipeline.zbv(2, 2)                      # [[0, 3], [1, 2]]
  inter, _ = make_trainer(sizes, inter_schedule, optimizer, zero_stage=1)
  v_shape, _ = make_trainer(sizes, v_schedule, optimizer, zero_stage=1)
  pp, _ = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=4)
  state = inter.init(pp)
  # Distinct values in every row, so a wrong permutation shows.
  state = state._replace(opt_state=jax.tree.map(
      lambda x: jax.device_put(
          x + jnp.arange(x.size, dtype=x.dtype).reshape(x.shape), x.sharding),
      state.opt_state))
  jaxpar.checkpoint.save(tmp_path, state, schedule=inter_schedule)
  got = jaxpar.checkpoint.restore(tmp_path, v_shape.init(pp),
                                  schedule=v_schedule)
  trace = lambda s: np.asarray(s.opt_state[0].trace.stages['ln1']['scale'])
  assert np.unique(trace(state)).size == trace(state).size
  for stage, (rank, j), (v_rank, v_j) in [(1, (1, 0), (1, 0)),
                                          (2, (0, 1), (1, 1)),
                                          (3, (1, 1), (0, 1))]:
    np.testing.assert_array_equal(trace(got)[v_rank, v_j],
                                  trace(state)[rank, j],
                                  err_msg=f'stage {stage}')
  chex.assert_trees_all_equal(v_shape.params(got), inter.params(state))


@pytest.mark.parametrize('sizes', [dict(data=4, stage=2, tensor=1),
                                   dict(data=2, stage=2, tensor=2)])
def test_optimizer_state_is_split_over_data(sizes):
  """Per-device adam state is ~1/N of zero_stage=0's; same values gathered."""
  schedule = jaxpar.pipeline.one_f_one_b(2, 2)
  pp, _ = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=2)
  n = sizes['data']
  plain, _ = make_trainer(sizes, schedule, optax.adam(0.1), zero_stage=0)
  zero1, _ = make_trainer(sizes, schedule, optax.adam(0.1), zero_stage=1)
  dense, sharded = plain.init(pp), zero1.init(pp)
  ratio = opt_state_bytes(sharded) / opt_state_bytes(dense)
  # Padding (< N elements per leaf) and adam's replicated count aside.
  assert 1 / n <= ratio < 1.1 / n, ratio
  chex.assert_trees_all_equal(zero1.params(sharded), plain.params(dense))
  mu = sharded.opt_state[0].mu.stages['mlp']['fc_in']['kernel']
  assert mu.sharding.spec[-1] == 'data'
  assert mu.sharding.shard_shape(mu.shape)[-1] * n == mu.shape[-1]


class TestErrors:

  @pytest.mark.parametrize('stage', [2, -1, True, '1', None])
  def test_bad_zero_stage(self, stage):
    with pytest.raises(ValueError, match=r'zero_stage=.*choose 0 \(no ZeRO\) '
                       r'or 1'):
      make_trainer(dict(data=2, stage=2, tensor=2),
                   jaxpar.pipeline.one_f_one_b(2, 2), optax.sgd(0.1),
                   zero_stage=stage)

  def test_zero_stage_3_not_implemented(self):
    with pytest.raises(NotImplementedError, match='zero_stage=3 .* use '
                       'zero_stage=1'):
      make_trainer(dict(data=2, stage=2, tensor=2),
                   jaxpar.pipeline.one_f_one_b(2, 2), optax.sgd(0.1),
                   zero_stage=3)

  @pytest.mark.parametrize('made, used', [(0, 1), (1, 0)])
  def test_state_of_other_zero_stage(self, made, used):
    sizes, schedule = dict(data=2, stage=2, tensor=1), \
        jaxpar.pipeline.one_f_one_b(2, 2)
    pp, _ = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=2)
    maker, _ = make_trainer(sizes, schedule, optax.adam(0.1), zero_stage=made)
    user, _ = make_trainer(sizes, schedule, optax.adam(0.1), zero_stage=used)
    with pytest.raises(ValueError, match=f'this Trainer \\(zero_stage={used}\\)'
                       '.*create the state with this trainer'):
      user.step(maker.init(pp), batches(1)[0])
