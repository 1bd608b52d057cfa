"""ZeRO-1/3 in the 3D train step: exact, ~1/N state per device, checkpointable."""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.data_parallel import internal as dp_internal
from jaxpar.models import gpt
from helpers import (FLOAT64_OPTIMIZER, assert_round_trip, dense_of,
                     dense_params, float64_reference, gpt_batches,
                     gpt_reference, tree_allclose)


def make_trainer(mesh_sizes, schedule, optimizer, *, zero_stage,
                 max_grad_norm=None):
  n = int(np.prod(list(mesh_sizes.values())))
  mesh = jaxpar.make_mesh(**mesh_sizes, devices=jax.devices()[:n])
  _, split = gpt.split_for_pipeline(dense_params(jnp.float32),
                                     num_stages=schedule.num_stages)
  return jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optimizer,
      schedule=schedule, mesh=mesh, stage_mask=split.mask,
      tensor_rules=gpt.TENSOR_RULES, max_grad_norm=max_grad_norm,
      zero_stage=zero_stage), split


def opt_state_bytes(state):
  """Bytes of the optimizer state on one device."""
  return sum(x.addressable_shards[0].data.nbytes
             for x in jax.tree.leaves(state.opt_state))


def param_bytes(state):
  """Bytes of the params on one device."""
  return sum(x.addressable_shards[0].data.nbytes
             for x in jax.tree.leaves(state.params))


# ZeRO-3 in float64 against the one-device run of test_parallel.py (the
# stage's layers in gpt.stage_fn's lax.scan: gathered one per iteration)
# (helpers.float64_reference: 3 steps of sgd+momentum clipped at 0.5, linear
# in the gradient, see helpers.FLOAT64_OPTIMIZER on adam). Each case saves a checkpoint after 2 steps and checks the
# restored state's next step against the reference's third; ``onto``: the
# checkpoint is saved in model order (schedule=) and also restored onto
# another mesh, schedule and zero_stage=0 (data 4 -> 1, tensor 1 -> 4,
# interleaved's stages [[0, 2], [1, 3]] -> ZB-V's [[0, 3], [1, 2]]).
CASES = {
    '4x2x1-interleaved-zero3': (dict(data=4, stage=2, tensor=1),
                                lambda: jaxpar.pipeline.interleaved_one_f_one_b(2, 2, 2),
                                (dict(data=1, stage=2, tensor=4),
                                 lambda: jaxpar.pipeline.zero_bubble_v(2, 4))),
    '2x2x2-zero_bubble_v-zero3': (dict(data=2, stage=2, tensor=2),
                        lambda: jaxpar.pipeline.zero_bubble_v(2, 2), None),
}


@pytest.mark.parametrize('case', list(CASES))
def test_matches_single_device_float64(x64, case, tmp_path):
  """Same losses, norms, params as one-device optax; checkpoint round trip
  (bit for bit, then the same next step), onto another mesh and schedule too."""
  mesh_sizes, make_schedule, onto = CASES[case]
  schedule = make_schedule()
  params, data = dense_params(jnp.float64), gpt_batches(3)
  want = float64_reference()
  trainer, split = make_trainer(mesh_sizes, schedule, FLOAT64_OPTIMIZER,
                                 zero_stage=3, max_grad_norm=0.5)
  assert float(want[0][1]) > 0.5   # clipping is exercised
  pp, _ = gpt.split_for_pipeline(params, num_stages=schedule.num_stages)
  state = trainer.init(pp)
  for batch, (ref_loss, ref_norm, ref_p) in zip(data[:2], want):
    state, stats = trainer.step(state, batch)
    assert not bool(stats.skipped)
    np.testing.assert_allclose(stats.loss, ref_loss, rtol=1e-10)
    np.testing.assert_allclose(stats.grad_norm, ref_norm, rtol=1e-10)
    tree_allclose(dense_of(trainer, state, split), ref_p, rtol=1e-9,
                  atol=1e-11)
  kernel = state.params.stages['mlp']['fc_in']['kernel']
  assert 'data' in str(kernel.sharding.spec)
  # Momentum traces are non-zero now; a restored state is bit-identical and
  # its next step equals the reference's third step.
  saved_schedule = schedule if onto else None
  restored = assert_round_trip(tmp_path, state, trainer.init(pp),
                               schedule=saved_schedule)
  _, stats = trainer.step(restored, data[2])
  np.testing.assert_allclose(stats.loss, want[2][0], rtol=1e-10)
  if onto:
    other_sizes, make_other = onto
    other = make_other()
    plain, _ = make_trainer(other_sizes, other, FLOAT64_OPTIMIZER,
                            zero_stage=0, max_grad_norm=0.5)
    moved = jaxpar.checkpoint.restore(tmp_path, plain.init(pp),
                                      schedule=other)
    _, stats = plain.step(moved, data[2])
    np.testing.assert_allclose(stats.loss, want[2][0], rtol=1e-10)


