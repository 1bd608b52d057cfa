"""Pytree activations and inputs in the pipeline executor.

The activation passed between stages may be any pytree: here a dict that
carries, besides ``x``, a *side input* ``enc`` (as an encoder output rides
to every decoder stage: each stage reads it and passes it on unchanged) and
integer ``ids``. ``inputs`` is the same pytree with a leading batch axis,
split leaf by leaf into microbatches. Every run is exact (float64) against
``jax.value_and_grad`` of the plain sequential model on the whole batch:
the cotangents of the side input flow back through every stage, and the
integer leaf gets a ``float0`` zero, as ``jax.vjp`` gives it.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import pipeline as sch
from jaxpar.pipeline import pipeline_apply, pipeline_value_and_grad
from helpers import NAN, mesh_for, tree_allclose

D, E, MB = 6, 4, 2   # width of x, of the side input; microbatch size


def side_stage(params, act):
  """A residual tanh layer of ``x`` that reads the side input ``enc`` and
  the integer ``ids``; both pass on unchanged."""
  x, enc, ids = act['x'], act['enc'], act['ids']
  h = jnp.tanh(x @ params['w'] + enc @ params['c']
               + params['b'] * (ids % 3)[:, None])
  return {'x': x + h * params['s'], 'enc': enc, 'ids': ids}


def side_loss(head, act, target):
  y = act['x'] + act['enc'] @ head['e']
  return jnp.mean((y @ head['w'] - target) ** 2)


def side_model(num_stages, batch, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.normal(size=shape)
  stages = {'w': f(num_stages, D, D) / math.sqrt(D),
            'c': f(num_stages, E, D) / math.sqrt(E), 'b': f(num_stages, D),
            's': 1 + f(num_stages) / 4}
  head = {'e': f(E, D), 'w': f(D, 3)}
  inputs = {'x': f(batch, D), 'enc': f(batch, E),
            'ids': rng.integers(0, 10, batch).astype(np.int32)}
  return stages, head, inputs, f(batch, 3)


def side_reference(stages, head, inputs, targets, m):
  """``((loss, dstages, dhead, dinputs))`` of the sequential model: every
  stage in turn on each microbatch, the mean loss over microbatches."""
  def loss(stages, head, inputs):
    def one(act, t):
      for k in range(jax.tree.leaves(stages)[0].shape[0]):
        act = side_stage(jax.tree.map(lambda a, k=k: a[k], stages), act)
      return side_loss(head, act, t)
    split = lambda a: a.reshape((m, -1) + a.shape[1:])
    return jnp.mean(jax.vmap(one)(jax.tree.map(split, inputs),
                                  split(targets)))
  return jax.value_and_grad(loss, (0, 1, 2), allow_int=True)(
      stages, head, inputs)


@pytest.mark.parametrize('name,p,m', [
    ('1f1b', 2, 3), ('zero_bubble_v', 2, 3), ('1f1b', 1, 2)])
def test_side_input_activation_is_exact(x64, name, p, m):
  """The side input's cotangent sums over every stage that read it; the
  integer leaf's is a float0 zero, as ``jax.vjp`` gives it."""
  schedule = {'1f1b': sch.one_f_one_b, 'zero_bubble_v': sch.zero_bubble_v}[
      name](p, m)
  stages, head, inputs, targets = side_model(schedule.num_stages, m * MB)
  step = pipeline_value_and_grad(side_stage, side_loss, schedule=schedule,
                                 mesh=mesh_for(p), bubble_fill=NAN)
  out = step(stages, head, inputs, targets)
  loss, (dstages, dhead, dinputs) = side_reference(stages, head, inputs,
                                                   targets, m)
  assert out.grads.inputs['ids'].dtype == jax.dtypes.float0
  assert out.grads.inputs['ids'].shape == inputs['ids'].shape
  dinputs.pop('ids')
  got = out.grads.inputs.copy()
  got.pop('ids')
  tree_allclose((out.loss, out.grads.stages, out.grads.head, got),
                (loss, dstages, dhead, dinputs), rtol=1e-10,
                atol_scale='leaf')


def test_pytree_forward_and_errors(x64):
  """``pipeline_apply`` of a tuple activation; a leaf of another batch size
  and a stage that changes the structure are refused, named."""
  p, m = 2, 2
  schedule = sch.one_f_one_b(p, m)
  stages, head, inputs, targets = side_model(p, m * MB)
  as_tuple = lambda params, act: tuple(side_stage(
      params, dict(zip(('x', 'enc', 'ids'), act))).values())
  out = pipeline_apply(as_tuple, stages, tuple(inputs.values()),
                       schedule=schedule, mesh=mesh_for(p))
  want = inputs
  for k in range(p):
    want = side_stage(jax.tree.map(lambda a, k=k: a[k], stages), want)
  tree_allclose(out, tuple(want.values()), rtol=1e-12, atol_scale='leaf')
  step = pipeline_value_and_grad(side_stage, side_loss, schedule=schedule,
                                 mesh=mesh_for(p))
  with pytest.raises(ValueError, match=r"inputs\['x'\] has shape \(3, 6\) "
                     r"but inputs\['enc'\] has batch size 4"):
    step(stages, head, {**inputs, 'x': inputs['x'][:3]}, targets)
  drops = lambda params, act: {'x': side_stage(params, act)['x'],
                               'enc': act['enc']}
  with pytest.raises(ValueError, match=r"stage_fn maps a microbatch "
                     r"\{\['enc'\]: float64\[2, 4\], \['ids'\]: int32\[2\]"):
    pipeline_value_and_grad(drops, side_loss, schedule=schedule,
                            mesh=mesh_for(p))(stages, head, inputs, targets)
