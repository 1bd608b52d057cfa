"""What several test files share: small models, their one-device references,
and the assertions that compare a parallel run with them.

Test files import it by name (``from helpers import ...``; pytest puts
``tests/`` on the path) and never import each other. Fixtures stay in
``tests/conftest.py`` (``x64``), where pytest finds them; the devices are
set up by the root ``conftest.py``. Not collected: under ``tests/`` only
``test_*.py`` files are test modules.

- the schedule constructors by short name (``SCHEDULES``);
- the executor's toy pipeline: residual tanh stages, a squared-error head,
  the sequential model as reference (``stage_fn``, ``loss_fn``, ``model``,
  ``reference``, ``assert_exact``), and its dropout form (``dropout_stage``,
  ``dropout_loss``, ``dropout_reference``);
- the data-parallel MLP and plain optax training on one device
  (``mlp_params``, ``mlp_loss``, ``make_batches``, ``reference_run``,
  ``assert_same_history``);
- the 3D trainer's GPT and its one-device run (``GPT_CONFIG``,
  ``dense_params``, ``gpt_batches``, ``dense_of``, ``gpt_reference``,
  ``FLOAT64_OPTIMIZER``, ``float64_reference``, ``random_gpt_params``);
- checkpoints: ``assert_round_trip``.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar import checkpoint
from jaxpar import pipeline as sch
from jaxpar.models import gpt

# -- schedules -----------------------------------------------------------------

# Every constructor as ``build(num_ranks, num_microbatches)``.
SCHEDULES = {
    'gpipe': sch.gpipe,
    '1f1b': sch.one_f_one_b,
    'interleaved': lambda p, m: sch.interleaved_one_f_one_b(p, m, 2),
    'zb_h1': sch.zero_bubble_h1,
    'zero_bubble_v': sch.zero_bubble_v,
    'v_half': sch.v_half,
    'v_min': sch.v_min,
}

# -- the executor's toy pipeline -----------------------------------------------

D, MB, OUT = 8, 2, 3  # width, microbatch size, target width
NAN = float('nan')    # bubble_fill: an unwritten slot read shows as NaN


def stage_fn(params, x):
  """A residual tanh layer; params is a nested pytree."""
  return x + jnp.tanh(x @ params['w'] + params['b']) * params['gate']['s']


def loss_fn(loss_params, y, target):
  return jnp.mean((y @ loss_params['head'] + loss_params['bias'] - target)**2)


def model(num_stages, batch, dtype=np.float64, seed=0):
  """``(stage_params, loss_params, inputs, targets)`` as numpy arrays."""
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.normal(size=shape).astype(dtype)
  stages = {'w': f(num_stages, D, D) / math.sqrt(D), 'b': f(num_stages, D),
            'gate': {'s': 1 + f(num_stages) / 4}}
  loss_params = {'head': f(D, OUT), 'bias': f(OUT)}
  return stages, loss_params, f(batch, D), f(batch, OUT)


def sequential_loss(stages, loss_params, inputs, targets, m):
  """The reference: every stage in turn, the loss, the mean over microbatches."""
  num_stages = jax.tree.leaves(stages)[0].shape[0]

  def one(x, t):
    for k in range(num_stages):
      x = stage_fn(jax.tree.map(lambda a, k=k: a[k], stages), x)
    return loss_fn(loss_params, x, t)
  split = lambda a: a.reshape((m, -1) + a.shape[1:])
  return jnp.mean(jax.vmap(one)(split(inputs), split(targets)))


# ``reference(stages, loss_params, inputs, targets, m)``: loss and gradients.
reference = jax.jit(jax.value_and_grad(sequential_loss, argnums=(0, 1, 2)),
                    static_argnums=4)


def assert_exact(got, want, rtol):
  """Loss and every gradient leaf agree to ``rtol`` of the leaf's magnitude."""
  loss, grads = got
  want_loss, want_grads = want
  np.testing.assert_allclose(loss, want_loss, rtol=rtol)
  got_leaves = jax.tree.leaves((grads.stages, grads.head, grads.inputs))
  want_leaves = jax.tree.leaves(want_grads)
  assert len(got_leaves) == len(want_leaves) == 6
  for g, w in zip(got_leaves, want_leaves):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(g, w, rtol=rtol,
                               atol=rtol * float(np.max(np.abs(w))))


