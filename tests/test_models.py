"""jaxpar.models: the dense NNX models and their tensor-parallel forms agree;
``sampling.generate`` is the dense model token by token; ``flops`` counts
6N + 12LdS as a hand count does."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.models import MLP, flops, gpt, sampling
from helpers import random_gpt_params, tree_allclose

tp = jaxpar.tensor_parallel


# Model building, splitting and merging, each as one compiled program (run
# op by op, each operation on each leaf shape compiled one by one, they cost
# more than the programs the tests check).


def params_of(config, dtype=jnp.float32):
  """``gpt_params`` of ``GPT(config)`` with ``nnx.Rngs(0)``."""
  return jax.jit(lambda: gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0),
                                                param_dtype=dtype)))()


def split(params, num_stages):
  """``split_for_pipeline(params, num_stages=...)``: (params, LayerSplit)."""
  splits = []

  def pipeline_params(params):
    pp, layer_split = gpt.split_for_pipeline(params, num_stages=num_stages)
    splits.append(layer_split)   # static: sizes
    return pp
  return jax.jit(pipeline_params)(params), splits[0]


def merge(pp, layer_split):
  return jax.jit(lambda pp: gpt.merge_from_pipeline(pp, layer_split))(pp)


def test_mlp_runs_tensor_parallel_exactly(x64):
  mlp = nnx.jit(lambda: MLP(8, 32, rngs=nnx.Rngs(0),
                            param_dtype=jnp.float64))()
  params = nnx.to_pure_dict(nnx.state(mlp, nnx.Param))
  x = np.random.default_rng(1).standard_normal((3, 8))
  mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
  rules = jaxpar.models.mlp.TENSOR_RULES
  specs = tp.param_specs(params, rules=rules)
  assert specs['fc_in']['kernel'] == P(None, 'tensor')
  assert specs['fc_out'] == {'kernel': P('tensor', None), 'bias': P()}
  fn = jax.shard_map(tp.parallel_mlp, mesh=mesh, in_specs=(specs, P()),
                     out_specs=P())
  y = jax.jit(fn)(tp.shard_params(params, mesh=mesh, rules=rules), x)
  np.testing.assert_allclose(y, nnx.jit(lambda m, x: m(x))(mlp, x),
                             rtol=1e-12)


def test_gpt_loss_is_the_nnx_models_loss(x64):
  config = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16, num_heads=4,
                         num_layers=2)
  model = nnx.jit(lambda: gpt.GPT(config, rngs=nnx.Rngs(0),
                                  param_dtype=jnp.float64))()
  ids = np.random.default_rng(0).integers(0, 16, (2, 8))
  xent = optax.losses.softmax_cross_entropy_with_integer_labels
  want = nnx.jit(lambda m: xent(m(ids), ids).mean())(model)
  got = jax.jit(lambda p: gpt.gpt_loss(p, (ids, ids), config=config))(
      gpt.gpt_params(model))
  np.testing.assert_allclose(got, want, rtol=1e-13)


def test_pipeline_split_round_trips():
  config = gpt.GPTConfig(num_layers=5)
  params = params_of(config)
  pp, layer_split = split(params, 3)
  assert layer_split.counts == (2, 2, 1) and layer_split.slots == 2
  assert jax.tree.leaves(pp.stages)[0].shape[:2] == (3, 2)
  chex.assert_trees_all_equal(merge(pp, layer_split), params)
  assert gpt.split_for_pipeline(params, num_stages=np.int64(5))[1].slots == 1


def test_pipeline_split_errors():
  params = jax.eval_shape(lambda: params_of(gpt.GPTConfig(num_layers=2)))
  with pytest.raises(TypeError, match='num_stages=True must be an int'):
    gpt.split_for_pipeline(params, num_stages=True)
  with pytest.raises(ValueError, match=r'num_stages=3: the GPT has 2 layers; '
                     r'use 1 <= num_stages <= 2'):
    gpt.split_for_pipeline(params, num_stages=3)


@pytest.mark.parametrize('dtype, tol', [(jnp.float64, 1e-10),
                                        (jnp.float32, 2e-5)])
def test_parallel_gpt_functions_equal_the_dense_model(dtype, tol):
  """embed -> stages (3 layers on 2 stages: one identity slot) -> head on
  tensor=2 == gpt_loss, value and gradients (float32: jax.nn attention)."""
  config = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16, num_heads=4,
                         num_layers=3)
  with jax.enable_x64(dtype == jnp.float64):
    params = params_of(config, dtype)
    ids = np.random.default_rng(0).integers(0, 16, (2, 8))
    targets = np.roll(ids, -1, axis=1)
    pp, layer_split = split(params, 2)
    assert layer_split.counts == (2, 1)
    mesh = jaxpar.make_mesh(tensor=2, devices=jax.devices()[:2])

    def loss(pp, ids, targets):
      x = gpt.embed_fn(pp.embed, ids)
      for k in range(2):
        x = gpt.stage_fn(jax.tree.map(lambda a: a[k], pp.stages), x)
      return gpt.head_loss_fn(pp.head, x, targets)

    rules = gpt.TENSOR_RULES
    specs = type(pp)(*(tp.param_specs(part, rules=rules) for part in pp))
    fn = jax.shard_map(jax.value_and_grad(loss), mesh=mesh,
                       in_specs=(specs, P(), P()), out_specs=(P(), specs))
    placed = type(pp)(*(tp.shard_params(part, mesh=mesh, rules=rules)
                        for part in pp))
    got, grads = jax.jit(fn)(placed, ids, targets)
    want, want_grads = jax.jit(jax.value_and_grad(functools.partial(
        gpt.gpt_loss, config=config)))(params, (ids, targets))  # one compile
    assert got.dtype == dtype
    np.testing.assert_allclose(got, want, rtol=tol)
    tree_allclose(merge(grads, layer_split), want_grads, rtol=tol)


def test_gpt_stage_identity_slots_are_exact():
  """A stage's zero (identity) slot returns its input bit for bit."""
  config = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16, num_layers=3)
  pp, _ = split(params_of(config), 2)
  mesh = jaxpar.make_mesh(tensor=2, devices=jax.devices()[:2])
  stages = jax.device_get(pp.stages)                    # sliced in NumPy
  real = jax.tree.map(lambda a: a[1, :1], stages)       # stage 1: 1 real
  padded = jax.tree.map(lambda a: a[1], stages)         # + 1 identity slot
  x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)

  def run(stage):
    spec = tp.param_specs(stage, rules=gpt.TENSOR_RULES)
    return jax.jit(jax.shard_map(gpt.stage_fn, mesh=mesh,
                                 in_specs=(spec, P()), out_specs=P()))(
                                     tp.shard_params(stage, mesh=mesh,
                                                     rules=gpt.TENSOR_RULES),
                                     x)

  np.testing.assert_array_equal(run(padded), run(real))


