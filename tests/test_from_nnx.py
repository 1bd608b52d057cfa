"""jaxpar.parallel.from_nnx: a user's own Flax NNX model (tests/llama.py)
trained with jaxpar as written.

Every mesh and schedule against the single-device reference: the model as
the user wrote it, ``jax.value_and_grad`` and optax on one device, float64.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
import llama

CONFIG = llama.Config(layers=5, dtype=jnp.float64)   # 5 layers: uneven splits
OPTIMIZER = optax.sgd(0.3, momentum=0.9)
MAX_GRAD_NORM = 0.5


def embed(m, ids):
  return m.embed(ids)


def head_loss(m, y, targets):
  return llama.xent(m.head(m.final_norm(y)), targets)


def batches(num=2, size=8, seq=6):
  rng = np.random.default_rng(0)
  return [(rng.integers(0, CONFIG.vocab, (size, seq)),
           rng.integers(0, CONFIG.vocab, (size, seq))) for _ in range(num)]


def params_of(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@functools.cache
def reference(model_type):
  """One device, float64: (loss, grad norm, params) after each step."""
  with jax.enable_x64(True):
    model = model_type(CONFIG, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM),
                            OPTIMIZER)

    @jax.jit   # one program: eager optax would compile op by op
    def step(params, opt_state, ids, targets):
      loss, grads = jax.value_and_grad(
          lambda p: llama.loss(nnx.merge(graphdef, p, rest), ids, targets))(
              params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state,
              (loss, optax.tree.norm(grads)))

    opt_state, out = optimizer.init(params), []
    for ids, targets in batches():
      params, opt_state, (loss, norm) = step(params, opt_state, ids, targets)
      out.append((loss, norm, nnx.to_pure_dict(params)))
    return out


# Megatron's split, by param path (block params: their path inside a block).
RULES = {r'attn/w[qkv]/kernel': (None, 'tensor'),
         r'attn/wo/kernel': ('tensor', None),
         r'mlp/w_(gate|up)/kernel': (None, 'tensor'),
         r'mlp/w_down/kernel': ('tensor', None),
         r'head/kernel': (None, 'tensor')}


def annotated_llama(config, rngs):
  """The Llama with Flax sharding annotations on its kernels (same values)."""
  with nnx.use_eager_sharding(False):
    return llama.Llama(config._replace(annotate=True), rngs)


# model, mesh, schedule, train_step options, from_nnx options
CASES = {
    '4x2-interleaved-zero3': (llama.Llama, dict(data=4, stage=2),
                              lambda: jaxpar.pipeline.interleaved_one_f_one_b(2, 2, 2),
                              dict(zero_stage=3), {}),
    '2x2-zero_bubble_v-stacked': (llama.ScannedLlama, dict(data=2, stage=2),
                        lambda: jaxpar.pipeline.zero_bubble_v(2, 2), {}, {}),
    '2x2x2-1f1b-rules': (llama.Llama, dict(data=2, stage=2, tensor=2),
                         lambda: jaxpar.pipeline.one_f_one_b(2, 2),
                         dict(zero_stage=1), dict(tensor_rules=RULES)),
    '1x2x4-zero_bubble_v-annotated': (annotated_llama, dict(data=1, stage=2, tensor=4),
                            lambda: jaxpar.pipeline.zero_bubble_v(2, 2), {}, {}),
}


def mesh(**sizes):
  n = int(np.prod(list(sizes.values())))
  return jaxpar.make_mesh(**sizes, devices=jax.devices()[:n])


@functools.cache
def trained(case):
  """(model, pm, trainer, schedule, state, per-step results) of a case."""
  model_type, mesh_sizes, make_schedule, options, split = CASES[case]
  with jax.enable_x64(True):
    model = model_type(CONFIG, nnx.Rngs(0))
    schedule = make_schedule()
    pm = jaxpar.parallel.from_nnx(model, blocks='blocks',
                                  num_stages=schedule.num_stages,
                                  embed=embed, head_loss=head_loss, **split)
    trainer = jaxpar.parallel.trainer(
        pm, OPTIMIZER, schedule=schedule, mesh=mesh(**mesh_sizes),
        max_grad_norm=MAX_GRAD_NORM, **options)
    state = trainer.init(pm.params)
    out = []
    for batch in batches():
      state, stats = trainer.step(state, batch)
      # Back into the user's model (host copies: no per-leaf device ops;
      # test_checkpoint_through_the_pipeline_model converts device arrays).
      pm.update(model, jax.device_get(trainer.params(state)))
      out.append((stats.loss, stats.grad_norm, params_of(model)))
    return model, pm, trainer, schedule, state, out


@pytest.mark.parametrize('case', list(CASES))
def test_pipeline_matches_single_device_float64(x64, case):
  """Interleaved + ZeRO-3 (5 layers on 4 stages: identity slots), ZB-V
  (stacked blocks), uneven layers, 3D 1F1B with tensor rules (ZeRO-1) or
  ZB-V with the model's Flax annotations (its layers as
  written, full head count in the reshapes): same losses, norms and
  (written back into the model) params."""
  model_type = CASES[case][0]
  got, want = trained(case)[-1], reference(
      llama.ScannedLlama if model_type is llama.ScannedLlama else llama.Llama)
  assert float(want[0][1]) > MAX_GRAD_NORM   # clipping is exercised
  for (loss, norm, p), (ref_loss, ref_norm, ref_p) in zip(got, want):
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-10)
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-10)
    chex.assert_trees_all_close(p, ref_p, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize('case', ['2x2x2-1f1b-rules', '1x2x4-zero_bubble_v-annotated'])
def test_tensor_split_params_are_sharded(x64, case):
  """The split params are stored split over 'tensor' (Megatron's split)."""
  state = trained(case)[4]
  spec = lambda leaf: tuple(leaf.sharding.spec)
  assert spec(state.params.stages['attn']['wq']['kernel'])[-1] == 'tensor'
  assert 'tensor' in spec(state.params.stages['mlp']['w_down']['kernel'])[-2]
  assert 'tensor' not in spec(state.params.stages['attn_norm']['scale'])


def test_data_parallel_zero3_matches_single_device_float64(x64):
  """DP + ZeRO-3 needs no split: the user's loss on nnx.split params."""
  model = llama.Llama(CONFIG, nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  step = jaxpar.data_parallel.trainer(
      lambda p, batch: llama.loss(nnx.merge(graphdef, p, rest), *batch),
      OPTIMIZER, mesh=jaxpar.make_mesh(data=8), zero_stage=3,
      max_grad_norm=MAX_GRAD_NORM).step
  state = jaxpar.TrainState.create(params, OPTIMIZER)
  for batch, (ref_loss, ref_norm, ref_p) in zip(batches(),
                                                reference(llama.Llama)):
    state, stats = step(state, batch)
    np.testing.assert_allclose(stats.loss, ref_loss, rtol=1e-10)
    np.testing.assert_allclose(stats.grad_norm, ref_norm, rtol=1e-10)
    chex.assert_trees_all_close(nnx.to_pure_dict(jax.device_get(state.params)),
                                ref_p, rtol=1e-9, atol=1e-11)


def test_cut_and_its_state_round_trip():
  model = llama.Llama(CONFIG._replace(dtype=jnp.float32), nnx.Rngs(0))
  pm = jaxpar.parallel.from_nnx(model, blocks='blocks', num_stages=2,
                                embed=embed, head_loss=head_loss)
  assert pm.stage_mask.tolist() == [[True] * 3, [True, True, False]]
  assert pm.params.stages['attn']['wq']['kernel'].shape == (2, 3, 16, 16)
  assert list(pm.params.embed) == ['embed']
  assert sorted(pm.params.head) == ['final_norm', 'head']
  np.testing.assert_array_equal(pm.params.stages['mlp']['w_up']['kernel'][1, 1],
                                model.blocks[4].mlp.w_up.kernel[...])
  assert not pm.params.stages['mlp']['w_up']['kernel'][1, 2].any()  # identity
  back = nnx.to_pure_dict(pm.to_state(pm.params))
  chex.assert_trees_all_equal(back, params_of(model))
  chex.assert_trees_all_equal(pm.from_state(pm.to_state(pm.params)),
                              pm.params)


def test_checkpoint_through_the_pipeline_model(x64, tmp_path):
  """The trainer's state round-trips; the model's own params restore into a
  fresh model that another split (3 stages) then trains from."""
  model, pm, trainer, schedule, state, _ = trained('4x2-interleaved-zero3')
  jaxpar.checkpoint.save(tmp_path / 'state', state, schedule=schedule)
  restored = jaxpar.checkpoint.restore(
      tmp_path / 'state', trainer.init(pm.params), schedule=schedule)
  chex.assert_trees_all_equal(jax.device_get(restored),
                              jax.device_get(state))

  saved = nnx.to_pure_dict(pm.to_state(trainer.params(state)))
  jaxpar.checkpoint.save(tmp_path / 'model', jax.device_get(saved), step=2)
  fresh = llama.Llama(CONFIG, nnx.Rngs(1))
  nnx.update(fresh, jaxpar.checkpoint.restore(tmp_path / 'model',
                                              params_of(fresh)))
  chex.assert_trees_all_equal(params_of(fresh), params_of(model))
  other = jaxpar.parallel.from_nnx(fresh, blocks='blocks', num_stages=3,
                                   embed=embed, head_loss=head_loss)
  assert other.stage_mask.tolist() == [[True, True], [True, True],
                                       [True, False]]
  chex.assert_trees_all_equal(nnx.to_pure_dict(other.to_state(other.params)),
                              params_of(model))


class _Odd(nnx.Module):
  """A model whose last block has another MLP width."""

  def __init__(self, rngs):
    c = CONFIG._replace(dtype=jnp.float32)
    self.embed = nnx.Embed(c.vocab, c.dim, rngs=rngs)
    self.blocks = nnx.List([llama.Block(c, rngs),
                            llama.Block(c._replace(hidden=8), rngs)])


class _Single(nnx.Module):
  """A model whose `blocks` is one unstacked block."""

  def __init__(self, rngs):
    self.blocks = llama.Block(CONFIG._replace(dtype=jnp.float32), rngs)


class TestErrors:

  def model(self):
    return llama.Llama(CONFIG._replace(dtype=jnp.float32), nnx.Rngs(0))

  def from_nnx(self, model=None, **kw):
    return jaxpar.parallel.from_nnx(
        self.model() if model is None else model,
        **{**dict(blocks='blocks', num_stages=2, embed=embed,
                  head_loss=head_loss), **kw})

  def test_unknown_blocks_path(self):
    with pytest.raises(ValueError, match=r"blocks='layers'.*Llama has no "
                       r"attribute 'layers'.*\['embed', 'blocks'"):
      self.from_nnx(blocks='layers')
    with pytest.raises(ValueError, match=r"Llama.blocks has no attribute"):
      self.from_nnx(blocks='blocks.layers')

  def test_blocks_of_different_structure(self):
    with pytest.raises(ValueError, match=r"block 1 .*differs in structure "
                       r"from block 0.*mlp/w_down/kernel"):
      self.from_nnx(_Odd(nnx.Rngs(0)))

  def test_not_a_sequence_of_blocks(self):
    with pytest.raises(ValueError, match=r"blocks='blocks' is one "
                       r"Block, so its params must be stacked"):
      self.from_nnx(_Single(nnx.Rngs(0)))

  def test_stage_counts(self):
    with pytest.raises(ValueError, match=r'num_stages=6: .*has 5 layers'):
      self.from_nnx(num_stages=6)
    with pytest.raises(ValueError, match=r'counts=\(4, 2\)'):
      self.from_nnx(counts=(4, 2))

  def test_function_reading_the_other_part(self):
    """A tied head reads the embedding, which is embed's."""
    tied = lambda m, y, t: llama.xent(m.embed.attend(m.final_norm(y)), t)
    pm = self.from_nnx(head_loss=tied)
    y = jnp.zeros((2, 6, 16))
    with pytest.raises(ValueError, match=r"head_loss reads \['embed/embedding'"
                       r"\].*tied embeddings"):
      pm.functions[2](pm.params.head, y, jnp.zeros((2, 6), jnp.int32))
    # The fix the message names: say which params are the head's.
    pm = self.from_nnx(head=['embed', 'final_norm', 'head'],
                       embed=lambda m, ids: jnp.zeros(ids.shape + (16,)))
    assert sorted(pm.params.head) == ['embed', 'final_norm', 'head']

  def test_tensor_rule_matching_nothing(self):
    with pytest.raises(ValueError, match=r"tensor_rules \['attn/w_q/kernel'\] "
                       r"match no param.*by their path inside a block.*"
                       r"'attn/wq/kernel'"):
      self.from_nnx(tensor_rules={'attn/w_q/kernel': (None, 'tensor')})
    with pytest.raises(ValueError, match=r"has 3 entries but param "
                       r"'head/kernel' has 2 dims"):
      self.from_nnx(tensor_rules={'head/kernel': (None, None, 'tensor')})

  def test_tensor_split_that_does_not_divide(self):
    model = llama.Llama(CONFIG._replace(dtype=jnp.float32, vocab=33),
                        nnx.Rngs(0))
    pm = self.from_nnx(model, tensor_rules=RULES)
    trainer = jaxpar.parallel.trainer(
        pm, optax.sgd(0.1), schedule=jaxpar.pipeline.one_f_one_b(2, 2),
        mesh=mesh(data=1, stage=2, tensor=2))
    with pytest.raises(ValueError, match=r"param 'head/kernel' \(16, 33\): "
                       r"dim 1 of size 33 is split over 'tensor'.*size 2"):
      trainer.init(pm.params)

  def test_trainer_takes_the_model_and_optimizer_only(self):
    pm = self.from_nnx()
    with pytest.raises(TypeError, match='PipelineModel and the optimizer'):
      jaxpar.parallel.trainer(pm, pm.functions[1], optax.sgd(0.1),
                              schedule=jaxpar.pipeline.one_f_one_b(2, 2),
                              mesh=jaxpar.make_mesh(data=4, stage=2))
    # A PipelineModel's tensor split is from_nnx's: the error names where.
    with pytest.raises(TypeError, match=r'pass the rules there: '
                       r'from_nnx\(model, \.\.\., tensor_rules=rules\)'):
      jaxpar.parallel.trainer(pm, optax.sgd(0.1), tensor_rules=RULES,
                              schedule=jaxpar.pipeline.one_f_one_b(2, 2),
                              mesh=jaxpar.make_mesh(data=4, stage=2))


class _DropBlock(nnx.Module):

  def __init__(self, rngs):
    self.fc = nnx.Linear(8, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(self.fc(x))


class _DropNet(nnx.Module):

  def __init__(self, rngs):
    self.embed = nnx.Embed(4, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.blocks = nnx.List([_DropBlock(rngs) for _ in range(3)])


def test_dropout_keys_reseed_the_models_own_streams():
  """With a key, slot j of a stage runs its block with every RNG stream
  reseeded from fold_in(key, j), embed with the key itself; no key: the
  streams the model has (deterministic blocks here)."""
  net = _DropNet(nnx.Rngs(params=0, dropout=1))
  split = functools.partial(
      jaxpar.parallel.from_nnx, blocks='blocks', num_stages=1,
      embed=lambda m, ids: m.drop(m.embed(ids)),
      head_loss=lambda m, y, t: jnp.mean((y - t) ** 2))
  pm = split(net)
  embed_fn, stage_fn, _ = pm.functions
  key, ids = jax.random.key(7), jnp.arange(12).reshape(3, 4) % 4
  stage = jax.tree.map(lambda a: a[0], pm.params.stages)
  x = embed_fn(pm.params.embed, ids, key)
  nnx.reseed(net, dropout=key)
  np.testing.assert_array_equal(x, net.drop(net.embed(ids)))
  want = x
  for j, block in enumerate(net.blocks):
    nnx.reseed(block, dropout=jax.random.fold_in(key, j))
    want = block(want)
  np.testing.assert_allclose(stage_fn(stage, x, key), want, rtol=1e-6)
  assert not np.allclose(stage_fn(stage, x, jax.random.key(8)), want)
  net.eval()     # deterministic: no key needed, the blocks as written
  np.testing.assert_allclose(
      split(net).functions[1](stage, x),
      net.blocks[2](net.blocks[1](net.blocks[0](x))), rtol=1e-6)