def mesh_for(p):
  """A mesh of ``p`` devices on the ``stage`` axis."""
  return jaxpar.make_mesh(stage=p, devices=jax.devices()[:p])


DROPOUT_RATE = 0.5


def drop(x, key):
  keep = jax.random.bernoulli(key, 1 - DROPOUT_RATE, x.shape)
  return jnp.where(keep, x / (1 - DROPOUT_RATE), 0)


def dropout_stage(params, x, key):
  """``stage_fn`` with dropout on its residual branch."""
  return x + drop(stage_fn(params, x) - x, key)


def dropout_loss(loss_params, y, target, key):
  """A loss with its own dropout, and an aux metric."""
  y = drop(y, key)
  return loss_fn(loss_params, y, target), {'y2': jnp.mean(y ** 2)}


def dropout_sequential_loss(stages, loss_params, inputs, targets, key, m):
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


# ``dropout_reference(stages, loss_params, inputs, targets, key, m)``:
# ``((loss, aux), gradients)``.
dropout_reference = jax.jit(jax.value_and_grad(
    dropout_sequential_loss, argnums=(0, 1, 2), has_aux=True),
                            static_argnums=5)

# -- the data-parallel MLP -----------------------------------------------------

D_IN, D_HID, D_OUT = 5, 7, 3


def mlp_params(seed=0, dtype=jnp.float32):
  """NumPy arrays: placed on a mesh without compiling a slicing program."""
  rng = np.random.default_rng(seed)
  return {
      'hidden': {'w': rng.standard_normal((D_IN, D_HID)).astype(dtype),
                 'b': np.zeros(D_HID, dtype)},
      'out': {'w': rng.standard_normal((D_HID, D_OUT)).astype(dtype) / 3,
              'b': np.full(D_OUT, 0.1, dtype)},
  }


def mlp_loss(params, batch):
  h = jnp.tanh(batch['x'] @ params['hidden']['w'] + params['hidden']['b'])
  y = h @ params['out']['w'] + params['out']['b']
  return optax.losses.squared_error(y, batch['y']).mean()


def make_batches(num_steps, batch_size, seed=1, dtype=np.float32):
  """``num_steps`` batches ``{'x': [batch_size, D_IN], 'y': [.., D_OUT]}``."""
  rng = np.random.default_rng(seed)
  return [{'x': rng.normal(size=(batch_size, D_IN)).astype(dtype),
           'y': rng.normal(size=(batch_size, D_OUT)).astype(dtype)}
          for _ in range(num_steps)]


def reference_run(params, batches, optimizer, max_grad_norm=None, *,
                  loss_of=mlp_loss, with_step=False):
  """Plain single-device optax training: the ground truth. Its step is
  jitted (one compile, instead of one per operation and leaf shape).
  ``with_step``: ``loss_of(params, batch, step)``, ``step`` the number of
  updates so far. Returns ``[(loss, grad norm, params)]`` per step."""
  if max_grad_norm is not None:
    optimizer = optax.chain(optax.clip_by_global_norm(max_grad_norm), optimizer)

  @jax.jit
  def step(params, opt_state, batch, i):
    args = (i,) if with_step else ()
    loss, grads = jax.value_and_grad(loss_of)(params, batch, *args)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, loss,
            optax.tree.norm(grads))

  opt_state = jax.jit(optimizer.init)(params)
  history = []
  for i, batch in enumerate(batches):
    params, opt_state, loss, norm = step(params, opt_state, batch, i)
    history.append((loss, norm, params))
  return history


