"""StageVJP: the stash holds activations only; I + W is one backward, exactly.

Every stash policy, as the ``I``/``W`` blocks and through the executor
(ZB-H1, dropout keys), and ``w_recompute`` (V-Half), against ``jax.vjp`` /
``jax.value_and_grad``; the stash in the compute dtype and split over
``tensor``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import pipeline as pp
from jaxpar.pipeline import StageVJP, stash_policy
from jaxpar.pipeline.executor._microbatches import rows
from jaxpar.train_state import REMAT_POLICIES
from helpers import (dropout_loss, dropout_reference, dropout_stage, loss_fn,
                     model, reference, stage_fn, tree_allclose)

# Every named policy and one given as a jax.checkpoint policy.
ALL_POLICIES = [*REMAT_POLICIES, jax.checkpoint_policies.checkpoint_dots]

L, D, MB = 3, 16, 4


def stacked(w, x):
  """Layers sliced out of one stacked leaf, as a GPT stage does."""
  for k in range(w['a'].shape[0]):
    x = x + jnp.tanh(x @ w['a'][k]) @ w['b'][k].T
  return x


def per_layer(w, x):
  """The same model with one leaf per layer."""
  for k in range(L):
    x = x + jnp.tanh(x @ w[f'a{k}']) @ w[f'b{k}'].T
  return x


@jax.jit
def _cell(x, a, b):  # a jitted helper: the I/W cut must see inside it
  return x + jnp.tanh(x @ a) @ b.T


def jitted(w, x):
  for k in range(w['a'].shape[0]):
    x = _cell(x, w['a'][k], w['b'][k])
  return x


def scanned(w, x):
  """Layers in a lax.scan: one operation for the cut, still exact."""
  return jax.lax.scan(lambda x, ab: (_cell(x, *ab), None), x,
                      (w['a'], w['b']))[0]


def params(seed=0, dtype=np.float64):
  rng = np.random.default_rng(seed)
  return {'a': rng.normal(size=(L, D, 2 * D)).astype(dtype) / 4,
          'b': rng.normal(size=(L, D, 2 * D)).astype(dtype) / 4}


def split_blocks(fn, w, x, dy, policy='dots', w_recompute=False):
  """A traced StageVJP (its blocks jitted, as inside the executor)."""
  stage = StageVJP(fn, remat_policy=policy, w_recompute=w_recompute)
  traced = lambda method: lambda *args: [method(*args)][:0]  # avals: no output
  jax.eval_shape(traced(stage.trace), w, x)
  _, stash = jax.jit(stage.forward)(w, x)
  jax.eval_shape(traced(stage.split), w, stash, dy)
  return stage, stash


@pytest.mark.parametrize('fn,policy', [
    *((scanned, policy) for policy in ALL_POLICIES),   # every policy
    (stacked, 'dots'), (jitted, 'nothing')])            # every way of writing
def test_input_and_weight_halves_are_the_vjp(x64, fn, policy):
  w, rng = params(), np.random.default_rng(1)
  x, dy = rng.normal(size=(MB, D)), rng.normal(size=(MB, D))
  stage, stash = split_blocks(fn, w, x, dy, policy)
  dx, kept = jax.jit(stage.input_grad)(w, stash, dy)
  dw = jax.jit(stage.weight_grad)(w, stash, dy, kept)
  want_dw, want_dx = jax.vjp(fn, w, x)[1](dy)
  tree_allclose((dx, dw), (want_dx, want_dw), rtol=1e-12, atol=1e-12)


def test_stash_holds_activations_not_weights():
  w = params(dtype=np.float32)
  x = np.ones((MB, D), np.float32)
  stage, stash = split_blocks(stacked, w, x, x)
  assert stash and all(a.shape[0] == MB for a in stash)  # no [D, 2D] slices
  # and the kept cotangents are activation-sized too
  _, kept = jax.jit(stage.input_grad)(w, stash, x)
  assert kept and all(a.shape[0] == MB for a in kept)


@pytest.mark.parametrize('fn', [stacked, scanned])
def test_kept_holds_cotangents_not_what_w_recomputes_elementwise(fn):
  """Under 'dots' W recomputes ``tanh(x @ a)`` from the stashed product (a
  zero-bubble schedule holds ``kept`` per deferred W): ``kept`` is each
  layer's cotangent at ``x @ a`` and between the layers (the last layer's
  is ``dy``), plus, scanned, the layer inputs -- what 'everything' keeps."""
  w = params(dtype=np.float32)
  x = np.ones((MB, D), np.float32)
  stage, stash = split_blocks(fn, w, x, x, 'dots')
  kept = [a.shape for a in jax.eval_shape(stage.input_grad, w, stash, x)[1]]
  want = ([(L, MB, D), (L, MB, 2 * D)] if fn is scanned else
          [(MB, 2 * D), (MB, D)] * (L - 1) + [(MB, 2 * D)])
  assert sorted(kept) == sorted(want)


def _flops(fn, *args):
  return jax.jit(fn).lower(*args).compile().cost_analysis()['flops']


@pytest.mark.parametrize('fn', [stacked, jitted, scanned])
def test_zero_bubble_halves_do_one_backward_of_flops(fn):
  """XLA's FLOP count: I + W is one backward, no more; W is not ~0.

  Against the stage's own backward from its stash; a scanned stage of one
  layer (XLA counts a loop's body once, a batched one in full).
  """
  w = params(dtype=np.float32)
  if fn is scanned:
    w = jax.tree.map(lambda a: a[:1], w)
  x = np.ones((MB, D), np.float32)
  stage, stash = split_blocks(fn, w, x, x)
  _, kept = jax.jit(stage.input_grad)(w, stash, x)
  f_i = _flops(stage.input_grad, w, stash, x)
  f_w = _flops(stage.weight_grad, w, stash, x, kept)
  f_b = _flops(stage.backward, w, stash, x)
  assert f_i + f_w == pytest.approx(f_b, rel=0.01)
  assert f_w > 0.3 * f_b and f_i > 0.3 * f_b


def test_w_recompute_costs_w_the_input_gradient_chain():
  """XLA's FLOP count: ``I`` is unchanged; ``W`` redoes ``I``'s products
  but the stage input's cotangent (3 layers: ``W`` ~0.93 ``B``)."""
  w = params(dtype=np.float32)
  x = np.ones((MB, D), np.float32)
  stage, stash = split_blocks(stacked, w, x, x, w_recompute=True)
  f_i = _flops(stage.input_grad, w, stash, x)
  f_w = _flops(stage.weight_grad, w, stash, x, [])
  f_b = _flops(stage.backward, w, stash, x)
  assert f_b - f_i < f_w < f_b


def _temp_bytes(fn, stages):
  p, m = 2, 4
  step = pp.pipeline_value_and_grad(
      fn, lambda h, y, t: jnp.mean((y @ h - t) ** 2),
      schedule=pp.one_f_one_b(p, m),
      mesh=jaxpar.make_mesh(stage=p, devices=jax.devices()[:p]))
  args = (stages, np.ones((D, 2), np.float32),
          np.ones((m * MB, D), np.float32), np.ones((m * MB, 2), np.float32))
  return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.xla_defaults   # reads memory_analysis()
def test_sliced_layers_cost_no_more_memory_than_per_layer_leaves():
  w = params(dtype=np.float32)
  two = lambda a: np.stack([a, a])  # two pipeline stages
  sliced = _temp_bytes(stacked, jax.tree.map(two, w))
  leaves = _temp_bytes(per_layer, {
      f'{n}{k}': two(w[n][k]) for n in 'ab' for k in range(L)})
  assert sliced <= 1.15 * leaves, (sliced, leaves)


def _stash_arrays(policy):
  w = params(dtype=np.float32)
  _, stash = StageVJP(stacked, policy).trace(w, np.ones((MB, D),
                                                               np.float32))
  assert all(a.shape[0] == MB for a in stash)   # activations only
  return len(stash)


def test_policies_stash_what_they_say():
  """L layers ``x + tanh(x @ a) @ b.T``: 'everything' keeps each layer's
  input, tanh and 1 - tanh^2, 'dots' the stage input and the products
  (all but the last, which only feeds the output), 'nothing' the stage
  input alone."""
  assert _stash_arrays('everything') == 3 * L
  assert _stash_arrays('dots') == 1 + 2 * L - 1
  assert _stash_arrays('nothing') == 1
  assert _stash_arrays(None) == _stash_arrays('everything')


@pytest.mark.parametrize('policy', ALL_POLICIES)
def test_every_policy_is_exact_with_zero_bubble_and_dropout(x64, policy):
  """ZB-H1 (I and W apart, a B as I then W) with a dropout key per
  (stage, microbatch): the sequential model's loss and gradients."""
  p, m = 2, 3
  schedule = pp.zero_bubble_h1(p, m)
  args = model(p, m * MB)
  key = jax.random.key(3)
  step = pp.pipeline_value_and_grad(
      dropout_stage, dropout_loss, schedule=schedule, has_aux=True,
      mesh=jaxpar.make_mesh(stage=p, devices=jax.devices()[:p]),
      remat_policy=policy, bubble_fill=float('nan'))
  loss, _, grads, _ = step(*args, key=key)
  (want, _), want_grads = dropout_reference(*args, key, m)
  np.testing.assert_allclose(loss, want, rtol=1e-10)
  tree_allclose(grads[:3], want_grads, rtol=1e-10, atol_scale='leaf')


def test_w_recompute_is_exact_through_a_v_schedule(x64):
  """V-Half (I and W apart, two stages a rank) with ``w_recompute``: the
  sequential model's loss and gradients."""
  p, m = 2, 2
  schedule = pp.v_half(p, m)
  args = model(schedule.num_stages, m * MB)
  step = pp.pipeline_value_and_grad(
      stage_fn, loss_fn, schedule=schedule,
      mesh=jaxpar.make_mesh(stage=p, devices=jax.devices()[:p]),
      w_recompute=True, bubble_fill=float('nan'))
  loss, _, grads, _ = step(*args)
  want, want_grads = reference(*args, m)
  np.testing.assert_allclose(loss, want, rtol=1e-10)
  tree_allclose(grads[:3], want_grads, rtol=1e-10, atol_scale='leaf')


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(remat_policy='dot'), ValueError, r"remat_policy='dot' is not one"),
    (dict(remat_policy=3), TypeError, 'must be a name'),
    (dict(w_recompute='yes'), TypeError, 'w_recompute=.yes. must be True'),
])
def test_bad_policy_raises_when_the_step_is_built(kwargs, error, match):
  with pytest.raises(error, match=match):
    pp.pipeline_value_and_grad(stacked, lambda h, y, t: jnp.mean(y), schedule=pp.gpipe(
        2, 2), mesh=jaxpar.make_mesh(stage=2, devices=jax.devices()[:2]),
                     **kwargs)