def test_block_dropout_masks_match_with_sequence_parallelism():
  """The same key gives the same masks on replicated and sequence shards."""
  params = jax.device_get(params_of(gpt.GPTConfig(d_model=16))['blocks'][0])
  mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
  x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
  key = jax.random.key(1)
  specs = tp.param_specs(params, rules=gpt.TENSOR_RULES)
  placed = tp.shard_params(params, mesh=mesh, rules=gpt.TENSOR_RULES)

  def run(spec, **kw):
    block = jax.shard_map(
        lambda p, x, k: tp.transformer_block(p, x, dropout=0.5, key=k, **kw),
        mesh=mesh, in_specs=(specs, spec, P()), out_specs=spec)
    return jax.jit(block)(placed,
                          jax.device_put(x, jax.NamedSharding(mesh, spec)),
                          key)

  replicated = run(P())
  sequence = run(P(None, 'tensor', None), sequence_parallel=True)
  np.testing.assert_allclose(sequence, replicated, rtol=1e-5, atol=1e-5)
  plain = jax.jit(jax.shard_map(
      tp.transformer_block, mesh=mesh, in_specs=(specs, P()),
      out_specs=P()))(placed, x)
  assert np.abs(np.asarray(replicated) - np.asarray(plain)).max() > 0.1
  with pytest.raises(ValueError, match=r'rate=1.0 must be in \[0, 1\)'):
    tp.dropout(x, 1.0, key)


