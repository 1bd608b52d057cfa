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
from helpers import (FLOAT64_OPTIMIZER, GPT_CONFIG, dense_of, dense_params,
                     float64_reference, gpt_batches, tree_allclose)


def run(mesh_sizes, schedule, params, data, optimizer, max_grad_norm):
  n = int(np.prod(list(mesh_sizes.values())))
  mesh = jaxpar.make_mesh(**mesh_sizes, devices=jax.devices()[:n])
  pp, split = gpt.split_for_pipeline(params, num_stages=schedule.num_stages)
  trainer = jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optimizer,
      schedule=schedule, mesh=mesh, stage_mask=split.mask,
      tensor_rules=gpt.TENSOR_RULES, max_grad_norm=max_grad_norm)
  state = trainer.init(pp)
  out = []
  for batch in data:
    state, stats = trainer.step(state, batch)
    assert not bool(stats.skipped)
    out.append((stats.loss, stats.grad_norm,
                dense_of(trainer, state, split)))
  return out


# Each case is its own program (the suite's costliest kind), so each mesh and
# schedule is checked once across the 3D files; the float64 exactness of the
# others (this model, optimizer and reference unless said):
#   2x2x2 1F1B        test_optimizers.py::test_3d_2x2x2[0-None-3] (every
#                     optimizer; clipping in its [3-0.5-5] case)
#   interleaved       test_parallel_zero.py '4x2x1-interleaved-zero3',
#                     test_optimizers.py::test_3d_2x2x2[3-0.5-5] (2x2x2),
#                     test_from_nnx.py '4x2-interleaved-zero3' (the Llama)
#   ZB-V              test_parallel_zero.py '2x2x2-zero_bubble_v-zero3', the restore
#                     onto 1x2x4 ZB-V (zero_stage=0) in its interleaved case,
#                     test_from_nnx.py '2x2-zero_bubble_v-stacked', '1x2x4-zero_bubble_v-annotated'
CASES = {
    '1x2x4-zb_h1': (dict(data=1, stage=2, tensor=4),
                    lambda: jaxpar.pipeline.zero_bubble_h1(2, 4)),
    '4x2x1-gpipe': (dict(data=4, stage=2, tensor=1),
                    lambda: jaxpar.pipeline.gpipe(2, 1)),
}


@pytest.mark.parametrize('case', list(CASES))
def test_matches_single_device_float64(x64, case):
  """Every mesh shape and schedule: same losses, norms and params."""
  mesh_sizes, make_schedule = CASES[case]
  got = run(mesh_sizes, make_schedule(), dense_params(jnp.float64),
            gpt_batches(2), FLOAT64_OPTIMIZER, 0.5)
  want = float64_reference()
  assert float(want[0][1]) > 0.5   # clipping is exercised
  for (loss, norm, p), (ref_loss, ref_norm, ref_p) in zip(got, want):
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-10)
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-10)
    tree_allclose(p, ref_p, rtol=1e-9, atol=1e-11)


def test_uneven_layers_keep_identity_slots():
  """6 layers on 4 stages: slots (2, 2, 1, 1); padding stays exactly zero and
  every real layer gets the gradient of the 6-layer model (SGD, lr 1: the
  update is minus the gradient)."""
  config = GPT_CONFIG._replace(num_layers=6)
  params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(1)))
  pp, split = gpt.split_for_pipeline(params, num_stages=4)
  assert split.counts == (2, 2, 1, 1)
  chex.assert_trees_all_equal(gpt.merge_from_pipeline(pp, split), params)
  mesh = jaxpar.make_mesh(stage=4, tensor=2)
  trainer = jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.sgd(1.0),
      schedule=jaxpar.pipeline.one_f_one_b(4, 2), mesh=mesh,
      stage_mask=split.mask, tensor_rules=gpt.TENSOR_RULES)
  batch = gpt_batches(1, size=4)[0]
  state, stats = trainer.step(trainer.init(pp), batch)
  stages = trainer.params(state).stages
  for leaf in jax.tree.leaves(stages):
    assert not np.any(np.asarray(leaf)[~split.mask])
  ref, grads = jax.jit(jax.value_and_grad(functools.partial(
      gpt.gpt_loss, config=config)))(params, batch)
  np.testing.assert_allclose(stats.loss, ref, rtol=1e-5)
  np.testing.assert_allclose(stats.grad_norm, optax.tree.norm(grads),
                             rtol=1e-5)
  tree_allclose(dense_of(trainer, state, split),
                jax.tree.map(lambda p, g: p - g, params, grads), rtol=1e-5,
                atol=1e-6)