def test_stash_policy_names_the_trainers_policies():
  """The pipeline's stash takes ``remat_policy`` as every trainer does;
  ``None`` means 'everything' there too."""
  for name, policy in REMAT_POLICIES.items():
    assert stash_policy(name) is policy
  assert stash_policy(None) is REMAT_POLICIES['everything'] is None


@pytest.mark.xla_defaults   # reads memory_analysis()
def test_policy_reaches_the_executor():
  """GPipe holds m stashes: its scratch shrinks with the stash;
  ``remat_policy=None`` compiles as ``'everything'``."""
  p, m, mb = 2, 4, 64
  w = jax.tree.map(lambda a: np.stack([a, a]), params(dtype=np.float32))
  args = (w, np.ones((D, 2), np.float32), np.ones((m * mb, D), np.float32),
          np.ones((m * mb, 2), np.float32))
  temp = {policy: pp.pipeline_value_and_grad(
      stacked, lambda h, y, t: jnp.mean((y @ h - t) ** 2),
      schedule=pp.gpipe(p, m), remat_policy=policy,
      mesh=jaxpar.make_mesh(stage=p, devices=jax.devices()[:p])).lower(
          *args).compile().memory_analysis().temp_size_in_bytes
          for policy in (None, 'everything', 'dots', 'nothing')}
  stash = lambda arrays: m * arrays * mb * D * 4
  # 9, 6 and 1 stashed arrays per microbatch (3 layers), each >= [mb, D].
  assert temp[None] == temp['everything'], temp
  assert temp['everything'] - temp['dots'] >= 0.9 * stash(9 - 6), temp
  assert temp['dots'] - temp['nothing'] >= 0.9 * stash(6 - 1), temp


