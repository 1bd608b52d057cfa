"""The options of ``data_parallel.trainer`` and ``parallel.trainer`` mean the same.

``remat_policy`` is compiled in both trainers: ``None`` gives the very
program of ``'everything'``, and each named policy recomputes the same part
of the forward in both (more FLOPs from ``'everything'`` to ``'dots'`` to
``'nothing'``), which lowers the peak memory where a forward's residuals
wait for other work (the pipeline's stash, two ranks). The user functions
get the key by keyword in both, checked before anything is traced.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar

D, ROWS, LAYERS = 64, 512, 4
POLICIES = ('everything', 'dots', 'nothing')


def layer(w, x):
  return x + jnp.tanh(x @ w['a']) @ w['b']


def embed_fn(params, x):
  return x @ params['w']


def stage_fn(params, x):
  for i in range(LAYERS):
    x = layer(jax.tree.map(lambda a: a[i], params), x)
  return x


def loss_fn(params, y, targets):
  return jnp.mean((y @ params['w'] - targets) ** 2)


def dp_loss(params, batch):
  """The same model as one loss function of ``PipelineParams``."""
  x, targets = batch
  y = stage_fn(jax.tree.map(lambda a: a[0], params.stages),
               embed_fn(params.embed, x))
  return loss_fn(params.head, y, targets)


def model_params(num_stages):
  rng = np.random.default_rng(0)
  w = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(D),
                                 jnp.float32)
  stage = {'a': w(LAYERS, D, D), 'b': w(LAYERS, D, D)}
  return jaxpar.parallel.PipelineParams(
      {'w': w(D, D)}, jax.tree.map(lambda a: jnp.stack([a] * num_stages),
                                   stage), {'w': w(D, D)})


BATCH = (np.ones((ROWS, D), np.float32), np.zeros((ROWS, D), np.float32))


def lowered_step(trainer, remat_policy):
  """The trainer's step at ``remat_policy``, lowered on 2 devices."""
  devices = jax.devices()[:2]
  if trainer == 'data_parallel':
    t = jaxpar.data_parallel.trainer(
        dp_loss, optax.sgd(0.1), mesh=jaxpar.make_mesh(data=2,
                                                       devices=devices),
        remat_policy=remat_policy)
    return t.step.lower(t.init(model_params(1)), BATCH)
  stages = {'parallel_stage1': 1, 'parallel_stage2': 2}[trainer]
  t = jaxpar.parallel.trainer(
      embed_fn, stage_fn, loss_fn, optax.sgd(0.1),
      schedule=jaxpar.pipeline.one_f_one_b(stages, 2),
      mesh=jaxpar.make_mesh(data=2 // stages, stage=stages, devices=devices),
      remat_policy=remat_policy)
  return t.step.lower(t.init(model_params(stages)), BATCH)


def temp_and_flops(lowered):
  """Peak temporary bytes and FLOPs of the compiled step."""
  compiled = lowered.compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return compiled.memory_analysis().temp_size_in_bytes, cost['flops']


@pytest.mark.xla_defaults   # reads memory_analysis()
@pytest.mark.parametrize('trainer', ['data_parallel', 'parallel_stage1',
                                     'parallel_stage2'])
def test_remat_policy_means_the_same_in_both_trainers(trainer):
  lowered = {p: lowered_step(trainer, p) for p in (None, *POLICIES)}
  # None is 'everything' (no remat) in every trainer: the same program.
  assert lowered[None].as_text() == lowered['everything'].as_text()
  measured = {p: temp_and_flops(lowered[p]) for p in POLICIES}
  temp = {p: m[0] for p, m in measured.items()}
  flops = {p: m[1] for p, m in measured.items()}
  # Each named policy keeps less of the forward, so the backward recomputes
  # more of it: the same order in both trainers.
  assert flops['everything'] < flops['dots'] < flops['nothing'], flops
  if trainer == 'parallel_stage2':
    # Two ranks: a microbatch's residuals wait in the stash while other
    # microbatches run, so keeping less of them lowers the peak.
    assert temp['nothing'] < temp['dots'] < temp['everything'], temp
  else:
    # One rank: each microbatch's backward follows its forward at once.
    assert temp['nothing'] <= temp['everything'], temp


def test_defaults_are_spelled_out():
  default = lambda fn: inspect.signature(fn).parameters['remat_policy'].default
  assert default(jaxpar.data_parallel.trainer) == 'everything'
  assert default(jaxpar.data_parallel.model_trainer) == 'everything'
  assert default(jaxpar.parallel.trainer) == 'dots'
  assert default(jaxpar.parallel.model_trainer) == 'dots'


def test_the_key_comes_by_keyword_in_both_trainers():
  """A function that takes the key under another name is refused when the
  trainer is built, with the signature it needs."""
  key = jax.random.key(0)
  with pytest.raises(TypeError, match=r'loss_fn\(params, batch, rng\) does '
                     r'not take key=.*def loss_fn\(params, batch, \*, key\)'):
    jaxpar.data_parallel.trainer(
        lambda params, batch, rng: dp_loss(params, batch), optax.sgd(0.1),
        mesh=jaxpar.make_mesh(data=8), key=key)
  with pytest.raises(TypeError, match=r'stage_fn\(params, x, rng\) does not '
                     r'take key=.*def stage_fn\(params, x, \*, key\)'):
    jaxpar.parallel.trainer(
        lambda params, x, *, key: embed_fn(params, x),
        lambda params, x, rng: stage_fn(params, x),
        lambda params, y, targets, **extras: loss_fn(params, y, targets),
        optax.sgd(0.1), schedule=jaxpar.pipeline.one_f_one_b(2, 2),
        mesh=jaxpar.make_mesh(data=4, stage=2), key=key)
  # Without a key nothing is passed, so nothing is asked of the signature.
  jaxpar.data_parallel.trainer(lambda params, batch: dp_loss(params, batch),
                               optax.sgd(0.1), mesh=jaxpar.make_mesh(data=8))
