"""Zero-size stage leaves (``[S, 0]``, ``[S, d, 0]``): the executor and the
3D trainer at every ZeRO stage are exact, and the leaves keep their shapes.

The stages use their zero-size leaves (``jnp.sum(empty)``, ``x @ [d, 0] @
[0, d]``), so each has a gradient: zeros of its zero-size shape.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar
from jaxpar import pipeline as sch
from helpers import tree_allclose

D = 4


def loss_and_grads(out):
  """``(loss, grads)`` of a ``pipeline_value_and_grad`` step's result: a
  ``(loss, grads)`` tuple or a NamedTuple with ``.loss`` and ``.grads``."""
  if hasattr(out, 'loss'):
    return out.loss, out.grads
  return out[0], out[1]


def stage_fn(p, x, *, tensor=False):
  """A residual tanh layer (hidden units split over 'tensor' when
  ``tensor``) plus terms of its three zero-size leaves (all zero)."""
  out = jnp.tanh(x @ p['w1']) @ p['w2'] + (x @ p['thin']) @ p['back']
  if tensor:
    out = jax.lax.psum(out, 'tensor')
  return x + out + jnp.sum(p['empty'])


def loss_fn(head, y, targets):
  return jnp.mean((y @ head['out'] + jnp.sum(head['empty']) - targets) ** 2)


def embed_fn(embed, inputs):
  return inputs @ embed['proj']


def stage_params(rng, lead, dtype):
  """Stage leaves ``lead + [...]``, three of them of size zero."""
  f = lambda *shape: (rng.normal(size=lead + shape) / 2).astype(dtype)
  return {'w1': f(D, D), 'w2': f(D, D), 'thin': f(D, 0), 'back': f(0, D),
          'empty': f(0)}


def sequential(stages, num_stages, x, stage=stage_fn):
  for k in range(num_stages):
    x = stage(jax.tree.map(lambda a, k=k: a[k], stages), x)
  return x


def test_placement_round_trip_keeps_zero_size_shapes():
  """``stages_to_ranks`` / ``ranks_to_stages`` of ``[S, 0]`` and
  ``[S, 3, 0]`` leaves, identity and permuted placements."""
  for schedule in (sch.one_f_one_b(2, 2), sch.zero_bubble_v(2, 2)):
    s = schedule.num_stages
    tree = {'a': np.zeros((s, 0)), 'b': jnp.zeros((s, 3, 0)),
            'c': np.arange(s)}
    ranks = sch.stages_to_ranks(tree, schedule)
    v = s // schedule.num_ranks
    assert ranks['a'].shape == (2, v, 0) and ranks['b'].shape == (2, v, 3, 0)
    back = sch.ranks_to_stages(ranks, schedule)
    assert jax.tree.map(np.shape, back) == jax.tree.map(np.shape, tree)
    np.testing.assert_array_equal(back['c'], tree['c'])
    like = jaxpar.parallel.stages_like(tree, ranks, schedule)
    assert jax.tree.map(np.shape, jaxpar.parallel.stages_in_model_order(
        like, schedule)) == jax.tree.map(np.shape, tree)


# (schedule, mesh stage size): identity placement, interleaved, V on 4 ranks.
EXECUTOR = {
    '1f1b-2': lambda: sch.one_f_one_b(2, 2),
    'interleaved-2': lambda: sch.interleaved_one_f_one_b(2, 2, 2),
    'zero_bubble_v-4': lambda: sch.zero_bubble_v(4, 4),
}


@pytest.mark.parametrize('case', list(EXECUTOR))
def test_executor_matches_value_and_grad(x64, case):
  schedule = EXECUTOR[case]()
  s, p = schedule.num_stages, schedule.num_ranks
  rng = np.random.default_rng(0)
  stages = stage_params(rng, (s,), np.float64)
  head = {'out': rng.normal(size=(D, D)), 'empty': np.zeros((0,))}
  x, t = rng.normal(size=(8, D)), rng.normal(size=(8, D))
  step = sch.pipeline_value_and_grad(
      stage_fn, loss_fn, schedule=schedule, bubble_fill=float('nan'),
      mesh=jaxpar.make_mesh(stage=p, devices=jax.devices()[:p]))
  loss, grads = loss_and_grads(step(stages, head, x, t))

  def full(stages, head, x):
    return loss_fn(head, sequential(stages, s, x), t)
  want, (g_stages, g_head, g_x) = jax.value_and_grad(full, (0, 1, 2))(
      stages, head, x)
  np.testing.assert_allclose(loss, want, rtol=1e-10)
  tree_allclose((grads.stages, grads.head, grads.inputs),
                (g_stages, g_head, g_x), rtol=1e-10, atol=1e-12)
  assert grads.stages['thin'].shape == (s, D, 0)
  assert grads.stages['empty'].shape == (s, 0)


OPTIMIZER = optax.sgd(0.3, momentum=0.9)   # linear in the gradient

# (zero_stage, mesh sizes, schedule, layer slots per stage).
TRAINER = {
    'zero0-2x2x1-1f1b': (0, dict(data=2, stage=2, tensor=1),
                         lambda: sch.one_f_one_b(2, 2), 1),
    'zero1-2x2x2-interleaved-masked': (
        1, dict(data=2, stage=2, tensor=2),
        lambda: sch.interleaved_one_f_one_b(2, 2, 2), 2),
    'zero3-2x2x2-zero_bubble_v': (3, dict(data=2, stage=2, tensor=2),
                                  lambda: sch.zero_bubble_v(2, 2), 1),
    'zero3-2x2x1-1f1b': (3, dict(data=2, stage=2, tensor=1),
                         lambda: sch.one_f_one_b(2, 2), 1),
}


@pytest.mark.parametrize('case', list(TRAINER))
def test_trainer_matches_one_device_optax(x64, case):
  """One step: loss, gradient norm and params equal one-device optax; the
  zero-size leaves (one split over 'tensor') keep their shapes. With two
  layer slots per stage, the last slot of stage 0 is no layer (all-zero
  params, frozen by ``stage_mask``: an identity block)."""
  zero_stage, sizes, make_schedule, slots = TRAINER[case]
  schedule = make_schedule()
  s, tensor = schedule.num_stages, sizes['tensor'] > 1
  rng = np.random.default_rng(1)
  mask = np.ones((s, slots), bool)
  mask[0, slots - 1] = slots == 1
  stages = jax.tree.map(lambda a: np.where(
      mask.reshape(mask.shape + (1,) * (a.ndim - 2)), a, 0),
      stage_params(rng, (s, slots), np.float64))
  pp = jaxpar.parallel.PipelineParams(
      {'proj': rng.normal(size=(D, D))}, stages,
      {'out': rng.normal(size=(D, D)) / 2, 'empty': np.zeros((0,))})
  batch = (rng.normal(size=(8, D)), rng.normal(size=(8, D)))

  def slotted(p, x, *, tensor=tensor):
    for j in range(slots):
      x = stage_fn(jax.tree.map(lambda a, j=j: a[j], p), x, tensor=tensor)
    return x
  n = int(np.prod(list(sizes.values())))
  trainer = jaxpar.parallel.trainer(
      embed_fn, slotted, loss_fn, OPTIMIZER, schedule=schedule,
      mesh=jaxpar.make_mesh(**sizes, devices=jax.devices()[:n]),
      stage_mask=mask if slots > 1 else None, zero_stage=zero_stage,
      tensor_rules={'w1': (None, 'tensor'), 'w2': ('tensor', None),
                    'thin': (None, 'tensor'), 'back': ('tensor', None)}
      if tensor else None)
  state, stats = trainer.step(trainer.init(pp), batch)

  def full(pp):
    x = embed_fn(pp.embed, batch[0])
    y = sequential(pp.stages, s, x, functools.partial(slotted, tensor=False))
    return loss_fn(pp.head, y, batch[1])
  loss, grads = jax.value_and_grad(full)(pp)
  grads = grads._replace(stages=jax.tree.map(lambda g: np.where(
      mask.reshape(mask.shape + (1,) * (g.ndim - 2)), g, 0), grads.stages))
  updates, _ = OPTIMIZER.update(grads, OPTIMIZER.init(pp), pp)
  want = optax.apply_updates(pp, updates)
  assert not bool(stats.skipped)
  np.testing.assert_allclose(stats.loss, loss, rtol=1e-10)
  np.testing.assert_allclose(stats.grad_norm, optax.tree.norm(grads),
                             rtol=1e-10)
  got = trainer.params(state)
  assert got.stages['empty'].shape == (s, slots, 0)
  tree_allclose(got, want, rtol=1e-10, atol=1e-12)