def test_checkpoint_with_schedule_moves_the_params_not_the_moments(tmp_path):
  """schedule= saves the stage params in model order; the optimizer state is
  per layer (LayerParams), the same for every schedule, saved as it is."""
  optimizer = optax.sgd(0.1, momentum=0.9)
  sizes = dict(data=2, stage=2, tensor=1)
  inter_schedule = jaxpar.pipeline.interleaved_one_f_one_b(2, 2, 2)  # [[0, 2], [1, 3]]
  v_schedule = jaxpar.pipeline.zero_bubble_v(2, 2)                      # [[0, 3], [1, 2]]
  inter, _ = make_trainer(sizes, inter_schedule, optimizer, zero_stage=1)
  v_shape, _ = make_trainer(sizes, v_schedule, optimizer, zero_stage=1)
  pp, _ = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=4)
  state = inter.init(pp)
  # Distinct values everywhere, so a wrong permutation shows (made on the
  # host: no device program per leaf).
  distinct = lambda tree: jax.tree.map(lambda x: jax.device_put(
      np.asarray(x) + np.arange(x.size, dtype=x.dtype).reshape(x.shape),
      x.sharding), tree)
  state = state._replace(params=distinct(state.params),
                         opt_state=distinct(state.opt_state))
  jaxpar.checkpoint.save(tmp_path, state, schedule=inter_schedule)
  got = jaxpar.checkpoint.restore(tmp_path, v_shape.init(pp),
                                  schedule=v_schedule)
  trace = state.opt_state[0].trace
  assert isinstance(trace, jaxpar.parallel.LayerParams)
  assert len(trace.layers) == 4
  chex.assert_trees_all_equal(got.opt_state, state.opt_state)
  chex.assert_trees_all_equal(v_shape.params(got), inter.params(state))


def test_state_is_split_over_data():
  """Per device: ZeRO-1 adam state ~1/N of zero_stage=0's, ZeRO-3 params too
  (data=4 is test_zero3_memory_and_collectives')."""
  sizes = dict(data=2, stage=2, tensor=2)
  schedule = jaxpar.pipeline.one_f_one_b(2, 2)
  pp, _ = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=2)
  n = sizes['data']
  states = {}
  for zero_stage in (0, 1, 3):
    trainer, _ = make_trainer(sizes, schedule, optax.adam(0.1),
                              zero_stage=zero_stage)
    states[zero_stage] = trainer, trainer.init(pp)
  plain = states[0][1]
  for zero_stage in (1, 3):
    trainer, state = states[zero_stage]
    ratio = opt_state_bytes(state) / opt_state_bytes(plain)
    # Leaves with no dim divisible by N (and adam's count) stay whole.
    assert 1 / n <= ratio < 1.1 / n, ratio
    chex.assert_trees_all_equal(trainer.params(state), states[0][0].params(
        plain))
    mu = state.opt_state[0].mu.layers[0]['mlp']['fc_in']['kernel']
    assert 'data' in str(mu.sharding.spec)
  ratio = param_bytes(states[3][1]) / param_bytes(plain)
  assert 1 / n <= ratio < 1.1 / n, ratio
  assert param_bytes(states[1][1]) == param_bytes(plain)
  # Trainer.params (model order, for evaluation) keeps ZeRO-3's shards.
  trainer, state = states[3]
  params = trainer.params(state)
  kernel = params.stages['mlp']['fc_in']['kernel']
  assert 'data' in str(kernel.sharding.spec)
  assert sum(x.addressable_shards[0].data.nbytes
             for x in jax.tree.leaves(params)) == param_bytes(state)


@pytest.mark.parametrize('zero_stage', [0, 1])
def test_masked_states_are_split_like_the_params(zero_stage):
  """optax.masked / multi_transform states (MaskedNode placeholders) are
  split over stage and tensor, and data with ZeRO, like plain ones: per
  device ~1/(s t) (ZeRO-1: 1/(d s t)) of the dense model's state, which
  is their global size (the optimizer sees the dense per-layer leaves)."""
  sizes = dict(data=2, stage=2, tensor=2)
  params = dense_params(jnp.float32)
  pp, _ = gpt.split_for_pipeline(params, num_stages=2)
  attn = lambda tree: jax.tree_util.tree_map_with_path(
      lambda path, _: 'attn' if 'attn' in jax.tree_util.keystr(path)
      else 'rest', tree)
  split = 8 if zero_stage else 4
  for optimizer in (
      optax.multi_transform({'attn': optax.adam(0.1),
                             'rest': optax.sgd(0.1, momentum=0.9)}, attn),
      optax.masked(optax.adam(0.1), lambda tree: jax.tree.map(
          lambda x: x.ndim >= 2, tree))):
    trainer, _ = make_trainer(sizes, jaxpar.pipeline.one_f_one_b(2, 2),
                              optimizer, zero_stage=zero_stage)
    state = trainer.init(pp)
    dense = sum(x.nbytes for x in jax.tree.leaves(optimizer.init(params)))
    assert sum(x.nbytes for x in jax.tree.leaves(state.opt_state)) == dense
    ratio = opt_state_bytes(state) / dense
    assert 1 / split <= ratio < 1.1 / split, ratio


