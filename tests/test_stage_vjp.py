"""StageVJP: the stash holds activations only; I + W is one backward, exactly.

Every stash policy, as the ``I``/``W`` blocks and through the executor
(ZB-H1, dropout keys), against ``jax.vjp`` / ``jax.value_and_grad``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar import pipeline as pp
from jaxpar.pipeline import StageVJP, stash_policy
from jaxpar.train_state import POLICIES
from helpers import dropout_loss, dropout_reference, dropout_stage, model

# Every named policy and one given as a jax.checkpoint policy.
ALL_POLICIES = [*POLICIES, jax.checkpoint_policies.checkpoint_dots]

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


def split_blocks(fn, w, x, dy, policy=None):
  """A traced StageVJP (its blocks jitted, as inside the executor)."""
  stage = StageVJP(fn, remat_policy=policy)
  traced = lambda method: lambda *args: [method(*args)][:0]  # avals: no output
  jax.eval_shape(traced(stage.trace), w, x)
  _, stash = jax.jit(stage.forward)(w, x)
  jax.eval_shape(traced(stage.split), w, stash, dy)
  return stage, stash


@pytest.mark.parametrize('fn', [stacked, jitted, scanned])
@pytest.mark.parametrize('policy', ALL_POLICIES)
def test_input_and_weight_halves_are_the_vjp(x64, fn, policy):
  w, rng = params(), np.random.default_rng(1)
  x, dy = rng.normal(size=(MB, D)), rng.normal(size=(MB, D))
  stage, stash = split_blocks(fn, w, x, dy, policy)
  dx, kept = jax.jit(stage.input_grad)(w, stash, dy)
  dw = jax.jit(stage.weight_grad)(w, stash, dy, kept)
  want_dw, want_dx = jax.vjp(fn, w, x)[1](dy)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-12, atol=1e-12)
  for got, want in zip(jax.tree.leaves(dw), jax.tree.leaves(want_dw)):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_stash_holds_activations_not_weights():
  w = params(dtype=np.float32)
  x = np.ones((MB, D), np.float32)
  stage, stash = split_blocks(stacked, w, x, x)
  assert stash and all(a.shape[0] == MB for a in stash)  # no [D, 2D] slices
  # and the kept cotangents are activation-sized too
  _, kept = jax.jit(stage.input_grad)(w, stash, x)
  assert kept and all(a.shape[0] == MB for a in kept)


def _flops(fn, *args):
  return jax.jit(fn).lower(*args).compile().cost_analysis()['flops']


@pytest.mark.parametrize('fn', [stacked, jitted, scanned])
def test_zero_bubble_halves_do_one_backward_of_flops(fn):
  """XLA's FLOP count: I + W is one backward, no more; W is not ~0.

  Exact against the stage's own backward from its stash; a scanned stage
  against the Python-loop model (XLA counts a while loop's body once), whose
  elementwise residual maths differs slightly.
  """
  w = params(dtype=np.float32)
  x = np.ones((MB, D), np.float32)
  stage, stash = split_blocks(fn, w, x, x)
  _, kept = jax.jit(stage.input_grad)(w, stash, x)
  f_i = _flops(stage.input_grad, w, stash, x)
  f_w = _flops(stage.weight_grad, w, stash, x, kept)
  ref, ref_stash = (split_blocks(stacked, w, x, x) if fn is scanned
                    else (stage, stash))
  f_b = _flops(ref.backward, w, ref_stash, x)
  assert f_i + f_w == pytest.approx(f_b, rel=0.01 if fn is not scanned else 0.15)
  assert f_w > 0.3 * f_b and f_i > 0.3 * f_b


def _temp_bytes(fn, stages):
  p, m = 2, 4
  step = pp.pipeline_value_and_grad(
      fn, lambda h, y, t: jnp.mean((y @ h - t) ** 2),
      schedule=pp.one_f_one_b(p, m),
      mesh=jaxpar.make_mesh(stage=p, devices=jax.devices()[:p]))
  args = (stages, np.ones((D, 2), np.float32),
          np.ones((m * MB, D), np.float32), np.ones((m * MB, 2), np.float32))
  return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


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
  assert _stash_arrays(None) == _stash_arrays('dots')   # the default


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
  (loss, _), grads = step(*args, key=key)
  (want, _), want_grads = dropout_reference(*args, key, m)
  np.testing.assert_allclose(loss, want, rtol=1e-10)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-10,
                               atol=1e-10 * float(np.max(np.abs(w))))


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(remat_policy='dot'), ValueError, r"remat_policy='dot' is not one"),
    (dict(remat_policy=3), TypeError, 'must be a name'),
])
def test_bad_policy_raises_when_the_step_is_built(kwargs, error, match):
  with pytest.raises(error, match=match):
    pp.pipeline_value_and_grad(stacked, lambda h, y, t: jnp.mean(y), schedule=pp.gpipe(
        2, 2), mesh=jaxpar.make_mesh(stage=2, devices=jax.devices()[:2]),
                     **kwargs)


def test_stash_policy_names_the_trainers_policies():
  """The pipeline's stash takes ``remat_policy`` as every trainer does;
  ``None`` is its default, 'dots'."""
  for name, policy in POLICIES.items():
    assert stash_policy(name) is policy
  assert stash_policy(None) is POLICIES['dots']


def test_policy_reaches_the_executor():
  """GPipe holds m stashes: its scratch shrinks with the stash."""
  p, m, mb = 2, 4, 64
  w = jax.tree.map(lambda a: np.stack([a, a]), params(dtype=np.float32))
  args = (w, np.ones((D, 2), np.float32), np.ones((m * mb, D), np.float32),
          np.ones((m * mb, 2), np.float32))
  temp = {policy: pp.pipeline_value_and_grad(
      stacked, lambda h, y, t: jnp.mean((y @ h - t) ** 2),
      schedule=pp.gpipe(p, m), remat_policy=policy,
      mesh=jaxpar.make_mesh(stage=p, devices=jax.devices()[:p])).lower(
          *args).compile().memory_analysis().temp_size_in_bytes
          for policy in ('everything', 'dots', 'nothing')}
  stash = lambda arrays: m * arrays * mb * D * 4
  # 9, 6 and 1 stashed arrays per microbatch (3 layers), each >= [mb, D].
  assert temp['everything'] - temp['dots'] >= 0.9 * stash(9 - 6), temp
  assert temp['dots'] - temp['nothing'] >= 0.9 * stash(6 - 1), temp
