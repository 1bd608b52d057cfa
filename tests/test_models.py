"""Reference models: the dense NNX models and their tensor-parallel forms agree."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.models import MLP, gpt

tp = jaxpar.tensor_parallel


def test_mlp_runs_tensor_parallel_exactly(x64):
  mlp = MLP(8, 32, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
  params = nnx.to_pure_dict(nnx.state(mlp, nnx.Param))
  x = jax.random.normal(jax.random.key(1), (3, 8), jnp.float64)
  mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
  fn = jax.shard_map(tp.parallel_mlp, mesh=mesh,
                     in_specs=(tp.param_specs(params), P()), out_specs=P())
  y = jax.jit(fn)(tp.shard_params(params, mesh=mesh), x)
  np.testing.assert_allclose(y, mlp(x), rtol=1e-12)


def test_gpt_loss_is_the_nnx_models_loss(x64):
  config = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16, num_heads=4,
                         num_layers=2)
  model = gpt.GPT(config, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
  ids = np.random.default_rng(0).integers(0, 16, (2, 8))
  want = optax.losses.softmax_cross_entropy_with_integer_labels(
      model(ids), ids).mean()
  got = gpt.gpt_loss(gpt.gpt_params(model), (ids, ids), config=config)
  np.testing.assert_allclose(got, want, rtol=1e-13)


def test_pipeline_split_round_trips():
  config = gpt.GPTConfig(num_layers=5)
  params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0)))
  pp, layout = gpt.split_for_pipeline(params, num_stages=3)
  assert layout.counts == (2, 2, 1) and layout.slots == 2
  assert jax.tree.leaves(pp.stages)[0].shape[:2] == (3, 2)
  chex.assert_trees_all_equal(gpt.merge_from_pipeline(pp, layout), params)


def test_parallel_gpt_functions_equal_the_dense_model(x64):
  """embed -> stages -> head on tensor=2 (one stage) == gpt_loss."""
  config = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16, num_heads=4,
                         num_layers=2)
  params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0),
                                  param_dtype=jnp.float64))
  ids = np.random.default_rng(0).integers(0, 16, (2, 8))
  pp, _ = gpt.split_for_pipeline(params, num_stages=1)
  mesh = jaxpar.make_mesh(tensor=2, devices=jax.devices()[:2])

  def loss(embed, stages, head, ids, targets):
    x = gpt.embed_fn(embed, ids)
    y = gpt.stage_fn(jax.tree.map(lambda a: a[0], stages), x)
    return gpt.head_loss_fn(head, y, targets)

  specs = [tp.param_specs(part) for part in pp]
  fn = jax.shard_map(loss, mesh=mesh, in_specs=(*specs, P(), P()),
                     out_specs=P())
  placed = [tp.shard_params(part, mesh=mesh) for part in pp]
  got = jax.jit(fn)(*placed, ids, ids)
  want = gpt.gpt_loss(params, (ids, ids), config=config)
  np.testing.assert_allclose(got, want, rtol=1e-12)