class TestErrors:

  def test_schedule_ranks_must_match_mesh(self):
    with pytest.raises(ValueError, match="num_ranks=4 but the mesh axis "
                       "'stage' has size 2"):
      jaxpar.parallel.trainer(
          gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.sgd(0.1),
          schedule=jaxpar.pipeline.one_f_one_b(4, 4),
          mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2))

  def test_more_stages_than_layers(self):
    with pytest.raises(ValueError, match='num_stages=5: the GPT has 4 layers'):
      gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=5)

  def test_batch_not_divisible(self):
    pp, split = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=2)
    trainer = jaxpar.parallel.trainer(
        gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.sgd(0.1),
        schedule=jaxpar.pipeline.one_f_one_b(2, 4),
        mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2), stage_mask=split.mask,
        tensor_rules=gpt.TENSOR_RULES)
    with pytest.raises(ValueError, match=r'batch size 12 .* data size 2 x '
                       r'num_microbatches 4 = 8'):
      trainer.step(trainer.init(pp), gpt_batches(1, size=12)[0])

  def test_tensor_size_must_divide_heads(self):
    pp, _ = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=1)
    trainer = jaxpar.parallel.trainer(
        gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.sgd(0.1),
        schedule=jaxpar.pipeline.one_f_one_b(1, 1),
        mesh=jaxpar.make_mesh(tensor=8), tensor_rules=gpt.TENSOR_RULES)
    with pytest.raises(ValueError, match=r"param 'attn/query/kernel' "
                       r'\(1, 4, 16, 4, 4\): dim 3 of size 4 is split over '
                       r"'tensor' .* does not divide by its size 8"):
      trainer.init(pp)

  def test_tensor_axis_needs_tensor_rules(self):
    """Plain dict params carry no Flax metadata: without tensor_rules no
    param is split over 'tensor', and init names the GPT's rules."""
    pp, split = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=2)
    trainer = jaxpar.parallel.trainer(
        gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.sgd(0.1),
        schedule=jaxpar.pipeline.one_f_one_b(2, 2),
        mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2), stage_mask=split.mask)
    with pytest.raises(ValueError, match=r"no parameter is split over "
                       r"'tensor'.*jaxpar\.models\.gpt\.TENSOR_RULES"):
      trainer.init(pp)


# ------------------------------------------------ dropout, aux, bfloat16

SMALL = GPT_CONFIG._replace(num_layers=2)   # one block per stage: fast compiles


def gpipe_one_rank(num_stages, m):
  """GPipe's order with ``num_stages`` stages on one rank."""
  row = ([jaxpar.pipeline.Action(s, 'F', i) for s in range(num_stages)
          for i in range(m)] +
         [jaxpar.pipeline.Action(s, 'B', i)
          for s in reversed(range(num_stages)) for i in range(m)])
  return jaxpar.pipeline.Schedule(1, num_stages, m, (0,) * num_stages, (row,),
                                  'GPipe').validate()


def make_trainer(mesh_sizes, schedule, config, **options):
  """``parallel.trainer`` of the GPT ``config`` with sgd(0.1), and its
  ``LayerSplit``."""
  n = int(np.prod(list(mesh_sizes.values())))
  mesh = jaxpar.make_mesh(**mesh_sizes, devices=jax.devices()[:n])
  _, split = gpt.split_for_pipeline(dense_params(jnp.float32, config),
                                     num_stages=schedule.num_stages)
  return jaxpar.parallel.trainer(
      *gpt.functions(config), optax.sgd(0.1), schedule=schedule, mesh=mesh,
      stage_mask=split.mask, tensor_rules=gpt.TENSOR_RULES, **options), split


@functools.cache
def small_trainer(**options):
  """SMALL on 2x2x2 with 1F1B, m=2: one program for the tests that share it."""
  return make_trainer(dict(data=2, stage=2, tensor=2),
                      jaxpar.pipeline.one_f_one_b(2, 2), SMALL, **options)


def trained(trainer, split, params, data):
  """(stats, merged params) after each step of ``trainer``."""
  pp, _ = gpt.split_for_pipeline(params, num_stages=split.num_stages)
  state = trainer.init(pp)
  out = []
  for batch in data:
    state, stats = trainer.step(state, batch)
    out.append((stats, dense_of(trainer, state, split)))
  return out