def batch_norm_stage(w, x, key, state):
  """A BatchNorm-like stage: batch statistics normalise ``x``, the running
  mean is updated (and scales the output, so ``dw`` reads the state), a
  dropout mask comes from ``key``."""
  mean, var = jnp.mean(x, 0), jnp.var(x, 0)
  h = (x - mean) / jnp.sqrt(var + 1e-5) * w['g']
  h = jnp.tanh(h @ w['a'][0]) @ w['b'][0].T
  h = h * jax.random.bernoulli(key, 0.8, h.shape) * (1 + state['mean'] * w['g'])
  new = {'mean': 0.9 * state['mean'] + 0.1 * mean, 'count': state['count'] + 1}
  return x + h, new


@pytest.mark.parametrize('policy', ['dots', 'nothing'])
def test_state_is_carried_and_stashed_not_differentiated(x64, policy):
  """``stage_fn(params, x, key=k, state=s) -> (y, new_state)``: the forward
  returns the new state; the backward of a microbatch uses the state of
  its forward (a later state passed to the blocks is not read), as
  ``jax.vjp`` of the plain function at that state."""
  w, rng = params(), np.random.default_rng(2)
  w = {'a': w['a'][:1], 'b': w['b'][:1], 'g': rng.normal(size=D)}
  x, dy = rng.normal(size=(MB, D)), rng.normal(size=(MB, D))
  key = jax.random.key(5)
  state = {'mean': rng.normal(size=D), 'count': np.int32(3)}
  later = {'mean': rng.normal(size=D), 'count': np.int32(9)}
  stage = StageVJP(batch_norm_stage, remat_policy=policy)
  jax.eval_shape(lambda *a: [stage.trace(*a)][:0], w, x, key, state)
  y, stash, new = jax.jit(stage.forward)(w, x, key, state)
  jax.eval_shape(lambda *a: [stage.split(*a)][:0], w, stash, dy, key, later)
  dx, kept = jax.jit(stage.input_grad)(w, stash, dy, key, later)
  dw = jax.jit(stage.weight_grad)(w, stash, dy, kept, key, later)
  dw_b, dx_b = jax.jit(stage.backward)(w, stash, dy, key, later)
  (want_y, want_new), vjp = jax.vjp(
      lambda w, x: batch_norm_stage(w, x, key, state), w, x)
  want_dw, want_dx = vjp((dy, jax.tree.map(jnp.zeros_like, want_new)))
  tree_allclose((y, new, dx, dx_b, dw, dw_b),
                (want_y, want_new, want_dx, want_dx, want_dw, want_dw),
                rtol=1e-12, atol=1e-12)