# -- sampling ------------------------------------------------------------------

TINY = gpt.GPTConfig(vocab_size=16, seq_len=4, d_model=8, num_heads=2,
                     num_layers=2)


@pytest.fixture(scope='module')
def tiny_params():
  return random_gpt_params(TINY)


def _reference(params, prompt, length, pick):
  """Token by token: the dense model on the last seq_len tokens."""
  apply = jax.jit(gpt.gpt_apply, static_argnames='config')
  tokens = list(prompt)
  for t in range(length):
    window = jnp.array([tokens[-TINY.seq_len:]])
    logits = apply(params, window, config=TINY)[0, -1]
    tokens.append(int(pick(logits, t)))
  return tokens[len(prompt):]


def test_greedy_generation_is_argmax_of_the_dense_model(tiny_params):
  prompt = np.array([3, 1, 4])
  out = sampling.generate(tiny_params, prompt, config=TINY, length=5)
  assert out.dtype == jnp.int32
  # 3 + 5 tokens > seq_len 4: the window slides.
  assert out.tolist() == _reference(tiny_params, prompt, 5,
                                    lambda logits, t: jnp.argmax(logits))


def test_temperature_samples_with_the_key(tiny_params):
  key, temperature = jax.random.key(5), 0.7
  out = sampling.generate(tiny_params, [2], config=TINY, length=5,
                          temperature=temperature, key=key)
  assert out.tolist() == _reference(
      tiny_params, [2], 5, lambda logits, t: jax.random.categorical(
          jax.random.fold_in(key, t), logits / temperature))
  other = sampling.generate(tiny_params, [2], config=TINY, length=5,
                            temperature=temperature, key=jax.random.key(6))
  assert other.tolist() != out.tolist()


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(prompt=[]), ValueError, 'non-empty 1-D'),
    (dict(prompt=[16]), ValueError, r'lie in \[0, 16\)'),
    (dict(length=True), TypeError, 'length=True must be an int'),
    (dict(length=0), ValueError, 'length=0 must be an int >= 1'),
    (dict(temperature=-1.0), ValueError, 'finite and >= 0'),
    (dict(temperature=0.5), ValueError, 'pass key='),
])
def test_generate_refuses_bad_arguments(tiny_params, kwargs, error, message):
  args = dict(prompt=[1], length=2, temperature=0.0) | kwargs
  with pytest.raises(error, match=message):
    sampling.generate(tiny_params, args.pop('prompt'), config=TINY, **args)


# -- FLOPs ---------------------------------------------------------------------


def test_flops_per_token_by_hand():
  """L=2, d=8, V=16, S=4, r=4: per block q,k,v,o 4*(64+8)=288, MLP
  8*32+32 + 32*8+8 = 552, two LayerNorms 32 -> 872; final LN 16, head
  8*16+16 = 144: N = 2*872 + 160 = 1904. Attention 12*2*8*4 = 768."""
  assert flops.gpt_params_without_embeddings(TINY) == 1904
  assert flops.gpt_flops_per_token(TINY) == 6 * 1904 + 768
  params = gpt.gpt_params(nnx.eval_shape(lambda: gpt.GPT(TINY,
                                                          rngs=nnx.Rngs(0))))
  total = sum(x.size for x in jax.tree.leaves(params))
  assert total == 1904 + 16 * 8 + 4 * 8   # + token and position tables


def test_peak_flops_only_for_known_gpus():
  class Device:
    def __init__(self, platform, kind):
      self.platform, self.device_kind = platform, kind
  assert flops.peak_flops(Device('gpu', 'NVIDIA H100 80GB HBM3')) == 989e12
  assert flops.peak_flops(Device('gpu', 'NVIDIA H200')) == 989e12
  assert flops.peak_flops(Device('gpu', 'Tesla T4')) is None
  assert flops.peak_flops(jax.devices()[0]) is None
