"""What several test files share: small models, their one-device references,
and the assertions that compare a parallel run with them.

Test files import it by name (``from helpers import ...``; pytest puts
``tests/`` on the path) and never import each other. Fixtures stay in
``tests/conftest.py`` (``x64``), where pytest finds them; the devices are
set up by the root ``conftest.py``. Not collected: under ``tests/`` only
``test_*.py`` files are test modules.

- the one closeness assertion, over pytrees (``tree_allclose``);
- the schedule constructors by short name (``SCHEDULES``);
- the executor's toy pipeline: residual tanh stages, a squared-error head,
  the sequential model as reference (``stage_fn``, ``loss_fn``, ``model``,
  ``reference``), and its dropout form (``dropout_stage``,
  ``dropout_loss``, ``dropout_reference``);
- the data-parallel MLP and plain optax training on one device
  (``mlp_params``, ``mlp_loss``, ``make_batches``, ``reference_run``);
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

# -- closeness -----------------------------------------------------------------


def _default_tol(dtypes) -> float:
  """The tolerance of the least precise floating dtype among ``dtypes``."""
  eps = max((float(jnp.finfo(d).eps) for d in dtypes
             if jnp.issubdtype(d, jnp.inexact)), default=None)
  if eps is None:
    return 0.0   # bools and integers: exact
  return 1e-10 if eps < 1e-12 else 1e-5 if eps < 1e-6 else 1e-2


def _kind(x, a: np.ndarray) -> str | None:
  """``'bool'``, ``'int'`` or ``'float'``; None for a Python number (weakly
  typed: it matches any numeric kind)."""
  if isinstance(x, (int, float, complex)) and not isinstance(x, bool):
    return None
  if a.dtype == bool:
    return 'bool'
  return 'float' if jnp.issubdtype(a.dtype, jnp.inexact) else 'int'


def _leaf_error(name, x, y, scale, rtol, atol) -> str | None:
  """Why leaf ``x`` is not ``y`` to ``atol * scale + rtol * |y|``; None when
  it is."""
  a, e = np.asarray(x), np.asarray(y)
  if a.shape != e.shape:
    return f'{name}: shape {a.shape}, expected {e.shape}'
  kinds = _kind(x, a), _kind(y, e)
  if None not in kinds and kinds[0] != kinds[1]:
    return f'{name}: dtype {a.dtype}, expected {e.dtype} (another kind)'
  weak = [d for k, d in zip(kinds, (a.dtype, e.dtype)) if k is not None]
  tol = _default_tol(weak or [a.dtype, e.dtype])
  rtol = tol if rtol is None else rtol
  atol = (rtol if atol is None else atol) * scale
  dtypes = f'{a.dtype} vs {e.dtype}'
  wide = lambda z: z.astype(np.complex128 if np.iscomplexobj(z) else np.float64)
  a, e = wide(a), wide(e)
  ok = np.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
  if ok.all():
    return None
  err = np.where(ok, 0.0, np.abs(a - e))   # NaN where one side only is NaN
  rel = np.divide(err, np.abs(e), out=np.where(err > 0, np.inf, 0.0),
                  where=e != 0)
  at = tuple(int(i) for i in np.unravel_index(np.argmax(err), err.shape))
  return (f'{name}: {ok.size - np.count_nonzero(ok)} of {ok.size} entries '
          f'off; max abs error {err.max():.3g} (at {at}: {a[at]} vs {e[at]}),'
          f' max rel error {rel.max():.3g}; rtol={rtol:.3g}, atol={atol:.3g},'
          f' {dtypes}')


def tree_allclose(actual, expected, *, rtol: float | None = None,
                  atol: float | None = None, atol_scale: str | None = None):
  """Asserts that two pytrees agree leaf by leaf, to a tolerance.

  The trees must have the same structure, and each pair of leaves the same
  shape and the same kind of dtype (bool, integer or floating; a Python
  number matches any). An entry passes when ``|actual - expected| <= atol +
  rtol * |expected|``; NaNs in the same places are equal. One
  ``AssertionError`` names every failing leaf by its key path, with its count
  of failing entries and its largest absolute and relative errors.

  Leaves are anything ``np.asarray`` takes: jax and numpy arrays, Python
  numbers, and ``data_parallel.Padded`` (compared as its logical array).

  Args:
    actual: the tree under test.
    expected: the reference tree.
    rtol: the relative tolerance. By default the one of the least precise
      floating dtype of each pair of leaves: 1e-10 for float64, 1e-5 for
      float32, 1e-2 for 16-bit floats; 0 (exact) for bools and integers.
    atol: the absolute tolerance; by default equal to ``rtol``.
    atol_scale: None: ``atol`` is absolute. ``'leaf'``: ``atol`` times each
      expected leaf's largest magnitude. ``'tree'``: ``atol`` times the
      largest magnitude in the whole expected tree (for leaves that are zero
      in exact arithmetic and so hold only the others' rounding noise).

  Example:
    >>> import numpy as np
    >>> from helpers import tree_allclose
    >>> tree_allclose({'w': np.ones(3)}, {'w': np.ones(3) + 1e-12})
  """
  if atol_scale not in (None, 'leaf', 'tree'):
    raise ValueError(f"atol_scale={atol_scale!r}: use None, 'leaf' or 'tree'")
  is_leaf = lambda x: isinstance(x, jaxpar.data_parallel.Padded)
  got, got_def = jax.tree_util.tree_flatten_with_path(actual, is_leaf=is_leaf)
  want, want_def = jax.tree_util.tree_flatten_with_path(expected,
                                                        is_leaf=is_leaf)
  names = [jax.tree_util.keystr(p) or '(root)' for p, _ in want]
  if got_def != want_def:
    got_names = [jax.tree_util.keystr(p) or '(root)' for p, _ in got]
    extra = sorted(set(got_names) - set(names))
    missing = sorted(set(names) - set(got_names))
    where = (f'only in actual: {extra}, only in expected: {missing}'
             if extra or missing else 'same key paths, other node types')
    raise AssertionError(
        f'tree_allclose: the trees differ in structure ({where})\n'
        f'  actual:   {got_def}\n  expected: {want_def}')
  # One transfer for all device leaves, not one per leaf.
  got, want = jax.device_get(([x for _, x in got], [y for _, y in want]))
  magnitude = lambda y: float(np.max(np.abs(np.asarray(y)), initial=0))
  scales = {None: lambda: [1.0] * len(want),
            'leaf': lambda: [magnitude(y) for y in want],
            'tree': lambda: [max(map(magnitude, want), default=0.0)] * len(want)}
  errors = [_leaf_error(*args, rtol, atol) for args in
            zip(names, got, want, scales[atol_scale]())]
  errors = [e for e in errors if e is not None]
  if errors:
    raise AssertionError(f'tree_allclose: {len(errors)} of {len(names)} '
                         'leaves differ:\n  ' + '\n  '.join(errors))


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
