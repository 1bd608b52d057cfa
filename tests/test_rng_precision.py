"""Pipeline randomness (dropout keys), has_aux and bfloat16 compute.

Dropout is tested against the sequential model run with the same key per
(stage, microbatch): the gradients then agree only if every block of a
microbatch (F, I, W, a remat recompute) used the forward's mask.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpar import hlo
from jaxpar import pipeline as sch
from jaxpar.pipeline import pipeline_value_and_grad
from jaxpar.train_state import cast_params
from jaxpar.pipeline.executor._stage_vjp import StageVJP
from test_executor import MB, loss_fn, mesh_for, model, stage_fn
from test_lower import CONSTRUCTORS as SCHEDULES

RATE = 0.5


def drop(x, key):
  keep = jax.random.bernoulli(key, 1 - RATE, x.shape)
  return jnp.where(keep, x / (1 - RATE), 0)


def dropout_stage(params, x, key):
  """``stage_fn`` with dropout on its residual branch."""
  return x + drop(stage_fn(params, x) - x, key)


def dropout_loss(loss_params, y, target, key):
  """A loss with its own dropout, and an aux metric."""
  y = drop(y, key)
  return loss_fn(loss_params, y, target), {'y2': jnp.mean(y ** 2)}


def sequential(stages, loss_params, inputs, targets, key, m):
  """The reference: microbatch i, stage k with fold_in(fold_in(key, i), k)."""
  num_stages = jax.tree.leaves(stages)[0].shape[0]

  def one(i, x, t):
    k = jax.random.fold_in(key, i)
    for s in range(num_stages):
      x = dropout_stage(jax.tree.map(lambda a, s=s: a[s], stages), x,
                        jax.random.fold_in(k, s))
    return dropout_loss(loss_params, x, t, jax.random.fold_in(k, num_stages))
  split = lambda a: a.reshape((m, -1) + a.shape[1:])
  loss, aux = jax.vmap(one)(jnp.arange(m), split(inputs), split(targets))
  return jnp.mean(loss), jax.tree.map(jnp.mean, aux)


reference = jax.jit(jax.value_and_grad(sequential, argnums=(0, 1, 2),
                                       has_aux=True), static_argnums=5)


@pytest.mark.parametrize('name,p,m,remat', [
    ('1f1b', 2, 3, False), ('zero_bubble_v', 2, 3, False), ('interleaved', 2, 4, True)])
def test_dropout_is_the_sequential_models_with_the_same_keys(
    x64, name, p, m, remat):
  """I/W split (ZB-V), remat, interleaved: one mask per microbatch."""
  schedule = SCHEDULES[name](p, m)
  args = model(schedule.num_stages, m * MB)
  key = jax.random.key(3)
  step = pipeline_value_and_grad(dropout_stage, dropout_loss, schedule=schedule,
                       mesh=mesh_for(p), has_aux=True,
                       remat_policy='nothing' if remat else None,
                       bubble_fill=float('nan'))
  (loss, aux), grads = step(*args, key=key)
  (want, want_aux), want_grads = reference(*args, key, m)
  np.testing.assert_allclose(loss, want, rtol=1e-10)
  np.testing.assert_allclose(aux['y2'], want_aux['y2'], rtol=1e-10)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-10,
                               atol=1e-10 * float(np.max(np.abs(w))))
  # Dropout is not a no-op: another key gives another loss.
  (other, _), _ = step(*args, key=jax.random.key(4))
  assert abs(float(other) - float(loss)) > 1e-3 * abs(float(loss))


def test_aux_is_averaged_like_the_loss(x64):
  """has_aux without a key: the microbatch mean of aux, exactly."""
  schedule = sch.zero_bubble_h1(2, 4)
  args = model(2, 4 * MB)

  def loss_and_aux(lp, y, t):
    return loss_fn(lp, y, t), {'y2': jnp.mean(y ** 2), 'max': jnp.max(y)}
  (loss, aux), grads = pipeline_value_and_grad(
      stage_fn, loss_and_aux, schedule=schedule, mesh=mesh_for(2),
      has_aux=True)(*args)

  def want(stages, lp, x, t):
    def one(x, t):
      for s in range(2):
        x = stage_fn(jax.tree.map(lambda a, s=s: a[s], stages), x)
      return loss_and_aux(lp, x, t)
    split = lambda a: a.reshape((4, -1) + a.shape[1:])
    return jax.tree.map(jnp.mean, jax.vmap(one)(split(x), split(t)))
  want_loss, want_aux = jax.jit(want)(*args)   # one compile, not op by op
  np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
  for name in ('y2', 'max'):
    np.testing.assert_allclose(aux[name], want_aux[name], rtol=1e-12)


def test_bf16_stash_holds_activations_not_cast_params():
  """The cast sits inside the stage: the stash is bf16 activations only."""
  width, mb = 8, 3     # a [8, 8] weight and [3, 8] activations differ
  stage = StageVJP(cast_params(stage_fn, jnp.bfloat16),
                   remat_policy='everything')  # every residual jax.vjp lists
  params = {'w': jnp.ones((width, width)), 'b': jnp.ones(width),
            'gate': {'s': jnp.ones(())}}
  _, stash = stage.trace(params, jnp.ones((mb, width), jnp.bfloat16))
  assert stash and all(a.dtype == jnp.bfloat16 and a.shape == (mb, width)
                       for a in stash), stash
  # The contrast: the VJP's residuals do hold the cast weight (dx needs it);
  # StageVJP recomputes it from the f32 params instead of stashing it.
  residuals = jax.eval_shape(lambda p, x: stage._closure(p, x, None)[1],
                             params, jnp.ones((mb, width), jnp.bfloat16))
  assert any(a.shape == (width, width) and a.dtype == jnp.bfloat16
             for a in residuals)


def test_bf16_messages_and_stashes_are_half_the_bytes():
  """The messages jaxpar emits are bf16 (half the bytes; XLA:CPU itself
  widens bf16 collectives to f32, GPUs send them as they are), the compiled
  scratch (stashes, mailbox) shrinks; loss and gradients come back in
  float32, close to the float32 step's."""
  p, m = 2, 4
  schedule = sch.one_f_one_b(p, m)
  args = model(p, m * 512, np.float32)
  steps = {dtype: pipeline_value_and_grad(stage_fn, loss_fn, schedule=schedule,
                                mesh=mesh_for(p), compute_dtype=dtype)
           for dtype in (None, jnp.bfloat16)}
  lowered = {d: s.lower(*args) for d, s in steps.items()}
  permute = {d: hlo.collective_bytes(low.as_text(dialect='hlo'))[
      'collective-permute'] for d, low in lowered.items()}
  assert 2 * permute[jnp.bfloat16] == permute[None] > 0
  temp = {d: low.compile().memory_analysis().temp_size_in_bytes
          for d, low in lowered.items()}
  # Measured 0.82 here (the f32 gradient accumulators and XLA:CPU's f32
  # copies around collectives stay, among them the all-reduce of the p
  # pending rows of grads.inputs: mb = 512 rows of width 8 make those rows
  # weigh more than the stashes); activations in f32 would give ~1.
  assert temp[jnp.bfloat16] < 0.85 * temp[None]
  (l32, g32), (l16, g16) = jax.device_get(
      [steps[d](*args) for d in (None, jnp.bfloat16)])
  assert l16.dtype == g16.inputs.dtype == jnp.float32
  np.testing.assert_allclose(l16, l32, rtol=1e-2)
  diff = optax.tree.norm(jax.tree.map(jnp.subtract, g16, g32))
  assert float(diff) < 3e-2 * float(optax.tree.norm(g32))


def test_errors():
  schedule = sch.one_f_one_b(2, 2)
  mesh = mesh_for(2)
  args = model(2, 2 * MB, np.float32)
  with pytest.raises(TypeError, match="compute_dtype='int8'.*floating"):
    pipeline_value_and_grad(stage_fn, loss_fn, schedule=schedule, mesh=mesh,
                  compute_dtype='int8')
  step = pipeline_value_and_grad(stage_fn, loss_fn, schedule=schedule, mesh=mesh)
  with pytest.raises(TypeError, match='key must be one PRNG key'):
    step(*args, key=np.zeros(3, np.uint32))
  with pytest.raises(TypeError, match='pass has_aux=True'):
    pipeline_value_and_grad(stage_fn, lambda *a: (loss_fn(*a), {}), schedule=schedule,
                  mesh=mesh)(*args)
  with pytest.raises(TypeError, match=r"aux\['n'\] has dtype int32"):
    pipeline_value_and_grad(stage_fn, lambda *a: (loss_fn(*a), {'n': jnp.int32(1)}),
                  schedule=schedule, mesh=mesh, has_aux=True)(*args)
