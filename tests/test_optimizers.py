"""Every optax optimizer gives single-device results under every layout.

Optimizers x layouts x ZeRO stages, float64, against plain optax on one
device. The update runs on global arrays under ``jit`` (XLA partitions it),
so transforms that look across elements -- a global norm, LAMB/LARS trust
ratios, Adafactor's factored moments, Muon's matrix products -- see whole
tensors. The bugs this guards against (an update on local shards or ZeRO
slices) were off by 5e-5 to 7e-3 after 3 steps; the tolerances are 1e-9.

Exactly-zero gradients: in the GPT the attention key bias has a gradient
that is zero in exact arithmetic (softmax ignores a per-row shift), so in
floating point it is rounding noise (~1e-17) whose value depends on the
summation order, i.e. on the layout. Adaptive optimizers divide by
``sqrt(v) + eps``, which turns noise into full-sized steps when ``eps`` is
tiny; the 3D cases use ``eps=1e-6`` (Adafactor: ``eps=1e-12`` on the squared
gradient) so that noise stays ~1e-11 of a step, far below what a per-shard
norm would change (1e-3).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_data_parallel import make_batches, reference_run
from test_zero import mesh_of, wide_loss, wide_params

import jaxpar
from jaxpar.models import gpt

OPTIMIZERS = {
    'clip_adamw': lambda: optax.chain(
        optax.clip_by_global_norm(0.05),
        optax.adamw(0.01, eps=1e-6, weight_decay=0.1)),
    'lamb': lambda: optax.lamb(0.01, eps=1e-6),
    'lars': lambda: optax.lars(0.05),
    'adafactor': lambda: optax.adafactor(0.01, min_dim_size_to_factor=16,
                                         eps=1e-12),
    'muon': lambda: optax.contrib.muon(0.01),
    'multisteps': lambda: optax.MultiSteps(optax.adam(0.01, eps=1e-6),
                                           every_k_schedule=2),
    'inject_hyperparams': lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=0.01, eps=1e-6),
}

DP_CASES = ([(name, 'data8', z) for name in OPTIMIZERS for z in (1, 3)]
            + [('clip_adamw', 'data8', 0), ('lamb', 'data8', 0),
               ('lamb', 'data2_stage2_tensor2', 3),
               ('adafactor', 'data2_stage2_tensor2', 1)])


def assert_close_history(got, want):
  for (loss, norm, params), (ref_loss, ref_norm, ref_params) in zip(got, want):
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-10)
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-10)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize('name,mesh_name,zero_stage', DP_CASES)
def test_data_parallel(x64, name, mesh_name, zero_stage):
  params = wide_params(dtype=jnp.float64)
  batches = make_batches(3, 16, dtype=np.float64)
  optimizer = OPTIMIZERS[name]()
  trainer = jaxpar.data_parallel.train_step(
      wide_loss, optimizer, mesh=mesh_of(mesh_name), zero_stage=zero_stage,
      num_microbatches=2)
  state, got = trainer.init(params), []
  for batch in batches:
    state, stats = trainer.step(state, batch)
    got.append((stats.loss, stats.grad_norm,
                jax.tree.map(np.asarray, trainer.params(state))))
  assert_close_history(got, reference_run(params, batches, optimizer,
                                          loss_of=wide_loss))


@pytest.mark.parametrize('zero_stage', [0, 3])
def test_max_grad_norm_is_chain_with_clip(x64, zero_stage):
  params = wide_params(dtype=jnp.float64)
  batches = make_batches(3, 16, dtype=np.float64)
  optimizer = optax.adamw(0.01, weight_decay=0.1)
  trainer = jaxpar.data_parallel.train_step(
      wide_loss, optimizer, mesh=mesh_of('data8'), zero_stage=zero_stage,
      max_grad_norm=0.05)
  state, got = trainer.init(params), []
  for batch in batches:
    state, stats = trainer.step(state, batch)
    got.append((stats.loss, stats.grad_norm,
                jax.tree.map(np.asarray, trainer.params(state))))
  want = reference_run(params, batches, optimizer, 0.05, loss_of=wide_loss)
  assert float(want[0][1]) > 0.05     # clipping is exercised
  assert_close_history(got, want)


CONFIG = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16, num_heads=2,
                       num_layers=2)


@functools.cache
def gpt_setup():
  params = jax.tree.map(lambda x: x.astype(jnp.float64),
                        gpt.gpt_params(gpt.GPT(CONFIG, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  data = [(rng.integers(0, 16, (8, 8)), rng.integers(0, 16, (8, 8)))
          for _ in range(2)]
  return params, data


def pipeline_reference(pp, layout, data, optimizer):
  """Plain optax on the PipelineParams on one device (model order)."""
  loss = lambda p, b: gpt.gpt_loss(gpt.merge_from_pipeline(p, layout), b,
                                   config=CONFIG)
  value_and_grad = jax.jit(jax.value_and_grad(loss))
  opt_state, out = optimizer.init(pp), []
  for batch in data:
    value, grads = value_and_grad(pp, batch)
    updates, opt_state = optimizer.update(grads, opt_state, pp)
    pp = optax.apply_updates(pp, updates)
    out.append((value, optax.tree.norm(grads), pp))
  return out


@pytest.mark.parametrize('name,zero_stage', [
    ('clip_adamw', 0), ('clip_adamw', 3), ('lamb', 1), ('adafactor', 3),
    ('muon', 3)])
def test_3d_2x2x2(x64, name, zero_stage):
  params, data = gpt_setup()
  schedule = jaxpar.pipeline.one_f_one_b(2, 2)
  pp, layout = gpt.split_for_pipeline(params, num_stages=2)
  optimizer = OPTIMIZERS[name]()
  trainer = jaxpar.parallel.train_step(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optimizer,
      schedule=schedule, mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
      stage_mask=layout.mask, zero_stage=zero_stage)
  state, got = trainer.init(pp), []
  for batch in data:
    state, stats = trainer.step(state, batch)
    assert not bool(stats.skipped)
    got.append((stats.loss, stats.grad_norm,
                jax.tree.map(np.asarray, trainer.params(state))))
  assert_close_history(got, pipeline_reference(pp, layout, data, optimizer))