def test_state_of_another_structure_is_refused():
  stage = StageVJP(lambda w, x, state: (x * w, {'other': state['mean']}))
  with pytest.raises(ValueError, match='same tree structure'):
    stage.trace(np.ones(3), np.ones(3), state={'mean': np.ones(3)})


def shared_b(w, x):
  """Layers scanned over ``a``, one ``b`` shared by all (its cotangent is
  summed in the backward's carry)."""
  return jax.lax.scan(lambda x, a: (_cell(x, a, w['b'][0]), None), x,
                      w['a'])[0]


def nested(w, x):
  """Two groups of layers, a scan over the groups of scans over layers."""
  group = lambda x, ab: (scanned({'a': ab[0], 'b': ab[1]}, x), None)
  split = lambda a: a.reshape((2, -1) + a.shape[1:])
  return jax.lax.scan(group, x, (split(w['a']), split(w['b'])))[0]


def _eqns(jaxpr) -> int:
  """Equations of ``jaxpr``, those of the jaxprs inside it counted too."""
  inner = lambda p: [p] if hasattr(p, 'eqns') else (
      [p.jaxpr] if hasattr(p, 'jaxpr') and hasattr(p.jaxpr, 'eqns') else [])
  return sum(1 + sum(_eqns(j) for p in eqn.params.values()
                     for j in inner(p)) for eqn in jaxpr.eqns)