def collective_bytes(text, kind):
  """Output bytes of each ``kind`` collective in compiled HLO text (a loop
  body's once)."""
  return [4 * math.prod(int(d) for d in dims.split(',') if d)
          for dims in re.findall(r'= f32\[([\d,]*)\]\S* ' + kind + r'\(',
                                 text)]


@pytest.mark.xla_defaults   # reads memory_analysis()
def test_zero3_gathers_per_layer_and_takes_no_more_memory():
  """Compiled, data=4 x stage=2, 1F1B: ZeRO-3's arguments are 1/N of the
  params; it gathers a stage's params one layer at a time inside the
  stage's scan (the forward, the backward's I and W each gather again) and
  reduce-scatters each layer's gradients in the backward's loop; its temp
  is at most ZeRO-1's.

  The ZeRO-3 step is given the ZeRO-1 state: a state of another zero stage
  is placed (ZeRO storage keeps the shapes), so its arguments are ZeRO-3's.
  """
  sizes, schedule = dict(data=4, stage=2, tensor=1), \
      jaxpar.pipeline.one_f_one_b(2, 2)
  pp, _ = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=2)
  batch = gpt_batches(1)[0]
  out = {}
  for zero_stage in (1, 3):
    trainer, _ = make_trainer(sizes, schedule, optax.sgd(0.1),
                              zero_stage=zero_stage)
    state = trainer.init(pp)
    given = out[1][0] if zero_stage == 3 else state
    compiled = trainer.step.lower(given, batch).compile()
    out[zero_stage] = (state, compiled.memory_analysis(), compiled.as_text())
  (state1, mem1, _), (state3, mem3, text3) = out[1], out[3]
  p1, p3 = param_bytes(state1), param_bytes(state3)
  # sgd has no state: the arguments are the params (and the batch).
  assert mem1.argument_size_in_bytes - mem3.argument_size_in_bytes == p1 - p3
  assert p3 < 0.3 * p1
  assert mem3.temp_size_in_bytes <= mem1.temp_size_in_bytes
  # The largest stage leaf, fc_in's kernel [p, v, slots, d, 4d]: one slot
  # of it is the largest gather (embed and head are smaller, whole), its
  # 1/N the largest scatter; the stage is never gathered whole.
  kernel = state1.params.stages['mlp']['fc_in']['kernel']
  layer = 4 * math.prod(kernel.shape[3:])
  assert kernel.shape[2] == 2 and max(collective_bytes(
      text3, 'all-gather')) == layer
  assert max(collective_bytes(text3, 'reduce-scatter')) == layer // 4


def unrolled_stage_fn(params, x, *, key=None):
  """``gpt.stage_fn`` as a Python loop over the slots (``params[j]``)."""
  del key
  for j in range(jax.tree.leaves(params)[0].shape[0]):
    x = jaxpar.tensor_parallel.transformer_block(
        jax.tree.map(lambda a: a[j], params), x, causal=True)
  return x


def test_zero3_unrolled_stage_matches_single_device_float64(x64):
  """A stage whose layers are a Python loop over ``params[j]`` (the scanned
  ``gpt.stage_fn`` is CASES'): each layer gathered where the loop slices it
  out; the one-device numbers, with clipping."""
  mesh = jaxpar.make_mesh(data=4, stage=2)
  params = dense_params(jnp.float64)
  pp, split = gpt.split_for_pipeline(params, num_stages=2)
  trainer = jaxpar.parallel.trainer(
      gpt.embed_fn, unrolled_stage_fn, gpt.head_loss_fn, FLOAT64_OPTIMIZER,
      schedule=jaxpar.pipeline.gpipe(2, 2), mesh=mesh, stage_mask=split.mask,
      tensor_rules=gpt.TENSOR_RULES, max_grad_norm=0.5, zero_stage=3)
  state = trainer.init(pp)
  for batch, (loss, norm, want) in zip(gpt_batches(2), float64_reference()):
    state, stats = trainer.step(state, batch)
    np.testing.assert_allclose(stats.loss, loss, rtol=1e-10)
    np.testing.assert_allclose(stats.grad_norm, norm, rtol=1e-10)
  assert float(norm) > 0.5
  tree_allclose(dense_of(trainer, state, split), want, rtol=1e-9, atol=1e-11)


