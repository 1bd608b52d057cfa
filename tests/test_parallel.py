"""3D parallelism (DP x PP x TP) on a GPT equals single-device optax training."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.models import gpt

CONFIG = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16, num_heads=4,
                       num_layers=4)


def dense_params(dtype, config=CONFIG):
  return jax.tree.map(lambda x: x.astype(dtype),
                      gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0))))


def batches(num, size=8, seed=0):
  rng = np.random.default_rng(seed)
  return [(rng.integers(0, CONFIG.vocab_size, (size, CONFIG.seq_len)),
           rng.integers(0, CONFIG.vocab_size, (size, CONFIG.seq_len)))
          for _ in range(num)]


def reference(params, data, optimizer, max_grad_norm):
  optimizer = optax.chain(optax.clip_by_global_norm(max_grad_norm), optimizer)
  opt_state = optimizer.init(params)
  loss_fn = jax.jit(jax.value_and_grad(functools.partial(gpt.gpt_loss,
                                                         config=CONFIG)))
  out = []
  for batch in data:
    loss, grads = loss_fn(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    out.append((loss, optax.tree.norm(grads), params))
  return out


def run(mesh_sizes, schedule, params, data, optimizer, max_grad_norm):
  n = int(np.prod(list(mesh_sizes.values())))
  mesh = jaxpar.make_mesh(**mesh_sizes, devices=jax.devices()[:n])
  pp, layout = gpt.split_for_pipeline(params, num_stages=schedule.num_stages)
  trainer = jaxpar.parallel.train_step(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optimizer,
      schedule=schedule, mesh=mesh, stage_mask=layout.mask,
      max_grad_norm=max_grad_norm)
  state = trainer.init(pp)
  out = []
  for batch in data:
    state, stats = trainer.step(state, batch)
    assert not bool(stats.skipped)
    out.append((stats.loss, stats.grad_norm,
                gpt.merge_from_pipeline(trainer.params(state), layout)))
  return out


CASES = {
    '2x2x2-1f1b': (dict(data=2, stage=2, tensor=2),
                   lambda: jaxpar.pipeline.one_f_one_b(2, 2)),
    '1x2x4-zb_h1': (dict(data=1, stage=2, tensor=4),
                    lambda: jaxpar.pipeline.zero_bubble_h1(2, 4)),
    '2x2x1-interleaved': (dict(data=2, stage=2, tensor=1),
                          lambda: jaxpar.pipeline.interleaved_1f1b(2, 2, 2)),
    '1x2x2-zbv': (dict(data=1, stage=2, tensor=2),
                  lambda: jaxpar.pipeline.zbv(2, 4)),
    '4x2x1-gpipe': (dict(data=4, stage=2, tensor=1),
                    lambda: jaxpar.pipeline.gpipe(2, 1)),
}


# Linear in the gradient: adam would blow the rounding noise of the
# key-bias gradient (exactly zero in exact arithmetic) up to full steps.
FLOAT64_OPTIMIZER = optax.sgd(0.3, momentum=0.9)


@functools.cache
def float64_reference():
  """One device, float64 (call under the x64 fixture): computed once for
  every case below."""
  return reference(dense_params(jnp.float64), batches(2), FLOAT64_OPTIMIZER,
                   0.5)


@pytest.mark.parametrize('case', list(CASES))
def test_matches_single_device_float64(x64, case):
  """Every mesh shape and schedule: same losses, norms and params."""
  mesh_sizes, make_schedule = CASES[case]
  got = run(mesh_sizes, make_schedule(), dense_params(jnp.float64),
            batches(2), FLOAT64_OPTIMIZER, 0.5)
  want = float64_reference()
  assert float(want[0][1]) > 0.5   # clipping is exercised
  for (loss, norm, p), (ref_loss, ref_norm, ref_p) in zip(got, want):
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-10)
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-10)
    chex.assert_trees_all_close(p, ref_p, rtol=1e-9, atol=1e-11)


def test_float32_2x2x2_interleaved():
  """v = 2 stages per rank (4 stages of one layer) on a 2x2x2 mesh, float32."""
  config_params = dense_params(jnp.float32)
  data = batches(2)
  optimizer = optax.sgd(0.1, momentum=0.9)  # adam would amplify rounding
  schedule = jaxpar.pipeline.interleaved_1f1b(2, 2, 2)
  assert schedule.num_stages == 4
  got = run(dict(data=2, stage=2, tensor=2), schedule, config_params, data,
            optimizer, 1.0)
  want = reference(config_params, data, optimizer, 1.0)
  for (loss, norm, p), (ref_loss, ref_norm, ref_p) in zip(got, want):
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-5)
    chex.assert_trees_all_close(p, ref_p, rtol=1e-4, atol=1e-5)


def test_uneven_layers_keep_identity_slots():
  """6 layers on 4 stages: slots (2, 2, 1, 1); padding stays exactly zero and
  every real layer gets the gradient of the 6-layer model (SGD, lr 1: the
  update is minus the gradient)."""
  config = CONFIG._replace(num_layers=6)
  params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(1)))
  pp, layout = gpt.split_for_pipeline(params, num_stages=4)
  assert layout.counts == (2, 2, 1, 1)
  chex.assert_trees_all_equal(gpt.merge_from_pipeline(pp, layout), params)
  mesh = jaxpar.make_mesh(stage=4, tensor=2)
  trainer = jaxpar.parallel.train_step(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.sgd(1.0),
      schedule=jaxpar.pipeline.one_f_one_b(4, 2), mesh=mesh,
      stage_mask=layout.mask)
  batch = batches(1, size=4)[0]
  state, stats = trainer.step(trainer.init(pp), batch)
  stages = trainer.params(state).stages
  for leaf in jax.tree.leaves(stages):
    assert not np.any(np.asarray(leaf)[~layout.mask])
  ref, grads = jax.value_and_grad(functools.partial(gpt.gpt_loss,
                                                    config=config))(params, batch)
  np.testing.assert_allclose(stats.loss, ref, rtol=1e-5)
  np.testing.assert_allclose(stats.grad_norm, optax.tree.norm(grads),
                             rtol=1e-5)
  chex.assert_trees_all_close(
      gpt.merge_from_pipeline(trainer.params(state), layout),
      jax.tree.map(lambda p, g: p - g, params, grads), rtol=1e-5, atol=1e-6)


def test_non_finite_step_is_skipped():
  params = dense_params(jnp.float32)
  params['ln_f']['scale'] = params['ln_f']['scale'].at[0].set(jnp.nan)
  pp, layout = gpt.split_for_pipeline(params, num_stages=2)
  trainer = jaxpar.parallel.train_step(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.adam(0.1),
      schedule=jaxpar.pipeline.one_f_one_b(2, 2),
      mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2), stage_mask=layout.mask)
  state = trainer.init(pp)
  new, stats = trainer.step(state, batches(1)[0])
  assert bool(stats.skipped) and int(new.step) == 0
  chex.assert_trees_all_equal(new.params, state.params)


class TestErrors:

  def test_schedule_ranks_must_match_mesh(self):
    with pytest.raises(ValueError, match="num_ranks=4 but the mesh axis "
                       "'stage' has size 2"):
      jaxpar.parallel.train_step(
          gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.sgd(0.1),
          schedule=jaxpar.pipeline.one_f_one_b(4, 4),
          mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2))

  def test_more_stages_than_layers(self):
    with pytest.raises(ValueError, match='num_stages=5: the GPT has 4 layers'):
      gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=5)

  def test_batch_not_divisible(self):
    pp, layout = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=2)
    trainer = jaxpar.parallel.train_step(
        gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.sgd(0.1),
        schedule=jaxpar.pipeline.one_f_one_b(2, 4),
        mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2), stage_mask=layout.mask)
    with pytest.raises(ValueError, match=r'batch size 12 .* data size 2 x '
                       r'num_microbatches 4 = 8'):
      trainer.step(trainer.init(pp), batches(1, size=12)[0])

  def test_tensor_size_must_divide_heads(self):
    pp, _ = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=1)
    trainer = jaxpar.parallel.train_step(
        gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.sgd(0.1),
        schedule=jaxpar.pipeline.one_f_one_b(1, 1),
        mesh=jaxpar.make_mesh(tensor=8))
    with pytest.raises(ValueError, match='not divisible'):
      trainer.init(pp)


# ------------------------------------------------ dropout, aux, bfloat16

SMALL = CONFIG._replace(num_layers=2)   # one block per stage: fast compiles


def gpipe_one_rank(num_stages, m):
  """GPipe's order with ``num_stages`` stages on one rank."""
  row = ([jaxpar.pipeline.Action(s, 'F', i) for s in range(num_stages)
          for i in range(m)] +
         [jaxpar.pipeline.Action(s, 'B', i)
          for s in reversed(range(num_stages)) for i in range(m)])
  return jaxpar.pipeline.Schedule(1, num_stages, m, (0,) * num_stages, (row,),
                                  'GPipe').validate()