def test_dropout_is_the_same_on_every_mesh_and_schedule():
  """Same seed: 1F1B on 2x2x2 (m=4 per data shard) == GPipe on 1x1x1 (m=8).

  Both have 2 logical stages (the masks are drawn per stage and global
  microbatch); one step, loss, gradient norm and every updated param.
  """
  config = SMALL._replace(dropout=0.2)
  params = dense_params(jnp.float32, SMALL)
  data = gpt_batches(1)
  key = jax.random.key(7)
  got = trained(*make_trainer(dict(data=2, stage=2, tensor=2),
                               jaxpar.pipeline.one_f_one_b(2, 4), config,
                               key=key), params, data)
  want = trained(*make_trainer(dict(data=1, stage=1, tensor=1),
                               gpipe_one_rank(2, 8), config, key=key),
                 params, data)
  for (stats, p), (ref, ref_p) in zip(got, want):
    np.testing.assert_allclose(stats.loss, ref.loss, rtol=1e-5)
    np.testing.assert_allclose(stats.grad_norm, ref.grad_norm, rtol=1e-5)
    tree_allclose(p, ref_p, rtol=1e-5, atol=1e-6)
  # Dropout is on: the loss is not the deterministic model's.
  plain = jax.jit(functools.partial(gpt.gpt_loss, config=SMALL))(params,
                                                                 data[0])
  assert abs(float(got[0][0].loss) - float(plain)) > 1e-3


def test_aux_accuracy_is_the_dense_models(x64):
  """has_aux: per-token accuracy averaged over microbatches and data."""
  params = dense_params(jnp.float64, SMALL)
  data = gpt_batches(1)
  mesh = jaxpar.make_mesh(data=2, stage=2, tensor=2)
  pp, split = gpt.split_for_pipeline(params, num_stages=2)
  trainer = jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_and_accuracy_fn,
      optax.sgd(0.1), schedule=jaxpar.pipeline.zero_bubble_h1(2, 2),
      mesh=mesh, stage_mask=split.mask, tensor_rules=gpt.TENSOR_RULES,
      has_aux=True)
  _, stats = trainer.step(trainer.init(pp), data[0])
  ids, targets = data[0]
  logits, loss = jax.jit(lambda p: (gpt.gpt_apply(p, ids, config=SMALL),
                                    gpt.gpt_loss(p, data[0], config=SMALL)))(
                                        params)
  np.testing.assert_allclose(stats.loss, loss, rtol=1e-10)
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
  data = gpt_batches(1)
  f32 = trained(*small_trainer(), params, data)
  bf16 = trained(*small_trainer(compute_dtype=jnp.bfloat16), params, data)
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


def test_a_steps_own_output_is_not_placed_again(monkeypatch):
  """Stepping on the last step's output moves none of its leaves: a
  ``jax.device_put`` of each leaf, already where it goes, cost ~0.1 ms of
  host time per leaf and step (with Adam's ~300 leaves the plan CLI's GPT
  stepped at 32 ms on an H200, the plain jitted step at 9.6;
  ``docs/benchmarks.md``, "On a GPU")."""
  trainer, split = small_trainer()
  pp, _ = gpt.split_for_pipeline(dense_params(jnp.float32, SMALL),
                                 num_stages=split.num_stages)
  batch = gpt_batches(1)[0]
  state, _ = trainer.step(trainer.init(pp), batch)
  leaves = {id(x) for x in jax.tree.leaves(state)}
  put, real = [], jax.device_put
  monkeypatch.setattr(jax, 'device_put', lambda x, *a, **k: (
      put.extend(jax.tree.leaves(x)), real(x, *a, **k))[1])
  trainer.step(state, batch)
  assert len(leaves) > 20 and put   # the batch is placed
  assert not [x for x in put if id(x) in leaves]


def test_non_finite_step_is_skipped():
  """A NaN param: the step is skipped (step count and state unchanged)."""
  params = dense_params(jnp.float32, SMALL)
  params['ln_f']['scale'] = params['ln_f']['scale'].at[0].set(jnp.nan)
  trainer, split = small_trainer()    # test_bf16's float32 program
  pp, _ = gpt.split_for_pipeline(params, num_stages=split.num_stages)
  state = trainer.init(pp)
  new, stats = trainer.step(state, gpt_batches(1)[0])
  assert bool(stats.skipped) and int(new.step) == 0
  chex.assert_trees_all_equal(new.params, state.params)