@pytest.mark.parametrize('fn', [scanned, shared_b, nested])
def test_scanned_layers_are_cut_once_not_per_layer(x64, fn):
  """A stage scanning over its layers: the I and W blocks are scans of one
  layer's halves (as many equations for 4 layers as for 8), exact."""
  rng = np.random.default_rng(3)
  x, dy = rng.normal(size=(MB, D)), rng.normal(size=(MB, D))
  sizes = []
  for layers in (4, 8):
    w = {k: rng.normal(size=(layers, D, 2 * D)) / 4 for k in 'ab'}
    stage, stash = split_blocks(fn, w, x, dy)
    kept = jax.eval_shape(stage.input_grad, w, stash, dy)[1]
    sizes.append([_eqns(jax.make_jaxpr(block)(*args).jaxpr) for block, args in (
        (stage.input_grad, (w, stash, dy)),
        (stage.weight_grad, (w, stash, dy, kept)))])
  assert sizes[0] == sizes[1], sizes
  dx, kept = jax.jit(stage.input_grad)(w, stash, dy)
  dw = jax.jit(stage.weight_grad)(w, stash, dy, kept)
  want_dw, want_dx = jax.vjp(fn, w, x)[1](dy)
  tree_allclose((dx, dw), (want_dx, want_dw), rtol=1e-12, atol=1e-12)
  # per layer, stacked ([groups,] layers, ...): activations, no weights
  assert all(a.shape[-2] == MB and np.prod(a.shape[:-2]) == layers
             for a in kept), kept
  # The stash and kept as rows of slot buffers, as the tick scan hands them
  # (a scan reads one layer of a row per iteration): the same numbers.
  slot = lambda tree: rows(jax.tree.map(lambda a: jnp.stack([a * 0, a]),
                                        tree), 1)
  dx_rows, kept_rows = jax.jit(lambda w, s, dy: stage.input_grad(
      w, slot(s), dy))(w, stash, dy)
  dw_rows = jax.jit(lambda w, s, dy, k: stage.weight_grad(
      w, slot(s), dy, slot(k)))(w, stash, dy, kept)
  tree_allclose((dx_rows, kept_rows, dw_rows), (dx, kept, dw), rtol=0,
                atol=0)


@pytest.mark.parametrize('fn', [stacked, shared_b])
def test_w_recompute_keeps_nothing_and_is_exact(x64, fn):
  """``w_recompute``: ``I`` keeps nothing, ``W`` recomputes the cotangent
  chain from (params, stash, dy); the halves are still the VJP."""
  rng = np.random.default_rng(4)
  w = {k: rng.normal(size=(4, D, 2 * D)) / 4 for k in 'ab'}
  x, dy = rng.normal(size=(MB, D)), rng.normal(size=(MB, D))
  stage, stash = split_blocks(fn, w, x, dy, w_recompute=True)
  dx, kept = jax.jit(stage.input_grad)(w, stash, dy)
  dw = jax.jit(stage.weight_grad)(w, stash, dy, kept)
  want_dw, want_dx = jax.vjp(fn, w, x)[1](dy)
  assert kept == []
  tree_allclose((dx, dw), (want_dx, want_dw), rtol=1e-12, atol=1e-12)


def tensor_mlp(w, x):
  """Megatron's MLP over ``tensor`` (``a``'s and ``b``'s columns split):
  the stage input and each layer's sum over devices are replicated."""
  for k in range(w['a'].shape[0]):
    x = x + jax.lax.psum(jnp.tanh(x @ w['a'][k]) @ w['b'][k].T, 'tensor')
  return x


def scanned_tensor_mlp(w, x):
  return jax.lax.scan(lambda x, ab: (tensor_mlp(
      {'a': ab[0][None], 'b': ab[1][None]}, x), None), x, (w['a'], w['b']))[0]