def trained(mesh_sizes, schedule, params, data, config, **options):
  """(stats, merged params) after each step of ``parallel.train_step``."""
  n = int(np.prod(list(mesh_sizes.values())))
  mesh = jaxpar.make_mesh(**mesh_sizes, devices=jax.devices()[:n])
  pp, layout = gpt.split_for_pipeline(params, num_stages=schedule.num_stages)
  trainer = jaxpar.parallel.train_step(
      *gpt.functions(config), optax.sgd(0.1), schedule=schedule, mesh=mesh,
      stage_mask=layout.mask, **options)
  state = trainer.init(pp)
  out = []
  for batch in data:
    state, stats = trainer.step(state, batch)
    out.append((stats, gpt.merge_from_pipeline(trainer.params(state), layout)))
  return out, trainer, state


def test_dropout_is_the_same_on_every_mesh_and_schedule():
  """Same seed: 1F1B on 2x2x2 (m=4 per data shard) == GPipe on 1x1x1 (m=8).

  Both have 2 logical stages (the masks are drawn per stage and global
  microbatch); one step, loss, gradient norm and every updated param.
  """
  config = SMALL._replace(dropout=0.2)
  params = dense_params(jnp.float32, SMALL)
  data = batches(1)
  key = jax.random.key(7)
  got, *_ = trained(dict(data=2, stage=2, tensor=2),
                    jaxpar.pipeline.one_f_one_b(2, 4), params, data, config,
                    key=key)
  want, *_ = trained(dict(data=1, stage=1, tensor=1), gpipe_one_rank(2, 8),
                     params, data, config, key=key)
  for (stats, p), (ref, ref_p) in zip(got, want):
    np.testing.assert_allclose(stats.loss, ref.loss, rtol=1e-5)
    np.testing.assert_allclose(stats.grad_norm, ref.grad_norm, rtol=1e-5)
    chex.assert_trees_all_close(p, ref_p, rtol=1e-5, atol=1e-6)
  # Dropout is on: the loss is not the deterministic model's.
  plain = gpt.gpt_loss(params, data[0], config=SMALL)
  assert abs(float(got[0][0].loss) - float(plain)) > 1e-3