def assert_same_history(got, want, rtol):
  """Two ``[(loss, grad norm, params)]`` histories agree to ``rtol``."""
  for (loss, norm, params), (ref_loss, ref_norm, ref_params) in zip(got, want):
    np.testing.assert_allclose(loss, ref_loss, rtol=rtol)
    np.testing.assert_allclose(norm, ref_norm, rtol=rtol)
    chex.assert_trees_all_close(params, ref_params, rtol=rtol, atol=rtol)

# -- the 3D trainer's GPT ------------------------------------------------------

GPT_CONFIG = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16, num_heads=4,
                           num_layers=4)


def dense_params(dtype, config=GPT_CONFIG):
  """``gpt_params`` of ``GPT(config)`` (``nnx.Rngs(0)``) in ``dtype``."""
  return jax.tree.map(lambda x: x.astype(dtype),
                      gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0))))


def gpt_batches(num, size=8, seed=0):
  """``num`` batches ``(ids, targets)`` of ``GPT_CONFIG``'s sizes."""
  rng = np.random.default_rng(seed)
  return [(rng.integers(0, GPT_CONFIG.vocab_size, (size, GPT_CONFIG.seq_len)),
           rng.integers(0, GPT_CONFIG.vocab_size, (size, GPT_CONFIG.seq_len)))
          for _ in range(num)]


def dense_of(trainer, state, split):
  """The trained params as ``gpt_params``, on the host: one transfer, then
  numpy slices (no small device programs per leaf and layer)."""
  return gpt.merge_from_pipeline(jax.device_get(trainer.params(state)),
                                 split)


def gpt_reference(params, data, optimizer, max_grad_norm, config=GPT_CONFIG):
  """One device, the dense model: [(loss, grad norm, params)] per step."""
  optimizer = optax.chain(optax.clip_by_global_norm(max_grad_norm), optimizer)

  @jax.jit   # one program: eager optax would compile op by op
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(functools.partial(
        gpt.gpt_loss, config=config))(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            (loss, optax.tree.norm(grads)))

  opt_state, out = optimizer.init(params), []
  for batch in data:
    params, opt_state, (loss, norm) = step(params, opt_state, batch)
    out.append((loss, norm, params))
  return out


# Linear in the gradient: adam would blow the rounding noise of the
# key-bias gradient (exactly zero in exact arithmetic) up to full steps.
FLOAT64_OPTIMIZER = optax.sgd(0.3, momentum=0.9)


@functools.cache
def float64_reference():
  """One device, float64, 3 steps clipped at 0.5 (call under the x64
  fixture): computed once for test_parallel's and test_parallel_zero's
  cases in a process."""
  return gpt_reference(dense_params(jnp.float64), gpt_batches(3),
                       FLOAT64_OPTIMIZER, 0.5)


def random_gpt_params(config: gpt.GPTConfig, dtype=np.float32) -> dict:
  """Random params of ``gpt_params``' structure (``eval_shape``: building
  the model eagerly compiles dozens of tiny programs)."""
  shapes = gpt.gpt_params(nnx.eval_shape(lambda: gpt.GPT(config,
                                                          rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(1)
  return jax.tree.map(
      lambda s: rng.normal(scale=0.3, size=s.shape).astype(dtype), shapes)

# -- checkpoints ---------------------------------------------------------------


def assert_round_trip(path, state, like, *, schedule=None):
  """Saves ``state`` and restores it onto ``like``'s shardings: bit-identical,
  every leaf on ``state``'s sharding. Returns the restored state."""
  checkpoint.save(path, state, schedule=schedule)
  restored = checkpoint.restore(path, like, schedule=schedule)
  chex.assert_trees_all_equal(restored, state)
  assert all(jax.tree.leaves(jax.tree.map(
      lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim), restored,
      state)))
  return restored