@pytest.mark.parametrize('fn', [tensor_mlp, scanned_tensor_mlp])
def test_stash_is_split_over_tensor_and_exact(x64, fn):
  """On 2 devices of ``tensor``: the replicated stash leaves (the stage
  input, the layers' sums; not the partial products) are stored halved
  and gathered in the backward; I, W and the fused backward are exact."""
  w, rng = params(), np.random.default_rng(5)
  x, dy = rng.normal(size=(MB, D)), rng.normal(size=(MB, D))
  mesh = jaxpar.make_mesh(tensor=2, devices=jax.devices()[:2])
  split = P(None, None, 'tensor')
  shapes = []

  def body(w, x, dy):
    stage, stash = split_blocks(fn, w, x, dy)
    shapes.extend(a.shape for a in stash)
    dx, kept = stage.input_grad(w, stash, dy)
    return (dx, stage.weight_grad(w, stash, dy, kept),
            stage.backward(w, stash, dy), jax.vjp(fn, w, x)[1](dy))
  specs = {'a': split, 'b': split}   # dw is split as w is, dx replicated
  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P()),
                              out_specs=(P(), specs, (specs, P()),
                                         (specs, P()))))
  w = jax.device_put(w, jax.NamedSharding(mesh, split))
  dx, dw, (dw_b, dx_b), (want_dw, want_dx) = run(w, x, dy)
  tree_allclose((dx, dw, dx_b, dw_b), (want_dx, want_dw, want_dx, want_dw),
                rtol=1e-12, atol=1e-12)
  # 'dots': the input and L - 1 sums (the last feeds y alone) halved, the
  # L products x @ a whole (they differ per device)
  halved, whole = (MB, D // 2), (MB, D)
  if fn is scanned_tensor_mlp:
    halved, whole = (L,) + halved, (L,) + whole
    assert sorted(shapes) == sorted([(MB, D // 2), halved, whole]), shapes
  else:
    assert sorted(shapes) == sorted([halved] * L + [whole] * L), shapes


def test_stash_passed_between_programs_keeps_its_types(x64):
  """``x`` varying over ``tensor`` (of one device: nothing is split), the
  forward and the blocks in two ``shard_map``s: the stash's sums, replicated
  over ``tensor``, come back typed varying (``P('tensor')``); the blocks
  take them, and are exact."""
  w, rng = params(), np.random.default_rng(7)
  x, dy = rng.normal(size=(MB, D)), rng.normal(size=(MB, D))
  mesh = jaxpar.make_mesh(tensor=1, devices=jax.devices()[:1])
  t, specs = P('tensor'), {'a': P(None, None, 'tensor'),
                           'b': P(None, None, 'tensor')}
  w = jax.device_put(w, jax.NamedSharding(mesh, specs['a']))
  vary = lambda x: jax.lax.pcast(x, 'tensor', to='varying')
  on = lambda fn, ins, outs: jax.jit(jax.shard_map(
      fn, mesh=mesh, in_specs=ins, out_specs=outs))

  def traced(w, x):
    stage = StageVJP(tensor_mlp)
    stage.trace(w, vary(x))
    return stage
  _, stash = on(lambda w, x: traced(w, x).forward(w, vary(x)),
                (specs, P()), (t, t))(w, x)

  def blocks(w, x, stash, dy):
    stage, dy = traced(w, x), vary(dy)
    stage.split(w, stash, dy)
    dx, kept = stage.input_grad(w, stash, dy)
    return dx, stage.weight_grad(w, stash, dy, kept), jax.vjp(
        tensor_mlp, w, vary(x))[1](dy)
  dx, dw, (want_dw, want_dx) = on(blocks, (specs, P(), t, P()),
                                  (t, specs, (specs, t)))(w, x, stash, dy)
  tree_allclose((dx, dw), (want_dx, want_dw), rtol=1e-12, atol=1e-12)


def widening(w, x):
  """A product summed in float32 from bfloat16 operands (attention logits)."""
  logits = jnp.dot(x, w['a'][0], preferred_element_type=jnp.float32)
  return x + jax.nn.softmax(logits).astype(x.dtype) @ w['b'][0].T


def test_bf16_stash_holds_no_widened_product():
  """'dots' recomputes a product wider than its operands from them: the
  stash is bf16 (x and nothing else), the halves still the VJP."""
  w = params(dtype=jnp.bfloat16)
  rng = np.random.default_rng(6)
  x, dy = (jnp.asarray(rng.normal(size=(MB, D)), jnp.bfloat16)
           for _ in range(2))
  stage, stash = split_blocks(widening, w, x, dy)
  assert [(a.shape, a.dtype) for a in stash] == [((MB, D), jnp.bfloat16)]
  dx, kept = jax.jit(stage.input_grad)(w, stash, dy)
  dw = jax.jit(stage.weight_grad)(w, stash, dy, kept)
  want_dw, want_dx = jax.vjp(widening, w, x)[1](dy)
  tree_allclose((dx, dw), (want_dx, want_dw), rtol=1e-2, atol=1e-2)


def test_trainer_checks_w_recompute_when_built():
  with pytest.raises(TypeError, match='w_recompute=.yes. must be True'):
    jaxpar.parallel.trainer(
        lambda e, ids: ids, stacked, lambda h, y, t: jnp.mean(y),
        optax.sgd(0.1), schedule=pp.one_f_one_b(2, 2),
        mesh=jaxpar.make_mesh(stage=2, devices=jax.devices()[:2]),
        w_recompute='yes')
