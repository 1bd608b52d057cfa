"""Ordinary one-device JAX runs unchanged inside jaxpar's steps.

The losses and stages below use what a stack of layers or an RNN is written
with on one device -- ``lax.scan`` over stacked params, ``fori_loop``, an
RNN from ``jnp.zeros``, ``cond``/``switch`` with constant branches, a
``fori_loop`` accumulator, a forward-only ``while_loop``, flax
``nnx.vmap``/``nnx.scan`` -- and never ``pcast``. Inside ``shard_map`` the
constants are unvarying while the batch and params vary over ``data`` /
``stage``; ``jaxpar.vma`` makes that invisible. Every layout (DP at ZeRO 0
and 3, 1F1B, ZB-V, the 3D trainer) must give the single-device float64
loss and gradients to 1e-10.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxpar
from helpers import tree_allclose

B, T, D, L = 8, 3, 4, 2   # batch, time, width, layers per stage
LR = 0.1                  # sgd: the step is linear in the gradient


# -- the models, as written for one device -----------------------------------


def stage_fn(p, x, key=None):
  """``[b, T, D] -> [b, T, D]``; ``p``: ``{'w': [L, D, D], 'u': [D, D]}``."""
  def layer(h, wj):
    w, j = wj
    h = jnp.tanh(h @ w)
    if key is not None:   # dropout, one key per layer
      keep = jax.random.bernoulli(jax.random.fold_in(key, j), 0.8, h.shape)
      h = jnp.where(keep, h / 0.8, 0.0)
    return h, None

  # a stack of layers: lax.scan with the params as xs ...
  h, _ = lax.scan(layer, x, (p['w'], jnp.arange(L)))
  # ... and with fori_loop
  h = lax.fori_loop(0, L, lambda i, h: h + 0.5 * jnp.tanh(h @ p['w'][i]), h)
  # an RNN over time from a zero state
  s0 = jnp.zeros((h.shape[0], D), h.dtype)
  _, hs = lax.scan(lambda s, ht: (jnp.tanh(s @ p['u'] + ht),) * 2, s0,
                   jnp.swapaxes(h, 0, 1))
  h = jnp.swapaxes(hs, 0, 1)
  # cond and switch with constant branches
  h = lax.cond(jnp.sum(p['u']) > -1e6, lambda h: 2.0 * h,
               lambda h: jnp.zeros(h.shape, h.dtype), h)
  scale = lax.switch(jnp.argmax(p['u'][0]) % 2,
                     [lambda: jnp.full((), 1.5, h.dtype),
                      lambda: 1.0 + jnp.mean(p['u']) ** 2])
  # a fori_loop accumulator from zeros
  acc = lax.fori_loop(0, 3, lambda i, a: a + jnp.sin(h * (i + 1)),
                      jnp.zeros(h.shape, h.dtype))
  # a forward-only while_loop from a constant
  c, _ = lax.while_loop(
      lambda c: c[1] < 3,
      lambda c: (0.5 * c[0] + lax.stop_gradient(jnp.mean(p['u'])), c[1] + 1),
      (jnp.zeros((), h.dtype), 0))
  return scale * h + 0.1 * acc + c


def head_loss(lp, y, t, key=None):
  del key
  return jnp.mean((y @ lp - t) ** 2)


class Block(nnx.Module):

  def __init__(self, rngs):
    self.lin = nnx.Linear(D, D, param_dtype=jnp.float64, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.lin(x))


@functools.cache
def nnx_blocks(n):
  """``n`` blocks stacked with ``nnx.vmap``: (graphdef, params as a dict).
  Call under x64 (float64 params)."""
  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return Block(rngs)
  graphdef, state = nnx.split(make(nnx.Rngs(0)), nnx.Param)
  return graphdef, nnx.to_pure_dict(state)


def nnx_stage_fn(p, x, key=None):
  """``L`` blocks (``p``: their stacked params) applied by ``nnx.scan``."""
  del key  # no dropout
  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def forward(block, h):
    return block(h)
  return forward(nnx.merge(nnx_blocks(L)[0], p), x)


MODELS = {'lax': stage_fn, 'nnx': nnx_stage_fn}


def stage_params(model, num_stages, seed=0):
  """``[num_stages, ...]`` float64 stage params of ``model`` (under x64)."""
  if model == 'nnx':
    return jax.tree.map(lambda a: a.reshape((num_stages, L) + a.shape[1:]),
                        nnx_blocks(num_stages * L)[1])
  rng = np.random.default_rng(seed)
  return {'w': rng.normal(size=(num_stages, L, D, D)) / 2,
          'u': rng.normal(size=(num_stages, D, D)) / 2}


def data(seed=1):
  """(inputs ``[B, T, D]``, targets, loss params ``[D, D]``), float64."""
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(B, T, D)), rng.normal(size=(B, T, D)),
          rng.normal(size=(D, D)) / 2)


def model_loss(fn, stages, head, x, t, key=None):
  """The single-device model: the stages in order, then the loss. Stage
  ``k`` gets ``fold_in(key, k)`` (the pipeline's keys)."""
  def stage(h, pk):
    p, k = pk
    return (fn(p, h) if key is None else
            fn(p, h, jax.random.fold_in(key, k))), None
  num_stages = jax.tree.leaves(stages)[0].shape[0]
  y, _ = lax.scan(stage, x, (stages, jnp.arange(num_stages)))
  return head_loss(head, y, t)


def sgd(params, grads):
  """One sgd step, in NumPy (no compiles)."""
  return jax.tree.map(lambda p, g: np.asarray(p) - LR * np.asarray(g),
                      params, jax.device_get(grads))


# -- data parallel -------------------------------------------------------------


@functools.cache
def dp_loss(model):
  """The DP loss of ``model``: the whole model on a batch ``{'x', 't'}``."""
  return lambda p, b: model_loss(MODELS[model], p['stages'], p['head'],
                                 b['x'], b['t'])


@functools.cache
def dp_reference(model):
  """Its value and gradient on one device (compiled once per model)."""
  return jax.jit(jax.value_and_grad(dp_loss(model)))


@pytest.mark.parametrize('model', list(MODELS))
@pytest.mark.parametrize('zero_stage, num_microbatches', [(0, 1), (3, 2)])
def test_data_parallel(x64, model, zero_stage, num_microbatches):
  """A scanned stack of layers and an RNN as a DP loss: one sgd step."""
  x, t, head = data()
  params = {'stages': stage_params(model, 2), 'head': head}
  trainer = jaxpar.data_parallel.trainer(
      dp_loss(model), optax.sgd(LR),
      mesh=jaxpar.make_mesh(data=4, devices=jax.devices()[:4]),
      zero_stage=zero_stage, num_microbatches=num_microbatches)
  state, stats = trainer.step(trainer.init(params), {'x': x, 't': t})
  want, grads = dp_reference(model)(params, {'x': x, 't': t})
  np.testing.assert_allclose(stats.loss, want, rtol=1e-10)
  tree_allclose(trainer.params(state), sgd(params, grads), rtol=1e-10,
                atol=1e-12)


@jax.custom_vjp
def halved_grad(x):
  """The identity, whose backward halves the cotangent (a custom_vjp;
  linear, so data parallelism keeps it exact, unlike clipping)."""
  return x


halved_grad.defvjp(lambda x: (x, None), lambda _, g: (g / 2,))


def rnn_loss(params, batch):
  """An RNN from a zero state with custom rules: ``jax.nn.relu``
  (custom_jvp) and ``halved_grad`` (custom_vjp), under ``jax.checkpoint``."""
  @jax.checkpoint
  def cell(h, x):
    h = halved_grad(jax.nn.relu(h @ params['w'] + x))
    return h, None
  h0 = jnp.zeros((batch['x'].shape[0], D), batch['x'].dtype)
  h, _ = lax.scan(cell, h0, jnp.swapaxes(batch['x'], 0, 1))
  return jnp.mean((h - batch['t'][:, 0]) ** 2)


def test_custom_rules_in_data_parallel(x64):
  """custom_jvp, custom_vjp and remat keep their rules (ZeRO-3)."""
  x, t, w = data()
  params, batch = {'w': w}, {'x': x, 't': t}
  trainer = jaxpar.data_parallel.trainer(
      rnn_loss, optax.sgd(LR), zero_stage=3,
      mesh=jaxpar.make_mesh(data=2, devices=jax.devices()[:2]))
  state, stats = trainer.step(trainer.init(params), batch)
  want, grads = jax.jit(jax.value_and_grad(rnn_loss))(params, batch)
  np.testing.assert_allclose(stats.loss, want, rtol=1e-10)
  tree_allclose(trainer.params(state), sgd(params, grads), rtol=1e-10,
                atol=1e-12)


# -- pipeline ------------------------------------------------------------------


SCHEDULES = {'1f1b': lambda: jaxpar.pipeline.one_f_one_b(2, 4),
             'zero_bubble_v': lambda: jaxpar.pipeline.zero_bubble_v(2, 4)}


@pytest.mark.parametrize('model', list(MODELS))
@pytest.mark.parametrize('schedule', list(SCHEDULES))
def test_pipeline(x64, model, schedule):
  """The same stack as a pipeline stage, in 1F1B (with remat) and ZB-V,
  with a dropout key (the lax model's layers use it)."""
  fn, remat = MODELS[model], schedule == '1f1b'
  schedule = SCHEDULES[schedule]()
  m = schedule.num_microbatches
  stages = stage_params(model, schedule.num_stages)
  x, t, head = data()
  key = jax.random.key(7)
  step = jaxpar.pipeline.pipeline_value_and_grad(
      fn, head_loss, schedule=schedule,
      remat_policy='nothing' if remat else 'dots',
      mesh=jaxpar.make_mesh(stage=2, devices=jax.devices()[:2]))
  loss, _, grads, _ = step(stages, head, x, t, key=key)

  def reference(stages, head, x):   # microbatch i: fold_in(key, i)
    split = lambda a: a.reshape((m, -1) + a.shape[1:])
    return jnp.mean(lax.map(
        lambda a: model_loss(fn, stages, head, a[0], a[1],
                             jax.random.fold_in(key, a[2])),
        (split(x), split(t), jnp.arange(m))))

  want, (d_stages, d_head, dx) = jax.jit(jax.value_and_grad(
      reference, argnums=(0, 1, 2)))(stages, head, x)
  np.testing.assert_allclose(loss, want, rtol=1e-10)
  tree_allclose((grads.stages, grads.head, grads.inputs),
                (d_stages, d_head, dx), rtol=1e-10, atol=1e-12)


def test_pipeline_apply(x64):
  """The forward pass alone (pipeline_apply) of the nnx.scan stage."""
  stages, x = stage_params('nnx', 2), data()[0]
  y = jaxpar.pipeline.pipeline_apply(
      nnx_stage_fn, stages, x, schedule=jaxpar.pipeline.gpipe(2, 2),
      mesh=jaxpar.make_mesh(stage=2, devices=jax.devices()[:2]))
  want = jax.jit(lambda s, x: lax.scan(
      lambda h, p: (nnx_stage_fn(p, h), None), x, s)[0])(stages, x)
  tree_allclose(y, want, rtol=1e-10, atol=1e-12)


def test_pipeline_bfloat16():
  """compute_dtype=bfloat16 (1F1B): close to the float32 model, each
  stage's gradient to that stage's own (stages swapped would be off by
  more than the whole gradient)."""
  schedule = jaxpar.pipeline.one_f_one_b(2, 2)
  stages = jax.tree.map(lambda a: a.astype(np.float32),
                        stage_params('lax', schedule.num_stages))
  x, t, head = (a.astype(np.float32) for a in data())
  step = jaxpar.pipeline.pipeline_value_and_grad(
      stage_fn, head_loss, schedule=schedule, compute_dtype=jnp.bfloat16,
      mesh=jaxpar.make_mesh(stage=2, devices=jax.devices()[:2]))
  loss, _, grads, _ = step(stages, head, x, t)
  want, want_grads = jax.jit(jax.value_and_grad(
      lambda s, h, x: model_loss(stage_fn, s, h, x, t), argnums=(0, 1, 2)))(
          stages, head, x)
  got = jax.device_get((grads.stages, grads.head, grads.inputs))
  assert all(g.dtype == np.float32 for g in jax.tree.leaves(got))
  # bf16 keeps ~3 digits: measured 0.5% on the loss; on each stage's slice
  # of each leaf, the head and the input gradient at most 2.9% of its norm
  # and 2.5% of its largest entry on any entry (swapped stages: 130-180%).
  np.testing.assert_allclose(loss, want, rtol=2e-2)
  per_stage = lambda tree: [jax.tree.map(lambda a, k=k: a[k], tree)
                            for k in range(schedule.num_stages)]
  got = per_stage(got[0]), got[1:]   # stage k against stage k
  want = per_stage(want_grads[0]), tuple(want_grads[1:])
  tree_allclose(got, want, rtol=0, atol=5e-2, atol_scale='leaf')
  assert all(np.linalg.norm(g - w) <= 5e-2 * np.linalg.norm(w)
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


# -- 3D trainer ----------------------------------------------------------------


def embed_fn(e, inputs):
  """An RNN embedding from a zero state (per example, over time)."""
  s0 = jnp.zeros((inputs.shape[0], D), inputs.dtype)
  _, hs = lax.scan(lambda s, xt: (jnp.tanh(s @ e + xt),) * 2, s0,
                   jnp.swapaxes(inputs, 0, 1))
  return jnp.swapaxes(hs, 0, 1)


@pytest.mark.parametrize('model', list(MODELS))
def test_3d_trainer(x64, model):
  """embed / stage / loss functions of ordinary JAX in the 3D trainer
  (data=2, stage=2, ZeRO-3): one sgd step."""
  fn = MODELS[model]
  schedule = jaxpar.pipeline.one_f_one_b(2, 2)
  x, t, head = data()
  params = jaxpar.parallel.PipelineParams(
      np.eye(D) / 2, stage_params(model, schedule.num_stages), head)
  trainer = jaxpar.parallel.trainer(
      embed_fn, fn, head_loss, optax.sgd(LR), schedule=schedule,
      mesh=jaxpar.make_mesh(data=2, stage=2, devices=jax.devices()[:4]),
      zero_stage=3)
  state, stats = trainer.step(trainer.init(params), (x, t))
  loss = lambda p: model_loss(fn, p.stages, p.head, embed_fn(p.embed, x), t)
  want, grads = jax.jit(jax.value_and_grad(loss))(params)
  np.testing.assert_allclose(stats.loss, want, rtol=1e-10)
  tree_allclose(trainer.params(state), sgd(params, grads), rtol=1e-10,
                atol=1e-12)


# -- no error tells the user to cast ---------------------------------------------


def test_no_error_message_asks_for_pcast():
  """Issue 23, point 4: jaxpar never tells a user to write ``pcast``."""
  import ast
  import pathlib
  root = pathlib.Path(jaxpar.__file__).parent
  offenders = []
  for path in sorted(root.rglob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Raise) and node.exc is not None:
        text = ' '.join(c.value for c in ast.walk(node.exc)
                        if isinstance(c, ast.Constant)
                        and isinstance(c.value, str))
        if 'pcast' in text or 'pvary' in text:
          offenders.append(f'{path.relative_to(root)}:{node.lineno}')
  assert not offenders, offenders


def test_lift_outside_shard_map_is_the_function():
  fn = lambda p, x: {'y': p * x}
  lifted = jaxpar.vma.lift(jaxpar.vma.lift(fn, axes='data'), axes=('stage',))
  assert lifted(np.float32(2), np.ones(3, np.float32))['y'].tolist() == [2.0] * 3
  with pytest.raises(TypeError, match='callable'):
    jaxpar.vma.lift(3, axes='data')