def test_aux_accuracy_is_the_dense_models(x64):
  """has_aux: per-token accuracy averaged over microbatches and data."""
  params = dense_params(jnp.float64, SMALL)
  data = batches(1)
  mesh = jaxpar.make_mesh(data=2, stage=2, tensor=2)
  pp, layout = gpt.split_for_pipeline(params, num_stages=2)
  trainer = jaxpar.parallel.train_step(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_and_accuracy_fn,
      optax.sgd(0.1), schedule=jaxpar.pipeline.zero_bubble_h1(2, 2),
      mesh=mesh, stage_mask=layout.mask, has_aux=True)
  _, stats = trainer.step(trainer.init(pp), data[0])
  ids, targets = data[0]
  logits = gpt.gpt_apply(params, ids, config=SMALL)
  np.testing.assert_allclose(stats.loss, gpt.gpt_loss(params, data[0],
                                                      config=SMALL),
                             rtol=1e-10)
  want = np.mean(np.argmax(logits, -1) == targets)
  assert 0 < want < 1
  np.testing.assert_allclose(stats.aux['accuracy'], want, rtol=1e-6)


def test_bf16_compute_is_close_to_float32():
  """bf16 compute, f32 params/loss/grads: within bf16's error of float32.

  bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 2e-3 per value);
  through 4 blocks the loss moves ~1e-3 relative and the gradient ~1e-2. A
  factor error (a gradient not averaged, a mask or stash mix-up) moves them
  by O(1), far outside these bounds.
  """
  params = dense_params(jnp.float32, SMALL)
  data = batches(1)
  sizes = dict(data=2, stage=2, tensor=2)
  schedule = jaxpar.pipeline.one_f_one_b(2, 2)
  f32, *_ = trained(sizes, schedule, params, data, SMALL)
  bf16, *_ = trained(sizes, schedule, params, data, SMALL,
                               compute_dtype=jnp.bfloat16)
  (s32, p32), (s16, p16) = f32[0], bf16[0]
  assert s16.loss.dtype == jnp.float32
  assert jax.tree.all(jax.tree.map(lambda a: a.dtype == jnp.float32, p16))
  assert float(s16.loss) != float(s32.loss)       # bf16 really computes
  np.testing.assert_allclose(s16.loss, s32.loss, rtol=1e-2)
  np.testing.assert_allclose(s16.grad_norm, s32.grad_norm, rtol=3e-2)
  # The update (sgd: -0.1 * grad) agrees to bf16's error, as a whole (a
  # leaf that is zero in exact arithmetic, the key bias, is noise in both).
  diff, ref = (optax.tree.norm(jax.tree.map(f, p16, p32, params)) for f in (
      lambda a, b, p: a - b, lambda a, b, p: b - p))
  assert float(diff) < 3e-2 * float(ref)