class TestErrors:

  @pytest.mark.parametrize('stage,error', [(2, ValueError), (-1, ValueError),
                                           (True, TypeError), ('1', TypeError),
                                           (None, TypeError)])
  def test_bad_zero_stage(self, stage, error):
    with pytest.raises(error, match=r'zero_stage'):
      make_trainer(dict(data=2, stage=2, tensor=2),
                   jaxpar.pipeline.one_f_one_b(2, 2), optax.sgd(0.1),
                   zero_stage=stage)

  def test_state_of_other_optimizer(self):
    sizes, schedule = dict(data=2, stage=2, tensor=1), \
        jaxpar.pipeline.one_f_one_b(2, 2)
    pp, _ = gpt.split_for_pipeline(dense_params(jnp.float32), num_stages=2)
    maker, _ = make_trainer(sizes, schedule, optax.sgd(0.1), zero_stage=1)
    user, _ = make_trainer(sizes, schedule, optax.adam(0.1), zero_stage=1)
    with pytest.raises(ValueError, match=r'optimizer.init\(state.params\)'):
      user.step(maker.init(pp), gpt_batches(1)[0])


def test_padded_leaves_on_data_3_match_the_dense_model(x64, tmp_path):
  """data=3 x stage=2 with GPT sizes no mesh size divides: ZeRO-1/3 pad
  (``zero.Padded``) instead of keeping leaves whole; the same numbers as
  the dense model (lamb: per-leaf trust ratios, so padding must not enter a
  norm), ~1/3 of zero_stage=0's state per device, logical shapes in
  ``trainer.params`` and in checkpoints (restored onto zero_stage=0)."""
  config = gpt.GPTConfig(vocab_size=7, seq_len=5, d_model=5, num_heads=1,
                         num_layers=2, mlp_ratio=1)
  params = jax.tree.map(lambda x: x.astype(jnp.float64),
                        gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  data = [(rng.integers(0, 7, (6, 5)), rng.integers(0, 7, (6, 5)))
          for _ in range(2)]
  optimizer = optax.lamb(0.1)
  want = gpt_reference(params, data, optimizer, 0.5, config)  # one device
  schedule = jaxpar.pipeline.one_f_one_b(2, 2)
  mesh = jaxpar.make_mesh(data=3, stage=2, devices=jax.devices()[:6])
  pp, split = gpt.split_for_pipeline(params, num_stages=2)
  trainers = {z: jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optimizer,
      schedule=schedule, mesh=mesh, stage_mask=split.mask,
      tensor_rules=gpt.TENSOR_RULES, zero_stage=z, max_grad_norm=0.5)
      for z in (0, 1, 3)}
  init = trainers[0].init(pp)
  plain = jaxpar.data_parallel.bytes_per_device(init)
  logical = dp_internal.logical_shapes(init)
  # One padding row per leaf: a leaf's bytes over its largest dim.
  rows = lambda tree: sum(x.dtype.itemsize * x.size // max(x.shape, default=1)
                          for x in jax.tree.leaves(tree))
  shapes = trainers[0].params(init)
  for zero_stage in (1, 3):
    trainer = trainers[zero_stage]
    state = trainer.init(pp)
    for batch, (loss, norm, _) in zip(data, want):
      state, stats = trainer.step(state, batch)
      np.testing.assert_allclose(stats.loss, loss, rtol=1e-10)
      np.testing.assert_allclose(stats.grad_norm, norm, rtol=1e-10)
    got = trainer.params(state)
    tree_allclose(dense_of(trainer, state, split), want[-1][2], rtol=1e-10,
                  atol=1e-12)
    chex.assert_trees_all_equal_shapes(got, shapes)
    held = jaxpar.data_parallel.bytes_per_device(state)
    assert held.opt_state <= ((1 / 3 + 0.1) * plain.opt_state
                              + rows(logical.opt_state)), (held, plain)
    stored = state.opt_state if zero_stage == 1 else state
    assert any(map(dp_internal.is_padded, jax.tree.leaves(
        stored, is_leaf=dp_internal.is_padded)))
  assert held.params <= (1 / 3 + 0.1) * plain.params + rows(logical.params)
  # The ZeRO-3 state's checkpoint holds logical shapes: it restores onto
  # zero_stage=0, and back onto ZeRO-3 bit for bit.
  jaxpar.checkpoint.save(tmp_path, state, schedule=schedule)
  restored = jaxpar.checkpoint.restore(tmp_path, init, schedule=schedule)
  tree_allclose(trainers[0].params(restored), got, rtol=0, atol=0)
  again = jaxpar.checkpoint.restore(tmp_path, state, schedule=schedule)
  chex.assert_trees_all_equal(again, state)
