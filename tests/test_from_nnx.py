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
from helpers import tree_allclose

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
    trainer = jaxpar.parallel.model_trainer(
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
    tree_allclose(p, ref_p, rtol=1e-9, atol=1e-11)


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
    tree_allclose(nnx.to_pure_dict(jax.device_get(state.params)), ref_p,
                  rtol=1e-9, atol=1e-11)


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
    """A tied head reads the embedding: one param of embed (pm.tied); a
    head reading block params, or embed reading head params, is refused."""
    tied = lambda m, y, t: llama.xent(m.embed.attend(m.final_norm(y)), t)
    pm = self.from_nnx(head_loss=tied)
    ids = jax.ShapeDtypeStruct((2, 6), jnp.int32)
    assert pm.tied(pm.params, ids, ids) == (('embed', 'embedding'),)
    assert self.from_nnx().tied(pm.params, ids, ids) == ()
    y = jnp.zeros((2, 6, 16))
    with pytest.raises(ValueError, match=r"head_loss reads \['embed/embedding'"
                       r"\].*may read the embed params"):
      pm.functions[2](pm.params.head, y, jnp.zeros((2, 6), jnp.int32))
    deep = lambda m, y, t: tied(m, m.blocks[0](y), t)
    with pytest.raises(ValueError, match=r"head_loss reads \['blocks/0/.*"
                       r"never block params"):
      self.from_nnx(head_loss=deep).tied(pm.params, ids, ids)
    with pytest.raises(ValueError, match=r"embed reads \['final_norm/scale'"
                       r"\].*pass head=\[...\] to from_nnx without"):
      self.from_nnx(embed=lambda m, ids: m.final_norm(m.embed(ids))).tied(
          pm.params, ids, ids)
    # The fix the message names: say which params are the head's.
    pm = self.from_nnx(head=['embed', 'final_norm', 'head'],
                       embed=lambda m, ids: jnp.zeros(ids.shape + (16,)))
    assert sorted(pm.params.head) == ['embed', 'final_norm', 'head']

  def test_batch_stats_outside_the_blocks_go_to_their_side(self, x64):
    """A norm's statistics go with its params: defined after the blocks, to
    ``head_loss``; ``head=`` moves it. Updating another side's statistics
    is refused, naming them (their new values would be lost)."""
    model = NormNet(nnx.Rngs(0))
    model.inp_norm = nnx.BatchNorm(4, use_scale=False, use_bias=False,
                                   rngs=nnx.Rngs(0))
    state = self.from_nnx(model).model_state
    assert (state.embed, sorted(state.head)) == (None, ['inp_norm'])
    assert sorted(state.stages) == ['bn']
    pm = self.from_nnx(model, head=['out'],
                       embed=lambda m, x: m.inp(m.inp_norm(x)))
    assert (sorted(pm.model_state.embed), pm.model_state.head) == (
        ['inp_norm'], None)
    ones = jax.ShapeDtypeStruct((2, 4), jnp.float32)   # BatchStat s are f32
    x, new = jax.eval_shape(lambda p, x, s: pm.functions[0](p, x, state=s),
                            pm.params.embed, ones, pm.model_state.embed)
    assert x.shape == (2, 8) and new['inp_norm']['mean'].shape == (4,)
    with pytest.raises(ValueError, match=r"embed updates the nnx.BatchStat s "
                       r"\['inp_norm/mean', 'inp_norm/var'\], but from_nnx "
                       r"gave embed none.*Pass head="):
      jax.eval_shape(self.from_nnx(
          model, embed=lambda m, x: m.inp(m.inp_norm(x))).functions[0],
                     pm.params.embed, ones)

  def test_block_param_shared_with_another_part(self):
    model = self.model()
    model.blocks[1].mlp.w_up.kernel = model.blocks[0].mlp.w_up.kernel
    with pytest.raises(ValueError, match=r"param 'blocks/1/mlp/w_up/kernel' "
                       r"is the same nnx.Param as 'blocks/0/mlp/w_up/kernel'"):
      self.from_nnx(model)

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
    trainer = jaxpar.parallel.model_trainer(
        pm, optax.sgd(0.1), schedule=jaxpar.pipeline.one_f_one_b(2, 2),
        mesh=mesh(data=1, stage=2, tensor=2))
    with pytest.raises(ValueError, match=r"param 'head/kernel' \(16, 33\): "
                       r"dim 1 of size 33 is split over 'tensor'.*size 2"):
      trainer.init(pm.params)

  def test_a_model_and_three_functions_have_their_own_entries(self):
    pm = self.from_nnx()
    schedule = jaxpar.pipeline.one_f_one_b(2, 2)
    mesh_ = jaxpar.make_mesh(data=4, stage=2)
    # A model given to trainer (in any slot count) names model_trainer.
    with pytest.raises(TypeError, match=r'trains with parallel\.'
                       r'model_trainer\(model, optimizer, schedule=\.\.\., '
                       r'mesh=\.\.\.\)'):
      jaxpar.parallel.trainer(pm, optax.sgd(0.1), schedule=schedule,
                              mesh=mesh_)
    # Three functions given to model_trainer name trainer.
    with pytest.raises(TypeError, match=r'got partial; three functions '
                       r'train with parallel\.trainer\(embed_fn, stage_fn, '
                       r'loss_fn, optimizer'):
      jaxpar.parallel.model_trainer(*pm.functions, optax.sgd(0.1),
                                    schedule=schedule, mesh=mesh_)
    # A PipelineModel's tensor split is from_nnx's: model_trainer has no
    # tensor_rules.
    with pytest.raises(TypeError, match='tensor_rules'):
      jaxpar.parallel.model_trainer(pm, optax.sgd(0.1), tensor_rules=RULES,
                                    schedule=schedule, mesh=mesh_)


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
  x = embed_fn(pm.params.embed, ids, key=key)
  nnx.reseed(net, dropout=key)
  np.testing.assert_array_equal(x, net.drop(net.embed(ids)))
  want = x
  for j, block in enumerate(net.blocks):
    nnx.reseed(block, dropout=jax.random.fold_in(key, j))
    want = block(want)
  np.testing.assert_allclose(stage_fn(stage, x, key=key), want, rtol=1e-6)
  assert not np.allclose(stage_fn(stage, x, key=jax.random.key(8)), want)
  net.eval()     # deterministic: no key needed, the blocks as written
  np.testing.assert_allclose(
      split(net).functions[1](stage, x),
      net.blocks[2](net.blocks[1](net.blocks[0](x))), rtol=1e-6)


# ------------------------------------------------------------ tied weights


class _TiedBlock(nnx.Module):

  def __init__(self, rngs):
    self.ln = nnx.LayerNorm(8, param_dtype=jnp.float64, rngs=rngs)
    self.fc = nnx.Linear(8, 8, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    return x + self.fc(jax.nn.gelu(self.ln(x)))


class TiedGPT(nnx.Module):
  """GPT-2's tying as a user writes it: the logits are ``wte.attend``."""

  def __init__(self, rngs):
    self.wte = nnx.Embed(CONFIG.vocab, 8, param_dtype=jnp.float64,
                         rngs=rngs)
    self.blocks = nnx.List([_TiedBlock(rngs) for _ in range(4)])
    self.ln_f = nnx.LayerNorm(8, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, ids):
    x = self.wte(ids)
    for block in self.blocks:
      x = block(x)
    return self.wte.attend(self.ln_f(x))


def tied_head_loss(m, y, t):
  return llama.xent(m.wte.attend(m.ln_f(y)), t)


SCHEDULE_FREE = optax.chain(   # an update that needs value= (the loss)
    optax.contrib.schedule_free_sgd(0.5),
    optax.contrib.reduce_on_plateau(factor=0.5, patience=0,
                                    accumulation_size=1))


CLIPPED = optax.chain(optax.clip_by_global_norm(0.05), OPTIMIZER)


def tied_optimizer(options):
  """The one-device optimizer of a case's trainer options."""
  if options.get('max_grad_norm'):
    assert options['max_grad_norm'] == 0.05
    return CLIPPED
  return SCHEDULE_FREE if options.get('schedule_free') else OPTIMIZER


@functools.cache
def tied_reference(optimizer):
  """The tied model as written on one device, optax with value=loss: per
  step (loss, params, opt_state)."""
  with jax.enable_x64(True):
    graphdef, params, rest = nnx.split(TiedGPT(nnx.Rngs(0)), nnx.Param, ...)

    @jax.jit   # one program: eager optax would compile op by op
    def step(params, opt_state, ids, targets):
      loss, grads = jax.value_and_grad(lambda p: llama.xent(
          nnx.merge(graphdef, p, rest)(ids), targets))(params)
      updates, opt_state = optax.with_extra_args_support(optimizer).update(
          grads, opt_state, params, value=loss)
      return optax.apply_updates(params, updates), opt_state, loss

    opt_state, out = optimizer.init(params), []
    for batch in batches(num=3, size=8, seq=4):
      params, opt_state, loss = step(params, opt_state, *batch)
      out.append((loss, params, opt_state))
    return out


TIED = {   # mesh, schedule, trainer options, from_nnx options
    'interleaved-clip-zero3': (
        dict(data=2, stage=2),
        lambda: jaxpar.pipeline.interleaved_one_f_one_b(2, 2, 2),
        dict(max_grad_norm=0.05, zero_stage=3), {}),
    'zero_bubble_v-clip-zero3': (
        dict(data=2, stage=2), lambda: jaxpar.pipeline.zero_bubble_v(2, 2),
        dict(max_grad_norm=0.05, zero_stage=3), {}),
    '1f1b-3d-rules-zero1-schedule_free': (
        dict(data=2, stage=2, tensor=2),
        lambda: jaxpar.pipeline.one_f_one_b(2, 2),
        dict(zero_stage=1, schedule_free=True),
        dict(tensor_rules={'wte/embedding': ('tensor', None),
                           'fc/kernel': (None, 'tensor')})),
}


@functools.cache
def tied_run(case):
  """(model, pm, trainer, [(state, stats) after each step]) of a case."""
  mesh_sizes, make_schedule, options, split = TIED[case]
  with jax.enable_x64(True):
    model, schedule = TiedGPT(nnx.Rngs(0)), make_schedule()
    pm = jaxpar.parallel.from_nnx(
        model, blocks='blocks', num_stages=schedule.num_stages,
        embed=lambda m, ids: m.wte(ids), head_loss=tied_head_loss, **split)
    trainer = jaxpar.parallel.model_trainer(
        pm, SCHEDULE_FREE if options.get('schedule_free') else OPTIMIZER,
        schedule=schedule, mesh=mesh(**mesh_sizes),
        **{k: v for k, v in options.items() if k != 'schedule_free'})
    state, out = trainer.init(pm.params), []
    for batch in batches(num=3, size=8, seq=4):
      state, stats = trainer.step(state, batch)
      out.append((state, stats))
    return model, pm, trainer, out


@pytest.mark.parametrize('case', list(TIED))
def test_tied_embeddings_match_the_tied_model_float64(x64, case):
  """GPT-2's tied wte (head_loss reads m.wte.attend) is one param: the
  README recipe trains it as the one-device model as written (the global
  norm counts it once: clipping is exact)."""
  model, pm, trainer, out = tied_run(case)
  assert list(pm.params.embed) == ['wte'] and list(pm.params.head) == ['ln_f']
  want = tied_reference(tied_optimizer(TIED[case][2]))
  for (_, stats), (ref_loss, _, _) in zip(out, want):
    np.testing.assert_allclose(stats.loss, ref_loss, rtol=1e-10)
  pm.update(model, jax.device_get(trainer.params(out[-1][0])))
  tree_allclose(params_of(model), nnx.to_pure_dict(want[-1][1]), rtol=1e-10,
                atol=1e-12)


def test_optax_extra_args_and_schedule_free_eval_params_in_3d(x64):
  """reduce_on_plateau gets value=loss in the 3D step; Trainer.opt_state is
  laid out like Trainer.params, so schedule_free_eval_params takes both as
  written; all as optax on one device (the tied model, 3D with rules)."""
  _, pm, trainer, out = tied_run('1f1b-3d-rules-zero1-schedule_free')
  _, params, opt_state = tied_reference(SCHEDULE_FREE)[-1]
  state = out[-1][0]
  assert float(state.opt_state[1].scale) == float(opt_state[1].scale) < 1
  got = optax.contrib.schedule_free_eval_params(
      trainer.opt_state(state)[0], trainer.params(state))
  tree_allclose(
      nnx.to_pure_dict(pm.to_state(jax.device_get(got))),
      nnx.to_pure_dict(optax.contrib.schedule_free_eval_params(
          opt_state[0], params)), rtol=1e-10, atol=1e-12)


def test_live_state_handed_to_a_schedule_placing_stages_differently(
    x64, tmp_path):
  """Interleaved (p=2, v=2: ranks hold stages (0, 2), (1, 3)) -> ZB-V
  (p=2: (0, 3), (1, 2)), same [p, v, ...] shapes: the state says its
  placement and the ZB-V trainer re-lays it; the run is the one-device one."""
  first = tied_run('interleaved-clip-zero3')[3][0][0]
  _, pm, zbv, _ = tied_run('zero_bubble_v-clip-zero3')
  assert first.params.placement == ((0, 2), (1, 3))
  state, stats = zbv.step(first, batches(size=8, seq=4)[1])
  assert state.params.placement == ((0, 3), (1, 2))
  want = tied_reference(tied_optimizer(TIED['zero_bubble_v-clip-zero3'][2]))
  np.testing.assert_allclose(stats.loss, want[1][0], rtol=1e-10)
  tree_allclose(
      nnx.to_pure_dict(pm.to_state(jax.device_get(zbv.params(state)))),
      nnx.to_pure_dict(want[1][1]), rtol=1e-10, atol=1e-12)
  with pytest.raises(ValueError, match=r"rank order \(\(0, 2\), \(1, 3\)\) "
                     r"of schedule 'Interleaved 1F1B \(v=2\)', not in that of "
                     r"schedule='ZB-V'"):
    jaxpar.checkpoint.save(tmp_path, first, step=1,
                           schedule=jaxpar.pipeline.zero_bubble_v(2, 2))
  one_f_one_b = tied_run('1f1b-3d-rules-zero1-schedule_free')[3][0][0]
  with pytest.raises(ValueError, match=r"schedule '1F1B' \(2 ranks, 2 "
                     r"stages\).*checkpoint.restore"):
    zbv.step(one_f_one_b, batches(size=8, seq=4)[1])



# ------------------------------------------------------ BatchNorm statistics


class _NormBlock(nnx.Module):

  def __init__(self, rngs, axis_name=None):
    self.fc = nnx.Linear(8, 8, param_dtype=jnp.float64, rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.8, param_dtype=jnp.float64,
                            axis_name=axis_name, rngs=rngs)
    # Flax keeps running statistics in float32; float64 for the 1e-10 check.
    self.bn.mean = nnx.BatchStat(jnp.zeros(8, jnp.float64))
    self.bn.var = nnx.BatchStat(jnp.ones(8, jnp.float64))

  def __call__(self, x):
    return x + jax.nn.relu(self.bn(self.fc(x)))


class NormNet(nnx.Module):
  """An MLP with BatchNorm in its blocks, as a user writes it."""

  def __init__(self, rngs, axis_name=None):
    self.inp = nnx.Linear(4, 8, param_dtype=jnp.float64, rngs=rngs)
    self.blocks = nnx.List([_NormBlock(rngs, axis_name) for _ in range(4)])
    self.out = nnx.Linear(8, 2, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    for block in self.blocks:
      x = block(x)
    return self.out(x)


def mse(y, t):
  return jnp.mean((y - t) ** 2)


def norm_batches():
  rng = np.random.default_rng(1)
  return [(rng.normal(size=(16, 4)), rng.normal(size=(16, 2)))
          for _ in range(2)]


@functools.cache
def norm_reference(data, microbatches):
  """The model as written on one device, run on each data shard's
  microbatches in turn (statistics per microbatch, running statistics
  updated once per microbatch, in order), gradients averaged; with data > 1
  the running statistics averaged over the shards. Per step (loss, params,
  statistics)."""
  with jax.enable_x64(True):
    graphdef, params, stats, rest = nnx.split(
        NormNet(nnx.Rngs(0)), nnx.Param, nnx.BatchStat, ...)

    @jax.jit
    def microbatch(params, stats, x, t):
      def loss(p):
        m = nnx.merge(graphdef, p, stats, rest, copy=True)
        return mse(m(x), t), nnx.state(m, nnx.BatchStat)
      (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
      return value, grads, stats

    opt_state, out = OPTIMIZER.init(params), []
    for x, t in norm_batches():
      runs = []
      for xs, ts in zip(np.split(x, data), np.split(t, data)):
        shard = stats
        for xm, tm in zip(np.split(xs, microbatches),
                          np.split(ts, microbatches)):
          value, grads, shard = microbatch(params, shard, xm, tm)
          runs.append((value, grads))
        runs[-1] += (shard,)
      mean = lambda *a: sum(a) / len(a)
      grads = jax.tree.map(mean, *[g for _, g, *_ in runs])
      stats = jax.tree.map(mean, *[r[2] for r in runs if len(r) == 3])
      updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      out.append((np.mean([v for v, *_ in runs]), nnx.to_pure_dict(params),
                  nnx.to_pure_dict(stats)))
    return out


NORM = {   # mesh, schedule, from_nnx options
    '2x2x2-1f1b-uneven-rules': (          # identity slots, 3D, data > 1
        dict(data=2, stage=2, tensor=2),
        lambda: jaxpar.pipeline.one_f_one_b(2, 2),
        dict(counts=(3, 1), tensor_rules={'fc/kernel': (None, 'tensor')})),
}


@pytest.mark.parametrize('case', list(NORM))
def test_batch_norm_statistics_float64(x64, case):
  """nnx.BatchNorm in the blocks: each stage normalises every microbatch
  by its own statistics and updates the running ones once per microbatch,
  in order, as the model run on the microbatches in turn; with data > 1 the
  running statistics are averaged over 'data'. They come back to the
  model (pm.update with state.model_state)."""
  mesh_sizes, make_schedule, split = NORM[case]
  model, schedule = NormNet(nnx.Rngs(0)), make_schedule()
  pm = jaxpar.parallel.from_nnx(
      model, blocks='blocks', num_stages=schedule.num_stages,
      embed=lambda m, x: m.inp(x),
      head_loss=lambda m, y, t: mse(m.out(y), t), **split)
  assert pm.model_state.stages['bn']['mean'].shape == (
      pm.stage_mask.shape + (8,))
  assert (pm.model_state.embed, pm.model_state.head) == (None, None)
  trainer = jaxpar.parallel.model_trainer(pm, OPTIMIZER, schedule=schedule,
                                          mesh=mesh(**mesh_sizes))
  with pytest.raises(ValueError, match=r'pm.params, pm.model_state'):
    trainer.init(pm.params)
  state = trainer.init(pm.params, pm.model_state)
  want = norm_reference(mesh_sizes['data'], schedule.num_microbatches)
  for batch, (ref_loss, _, _) in zip(norm_batches(), want):
    state, stats = trainer.step(state, batch)
    np.testing.assert_allclose(stats.loss, ref_loss, rtol=1e-10)
  pm.update(model, jax.device_get(trainer.params(state)),
            jax.device_get(state.model_state))
  tree_allclose(params_of(model), want[-1][1], rtol=1e-10, atol=1e-12)
  tree_allclose(
      nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)), want[-1][2],
      rtol=1e-10, atol=1e-12)


def test_synced_batch_norm_normalises_the_global_microbatch(x64):
  """``nnx.BatchNorm(axis_name='data')`` in the blocks (SyncBatchNorm): on
  data=4 x stage=2 each stage normalises microbatch ``i`` of every data
  shard together, so the step is the model as written on one device (no
  sync) run on the global microbatches in turn: loss, params and running
  statistics."""
  model = NormNet(nnx.Rngs(0), axis_name='data')
  schedule = jaxpar.pipeline.one_f_one_b(2, 2)
  pm = jaxpar.parallel.from_nnx(
      model, blocks='blocks', num_stages=2, embed=lambda m, x: m.inp(x),
      head_loss=lambda m, y, t: mse(m.out(y), t))
  trainer = jaxpar.parallel.model_trainer(pm, OPTIMIZER, schedule=schedule,
                                          mesh=mesh(data=4, stage=2))
  (x, t), _ = norm_batches()
  state, stats = trainer.step(trainer.init(pm.params, pm.model_state), (x, t))
  pm.update(model, jax.device_get(trainer.params(state)),
            jax.device_get(state.model_state))

  one = NormNet(nnx.Rngs(0))                     # one device: nothing to sync
  optimizer = nnx.Optimizer(one, OPTIMIZER, wrt=nnx.Param)
  rows = np.arange(16).reshape(4, 2, 2)          # [data, microbatch, row]
  global_microbatches = [rows[:, i].ravel() for i in range(2)]
  loss = lambda m: sum(mse(m(x[i]), t[i]) for i in global_microbatches) / 2
  want, grads = nnx.value_and_grad(loss)(one)
  optimizer.update(one, grads)
  np.testing.assert_allclose(stats.loss, want, rtol=1e-10)
  of = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.Any(nnx.Param,
                                                       nnx.BatchStat)))
  tree_allclose(of(model), of(one), rtol=1e-10, atol=1e-12)
