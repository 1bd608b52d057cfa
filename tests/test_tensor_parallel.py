"""Tensor parallelism equals the dense computation; communication as promised.

Every layer runs inside ``jax.shard_map`` on ``tensor`` = 1, 2, 4, 8 devices;
its output and the gradients of ``sum(y * w)`` (random ``w``) w.r.t. every
parameter shard and the input are compared with plain ``jax`` on one device.
Gradients are taken inside the shard_map, as a train step does.
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxpar
from jaxpar import hlo
from jaxpar import tensor_parallel as tp
from jaxpar.models import gpt
from jaxpar.tensor_parallel import internal as tp_internal
from helpers import tree_allclose

B, S, D, F, H, V = 2, 8, 16, 32, 8, 32   # H, S, V divisible by 1, 2, 4, 8
REP, SEQ = P(), P(None, 'tensor', None)   # replicated / sequence-sharded

# Tensor rules of the test param trees (an MLP, an attention, a block, an
# embedding, as pure dicts), each matching its param at any depth.
RULES = {
    r'(.*/)?fc_in/(kernel|bias)': ('tensor',),                 # columns
    r'(.*/)?fc_out/kernel': ('tensor', None),                  # rows
    r'(.*/)?(query|key|value)/(kernel|bias)': ('tensor', None),   # heads
    r'(.*/)?out/kernel': ('tensor', None, None),               # heads
    r'(.*/)?embed/embedding': ('tensor', None),                # vocabulary
}


def rules_for(params):
  """``RULES`` for a pure dict; ``None`` (Flax metadata) for an nnx.State."""
  return None if isinstance(params, nnx.State) else RULES

# (tensor size, dtype, tolerance relative to each tensor's largest entry).
CASES = [pytest.param((n, np.float64, 1e-10), id=f'tp{n}-f64')
         for n in (1, 2, 4, 8)] + [pytest.param((8, np.float32, 1e-5),
                                                id='tp8-f32')]


@functools.cache
def mesh_of(n):
  return jaxpar.make_mesh(tensor=n, devices=jax.devices()[:n])


def put(mesh, a, spec):
  return jax.device_put(a, NamedSharding(mesh, spec))


def rand(rng, *shape, scale=1.0):
  return scale * rng.standard_normal(shape)


def linear_params(rng, fan_in, fan_out):
  return {'kernel': rand(rng, fan_in, fan_out, scale=fan_in ** -0.5),
          'bias': rand(rng, fan_out, scale=0.1)}


def mlp_params(rng):
  return {'fc_in': linear_params(rng, D, F), 'fc_out': linear_params(rng, F, D)}


def attention_params(rng):
  k = D // H
  qkv = {name: {'kernel': rand(rng, D, H, k, scale=D ** -0.5),
                'bias': rand(rng, H, k, scale=0.1)}
         for name in ('query', 'key', 'value')}
  return qkv | {'out': {'kernel': rand(rng, H, k, D, scale=D ** -0.5),
                        'bias': rand(rng, D, scale=0.1)}}


def norm_params(rng):
  return {'scale': 1 + rand(rng, D, scale=0.1), 'bias': rand(rng, D, scale=0.1)}


def block_params(rng):
  return {'ln1': norm_params(rng), 'attn': attention_params(rng),
          'ln2': norm_params(rng), 'mlp': mlp_params(rng)}


# Dense single-device references, written independently of jaxpar.


def dense_mlp(p, x):
  h = jax.nn.gelu(x @ p['fc_in']['kernel'] + p['fc_in']['bias'])
  return h @ p['fc_out']['kernel'] + p['fc_out']['bias']


def dense_attention(p, x, causal=True):
  d, heads, k = p['query']['kernel'].shape

  def split_heads(name):   # [..., S, D] @ [D, H*k] -> [..., H, S, k]
    y = x @ p[name]['kernel'].reshape(d, heads * k) + p[name][
        'bias'].reshape(-1)
    return jnp.swapaxes(y.reshape(*x.shape[:-1], heads, k), -2, -3)

  q, kk, v = split_heads('query'), split_heads('key'), split_heads('value')
  s = q @ jnp.swapaxes(kk, -1, -2) / np.sqrt(k)   # [..., H, S, S]
  if causal:
    s = jnp.where(np.tril(np.ones((x.shape[-2],) * 2, bool)), s, -jnp.inf)
  o = jnp.swapaxes(jax.nn.softmax(s, axis=-1) @ v, -2, -3)   # [..., S, H, k]
  return (o.reshape(*x.shape[:-1], heads * k)
          @ p['out']['kernel'].reshape(heads * k, d) + p['out']['bias'])


def dense_norm(p, x):
  return ((x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True)
                                                      + 1e-6) * p['scale']
          + p['bias'])


def dense_block(p, x):
  h = x + dense_attention(p['attn'], dense_norm(p['ln1'], x))
  return h + dense_mlp(p['mlp'], dense_norm(p['ln2'], h))


# One function object per reference: ``dense_value_and_grads`` is compiled
# once per (function, shapes, dtype), shared by every tensor size.


def dense_fc_in(p, x):
  return x @ p['fc_in']['kernel'] + p['fc_in']['bias']


def dense_fc_out(p, x):
  return x @ p['fc_out']['kernel'] + p['fc_out']['bias']


def dense_embed(p, ids):
  return p['embed']['embedding'][ids]


LABELS = np.random.default_rng(6).integers(0, V, (B, S)).astype(np.int32)
LABELS[0, :2] = [0, V - 1]   # both ends of the vocabulary


def dense_cross_entropy(p, logits):
  del p
  return optax.losses.softmax_cross_entropy_with_integer_labels(logits, LABELS)


# Harness: value and gradients of sum(y * w), dense and tensor-parallel.


@functools.partial(jax.jit, static_argnums=0)
def dense_value_and_grads(fn, params, x, w):
  argnums = (0, 1) if np.issubdtype(x.dtype, np.floating) else 0

  def loss(p, x):
    y = fn(p, x)
    return jnp.sum(y * w), y

  (_, y), grads = jax.value_and_grad(loss, argnums, has_aux=True)(params, x)
  return y, grads


def tp_value_and_grads(fn, params, x, w, *, n, x_spec, out_spec):
  """Runs fn(local params, local x) in shard_map; grads taken inside it."""
  mesh = mesh_of(n)
  rules = rules_for(params)
  specs = tp.param_specs(params, rules=rules)
  diff_x = np.issubdtype(x.dtype, np.floating)
  out_sharded = 'tensor' in tuple(out_spec)

  def inner(p, x, w):
    def loss(p, x):
      y = fn(p, x)
      local = jnp.sum(y * w)
      return (jax.lax.psum(local, 'tensor') if out_sharded else local), y
    argnums = (0, 1) if diff_x else 0
    (_, y), grads = jax.value_and_grad(loss, argnums, has_aux=True)(p, x)
    return y, grads

  f = jax.jit(jax.shard_map(
      inner, mesh=mesh, in_specs=(specs, x_spec, out_spec),
      out_specs=(out_spec, (specs, x_spec) if diff_x else specs)))
  return f(tp.shard_params(params, mesh=mesh, rules=rules),
           put(mesh, x, x_spec), put(mesh, w, out_spec))


def check_exact(tp_fn, dense_fn, params, x, *, n, dtype, tol, x_spec=REP,
                out_spec=REP, seed=7):
  cast = lambda a: a.astype(dtype) if np.issubdtype(a.dtype, np.floating) else a
  params, x = jax.tree.map(cast, params), cast(x)
  y_shape = jax.eval_shape(dense_fn, params, x).shape   # no eager run
  w = cast(np.random.default_rng(seed).standard_normal(y_shape))
  want = dense_value_and_grads(dense_fn, params, x, w)
  got = tp_value_and_grads(tp_fn, params, x, w, n=n, x_spec=x_spec,
                           out_spec=out_spec)
  assert np.asarray(got[0]).dtype == dtype
  # atol relative to the whole tree: some gradients are exactly zero in exact
  # arithmetic (the key bias: softmax ignores a per-query shift).
  tree_allclose(got, want, rtol=tol, atol_scale='tree')


@pytest.fixture(params=CASES)
def case(request):
  n, dtype, tol = request.param
  if dtype == np.float64:
    request.getfixturevalue('x64')
  return {'n': n, 'dtype': dtype, 'tol': tol}


# ---------------------------------------------------------------------------
# Exactness against the dense reference, tensor sizes 1, 2, 4, 8.


def test_column_parallel_linear(case):
  rng = np.random.default_rng(0)
  params = {'fc_in': linear_params(rng, D, F)}
  check_exact(
      lambda p, x: tp.column_parallel_linear(x, p['fc_in']['kernel'],
                                             p['fc_in']['bias']),
      dense_fc_in, params, rand(rng, B, S, D), out_spec=P(None, None, 'tensor'),
      **case)


def test_row_parallel_linear(case):
  rng = np.random.default_rng(1)
  params = {'fc_out': linear_params(rng, F, D)}
  check_exact(
      lambda p, x: tp.row_parallel_linear(x, p['fc_out']['kernel'],
                                          p['fc_out']['bias']),
      dense_fc_out, params, rand(rng, B, S, F), x_spec=P(None, None, 'tensor'),
      **case)


def test_parallel_mlp(case):
  rng = np.random.default_rng(2)
  check_exact(tp.parallel_mlp, dense_mlp, mlp_params(rng), rand(rng, B, S, D),
              **case)


def test_parallel_self_attention(case):
  rng = np.random.default_rng(3)
  check_exact(functools.partial(tp.parallel_self_attention, causal=True),
              dense_attention, attention_params(rng), rand(rng, B, S, D),
              **case)


def test_transformer_block_sequence_parallel(case):
  rng = np.random.default_rng(4)
  check_exact(functools.partial(tp.transformer_block, sequence_parallel=True),
              dense_block, block_params(rng), rand(rng, B, S, D), x_spec=SEQ,
              out_spec=SEQ, **case)


def test_vocab_parallel_embed(case):
  rng = np.random.default_rng(5)
  params = {'embed': {'embedding': rand(rng, V, D)}}
  ids = rng.integers(0, V, (B, S)).astype(np.int32)
  ids[0, :3] = [0, V - 1, 0]   # both ends of the vocabulary, a repeated id
  check_exact(lambda p, i: tp.vocab_parallel_embed(i, p['embed']['embedding']),
              dense_embed, params, ids, **case)


def test_vocab_parallel_cross_entropy_matches_optax(case):
  """Per-example loss and d loss / d logits equal optax on gathered logits."""
  rng = np.random.default_rng(6)
  check_exact(
      lambda p, logits: tp.vocab_parallel_cross_entropy(logits, LABELS),
      dense_cross_entropy, {}, rand(rng, B, S, V, scale=3.0),
      x_spec=P(None, None, 'tensor'), **case)


# Variants, on tensor=4 in float64.


@pytest.mark.parametrize('variant', [
    'column_gather_output', 'column_sequence_parallel',
    'row_input_not_parallel', 'row_sequence_parallel', 'mlp_sequence_parallel',
    'attention_sequence_parallel_noncausal', 'block_replicated',
    'embed_sequence_parallel'])
def test_variants(x64, variant):
  rng = np.random.default_rng(8)
  x = rand(rng, B, S, D)
  lin = {'fc_in': linear_params(rng, D, F)}
  row = {'fc_out': linear_params(rng, D, D)}
  col_p = lambda p: (p['fc_in']['kernel'], p['fc_in']['bias'])
  row_p = lambda p: (p['fc_out']['kernel'], p['fc_out']['bias'])
  table = {'embed': {'embedding': rand(rng, V, D)}}
  ids = rng.integers(0, V, (B, S)).astype(np.int32)
  args = {
      'column_gather_output': (
          lambda p, x: tp.column_parallel_linear(x, *col_p(p),
                                                 gather_output=True),
          dense_fc_in, lin, x, REP, REP),
      'column_sequence_parallel': (
          lambda p, x: tp.column_parallel_linear(x, *col_p(p),
                                                 sequence_parallel=True),
          dense_fc_in, lin, x, SEQ, P(None, None, 'tensor')),
      'row_input_not_parallel': (
          lambda p, x: tp.row_parallel_linear(x, *row_p(p),
                                              input_is_parallel=False),
          dense_fc_out, row, x, REP, REP),
      'row_sequence_parallel': (
          lambda p, x: tp.row_parallel_linear(x, *row_p(p),
                                              sequence_parallel=True),
          dense_fc_out, row, x, P(None, None, 'tensor'), SEQ),
      'mlp_sequence_parallel': (
          functools.partial(tp.parallel_mlp, sequence_parallel=True),
          dense_mlp, mlp_params(rng), x, SEQ, SEQ),
      'attention_sequence_parallel_noncausal': (
          functools.partial(tp.parallel_self_attention, sequence_parallel=True),
          functools.partial(dense_attention, causal=False),
          attention_params(rng), x, SEQ, SEQ),
      'block_replicated': (tp.transformer_block, dense_block,
                           block_params(rng), x, REP, REP),
      'embed_sequence_parallel': (
          lambda p, i: tp.vocab_parallel_embed(i, p['embed']['embedding'],
                                               sequence_parallel=True),
          dense_embed, table, ids, REP, SEQ),
  }
  tp_fn, dense_fn, params, inputs, x_spec, out_spec = args[variant]
  check_exact(tp_fn, dense_fn, params, inputs, n=4, dtype=np.float64,
              tol=1e-10, x_spec=x_spec, out_spec=out_spec)


@pytest.mark.parametrize('causal', [False, True])
def test_dot_product_attention_core(x64, causal):
  """float64: exact einsum path; float32: jax.nn.dot_product_attention, any
  number of leading dims."""
  rng = np.random.default_rng(21)
  q, k, v = (rand(rng, 2, 3, S, H, 4) for _ in range(3))
  s = np.einsum('...qhd,...khd->...hqk', q, k) / 2.0
  if causal:
    s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum('...hqk,...khd->...qhd', p / p.sum(-1, keepdims=True), v)
  attention = jax.jit(functools.partial(tp.dot_product_attention,
                                        causal=causal))   # not op by op
  got64 = attention(*map(jnp.asarray, (q, k, v)))
  assert got64.dtype == jnp.float64
  np.testing.assert_allclose(got64, want, rtol=1e-10, atol=1e-12)
  q32, k32, v32 = (jnp.asarray(a, jnp.float32) for a in (q, k, v))
  got32 = attention(q32, k32, v32)
  assert got32.dtype == jnp.float32 and got32.shape == want.shape
  np.testing.assert_allclose(got32, want, rtol=1e-5, atol=1e-5)


def test_grad_outside_shard_map_is_not_scaled(x64):
  """jax.grad of jit(shard_map(...)): replicated-input grads are not N x."""
  rng = np.random.default_rng(9)
  params, x = mlp_params(rng), rand(rng, B, S, D)
  mesh = mesh_of(4)
  specs = tp.param_specs(params, rules=RULES)
  mlp = jax.shard_map(tp.parallel_mlp, mesh=mesh, in_specs=(specs, REP),
                      out_specs=REP)
  loss = lambda f: (lambda p, x: jnp.sum(f(p, x) ** 2))
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(loss(mlp), (0, 1)))(
        tp.shard_params(params, mesh=mesh, rules=RULES), put(mesh, x, REP))
  tree_allclose(got, jax.jit(jax.grad(loss(dense_mlp), (0, 1)))(params, x),
                rtol=1e-10, atol_scale='tree')


def test_cross_entropy_is_stable_for_huge_logits():
  rng = np.random.default_rng(10)
  logits = rand(rng, B, V, scale=1e4).astype(np.float32)
  labels = rng.integers(0, V, (B,)).astype(np.int32)
  mesh = mesh_of(8)
  xent = jax.jit(jax.shard_map(tp.vocab_parallel_cross_entropy, mesh=mesh,
                               in_specs=(P(None, 'tensor'), REP),
                               out_specs=REP))
  got = np.asarray(xent(put(mesh, logits, P(None, 'tensor')),
                        put(mesh, labels, REP)))
  want = optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())


# ---------------------------------------------------------------------------
# Communication, counted in the compiled HLO (tensor=4).

NONE = dict.fromkeys(hlo.KINDS, 0)


def compile_tp(fn, params, x, x_spec, out_spec, *, grad=False):
  mesh = mesh_of(4)
  specs = tp.param_specs(params, rules=RULES)
  if grad:   # loss and its gradient w.r.t. params and x
    def loss(p, x):
      local = jnp.sum(fn(p, x) ** 2)
      return jax.lax.psum(local, 'tensor') if 'tensor' in tuple(
          out_spec) else local
    body = jax.value_and_grad(loss, (0, 1))
    out_specs = (REP, (specs, x_spec))
  else:
    body, out_specs = fn, out_spec
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, x_spec),
                            out_specs=out_specs))
  return f.lower(tp.shard_params(params, mesh=mesh, rules=RULES),
                 put(mesh, x, x_spec)).compile()


def counts_of(*args, **kwargs):
  return hlo.collective_counts(compile_tp(*args, **kwargs))


def forward_cases():
  rng = np.random.default_rng(11)
  x, logits = rand(rng, B, S, D), rand(rng, B, S, V)
  lin = {'fc_in': linear_params(rng, D, F)}
  row = {'fc_out': linear_params(rng, F, D)}
  col = lambda **kw: (lambda p, x: tp.column_parallel_linear(
      x, p['fc_in']['kernel'], p['fc_in']['bias'], **kw))
  rowf = lambda **kw: (lambda p, x: tp.row_parallel_linear(
      x, p['fc_out']['kernel'], p['fc_out']['bias'], **kw))
  labels = np.zeros((B, S), np.int32)
  sharded_last = P(None, None, 'tensor')
  return {
      'column': (col(), lin, x, REP, sharded_last, {}),
      'column_gather_output': (col(gather_output=True), lin, x, REP, REP,
                               {'all-gather': 1}),
      'column_sequence_parallel': (col(sequence_parallel=True), lin, x, SEQ,
                                   sharded_last, {'all-gather': 1}),
      'row': (rowf(), row, rand(rng, B, S, F), sharded_last, REP,
              {'all-reduce': 1}),
      'row_sequence_parallel': (rowf(sequence_parallel=True), row,
                                rand(rng, B, S, F), sharded_last, SEQ,
                                {'reduce-scatter': 1}),
      'mlp': (tp.parallel_mlp, mlp_params(rng), x, REP, REP,
              {'all-reduce': 1}),
      'attention': (functools.partial(tp.parallel_self_attention, causal=True),
                    attention_params(rng), x, REP, REP, {'all-reduce': 1}),
      'block': (tp.transformer_block, block_params(rng), x, REP, REP,
                {'all-reduce': 2}),
      'block_sequence_parallel': (
          functools.partial(tp.transformer_block, sequence_parallel=True),
          block_params(rng), x, SEQ, SEQ,
          {'all-gather': 2, 'reduce-scatter': 2}),
      'embed': (lambda p, i: tp.vocab_parallel_embed(i,
                                                      p['embed']['embedding']),
                {'embed': {'embedding': rand(rng, V, D)}},
                np.zeros((B, S), np.int32), REP, REP, {'all-reduce': 1}),
      'cross_entropy': (
          lambda p, lg: tp.vocab_parallel_cross_entropy(lg, labels), {},
          logits, sharded_last, REP, {'all-reduce': 2}),   # max, then sums
  }


FORWARD = forward_cases()


@pytest.mark.parametrize('name', list(FORWARD))
def test_forward_collectives(name):
  fn, params, x, x_spec, out_spec, want = FORWARD[name]
  assert counts_of(fn, params, x, x_spec, out_spec) == NONE | want


@pytest.mark.parametrize('name,want', [
    # forward psum + the all-reduce of dx (Megatron's f); none for dW.
    ('mlp', {'all-reduce': 2}),
    ('attention', {'all-reduce': 2}),
    # backward of the cross-entropy is local: softmax - onehot.
    ('cross_entropy', {'all-reduce': 2}),
])
def test_forward_backward_collectives(name, want):
  fn, params, x, x_spec, out_spec, _ = FORWARD[name]
  assert counts_of(fn, params, x, x_spec, out_spec, grad=True) == NONE | want


def test_sequence_parallel_block_backward_all_reduces_only_replicated_grads():
  """Backward mirrors 2 AG + 2 RS; all-reduces carry no activations.

  The only all-reduced values are the loss and the gradients of the
  replicated parameters used on sequence shards (norms, output biases),
  however XLA combines them: exactly their bytes.
  """
  fn, params, x, x_spec, out_spec, _ = FORWARD['block_sequence_parallel']
  compiled = compile_tp(fn, params, x, x_spec, out_spec, grad=True)
  counts = hlo.collective_counts(compiled)
  assert counts | {'all-reduce': 0} == NONE | {'all-gather': 4,
                                               'reduce-scatter': 4}, counts
  replicated = [leaf for leaf, spec in zip(
      jax.tree.leaves(params),
      jax.tree.leaves(tp.param_specs(params, rules=RULES)))
                if spec == P()]
  want = 4 * (1 + sum(leaf.size for leaf in replicated))   # float32
  assert hlo.collective_bytes(compiled)['all-reduce'] == want


# ---------------------------------------------------------------------------
# Dense params <-> shards, and Flax NNX modules.


def test_param_specs_rules_and_stacked_layers():
  """A rule gives the entries of a param's trailing dims: one rule fits a
  kernel and its bias, and stacked layers (extra leading dims)."""
  rng = np.random.default_rng(12)
  params = block_params(rng)
  params['mlp']['fc_in']['kernel'] = np.zeros((3, D, F))   # 3 stacked layers
  specs = tp.param_specs(params | {'embed': {'embedding': rand(rng, V, D)}},
                         rules=gpt.TENSOR_RULES)
  assert specs['attn']['query'] == {'kernel': P(None, 'tensor', None),
                                    'bias': P('tensor', None)}
  assert specs['attn']['out'] == {'kernel': P('tensor', None, None),
                                  'bias': P()}
  assert specs['mlp'] == {'fc_in': {'kernel': P(None, None, 'tensor'),
                                    'bias': P('tensor')},
                          'fc_out': {'kernel': P('tensor', None), 'bias': P()}}
  assert specs['ln1'] == {'scale': P(), 'bias': P()}
  assert specs['embed']['embedding'] == P('tensor', None)
  # Rules name mesh axes as written; the first matching rule wins, and an
  # all-None spec keeps a param whole.
  custom = tp.param_specs(
      {'wte': {'embedding': np.zeros((V, D))}, 'w': np.zeros((D, F)),
       'w2': np.zeros((D, F))}, tensor_axis='model',
      rules={'wte/embedding': ('model', None), 'w2': (None, None),
             'w.*': (('data', 'model'),)})
  assert custom == {'wte': {'embedding': P('model', None)}, 'w2': P(),
                    'w': P(None, ('data', 'model'))}


def test_match_rules_is_the_one_matcher():
  """Whole paths (re.fullmatch), first rule in order, unused rules left out
  of the matches; metadata keeps its ``axis`` entries only."""
  rules = {r'attn/w[qkv]/kernel': (None, 'tensor'), r'attn/.*': (),
           r'never/used': ('tensor',)}
  paths = {'attn/wq/kernel': 2, 'attn/wo/kernel': 2, 'x/attn/wq/kernel': 2}
  got = tp.match_rules(paths, rules)
  assert got == {'attn/wq/kernel': tp.RuleMatch(r'attn/w[qkv]/kernel',
                                                (None, 'tensor')),
                 'attn/wo/kernel': tp.RuleMatch(r'attn/.*', ())}
  assert set(rules) - {m.rule for m in got.values()} == {'never/used'}
  metadata = {'a': ('data', 'tensor'), 'b': P(('data', 'tensor'), None),
              'c': ('data', None), 'd': None}
  got = tp.match_rules({k: 2 for k in metadata}, metadata=metadata)
  assert got == {'a': tp.RuleMatch(None, (None, 'tensor')),
                 'b': tp.RuleMatch(None, ('tensor', None))}


def all_replicated(specs):
  return all(spec == P() for spec in jax.tree.leaves(
      specs, is_leaf=lambda s: isinstance(s, P)))


def test_rules_match_whole_paths():
  """A user's layers named like jaxpar's (query, out, fc_in, embed) at other
  paths stay whole under jaxpar's rules; the user's own rules split them."""
  rng = np.random.default_rng(14)
  user = {'encoder': {'layers': {str(i): block_params(rng) for i in range(2)}},
          'tok': {'embed': {'embedding': rand(rng, V, D)}},
          'query': {'fc_in': linear_params(rng, D, F)}}
  assert all_replicated(tp.param_specs(user))                # no metadata
  assert all_replicated(tp.param_specs(user, rules=gpt.TENSOR_RULES))
  rules = {r'encoder/layers/\d+/attn/query/(kernel|bias)': ('tensor', None),
           r'encoder/layers/\d+/mlp/fc_in/kernel': ('tensor',),
           r'tok/embed/embedding': ('tensor', None),
           r'fc_in/kernel': ('tensor',)}   # matches no whole path here
  specs = tp.param_specs(user, rules=rules)
  for i in '01':
    layer = specs['encoder']['layers'][i]
    assert layer['attn']['query']['kernel'] == P(None, 'tensor', None)
    assert layer['mlp']['fc_in']['kernel'] == P(None, 'tensor')
    assert layer['attn']['key']['kernel'] == layer['mlp']['fc_out']['kernel']
    assert layer['attn']['key']['kernel'] == P()
  assert specs['tok']['embed']['embedding'] == P('tensor', None)
  assert specs['query']['fc_in']['kernel'] == P()


def test_flax_metadata_is_the_default():
  """Without rules, the params' Flax metadata splits them wherever they sit:
  jaxpar's NNX modules carry it; Flax's own nnx.MultiHeadAttention (query,
  key, ... too) carries none; a user's ``nnx.with_partitioning`` is read,
  its ``axis`` entries only."""
  model = nnx.eval_shape(lambda: nnx.Dict(
      ffn=tp.ParallelMLP(D, F, rngs=nnx.Rngs(0)),
      self_attn=tp.ParallelSelfAttention(D, H, rngs=nnx.Rngs(0)),
      flax_attn=nnx.MultiHeadAttention(H, D, decode=False, rngs=nnx.Rngs(0))))
  state = nnx.state(model, nnx.Param)
  specs = jax.tree.map(lambda v: v.get_value(), tp.param_specs(state),
                       is_leaf=lambda v: isinstance(v, nnx.Variable))
  assert specs['ffn']['fc_in']['bias'] == P('tensor')
  assert specs['ffn']['fc_out']['kernel'] == P('tensor', None)
  assert specs['ffn']['fc_out']['bias'] == P()
  assert specs['self_attn']['out']['kernel'] == P('tensor', None, None)
  assert specs['self_attn']['key']['bias'] == P('tensor', None)
  assert all_replicated(specs['flax_attn'])
  flax_specs = nnx.get_partition_spec(state)   # Flax reads the same specs
  assert flax_specs['ffn']['fc_in']['kernel'].get_value() == P(None, 'tensor')
  with jax.set_mesh(jaxpar.make_mesh(data=2, tensor=2,
                                     devices=jax.devices()[:4])):
    linear = nnx.Linear(D, F, rngs=nnx.Rngs(0), kernel_init=(
        nnx.with_partitioning(nnx.initializers.lecun_normal(),
                              ('data', 'tensor'))))
  specs = tp.param_specs(nnx.state(linear, nnx.Param))
  assert specs['kernel'].get_value() == P(None, 'tensor')
  assert specs['bias'].get_value() == P()


def test_gpt_tensor_rules_fit_its_dense_params_and_pipeline_parts():
  """``gpt.TENSOR_RULES`` split the dense ``gpt_params`` and each part of
  ``split_for_pipeline`` alike (shapes only: rules read paths and ranks)."""
  params = jax.eval_shape(lambda: gpt.gpt_params(gpt.GPT(
      gpt.GPTConfig(num_layers=2), rngs=nnx.Rngs(0))))
  dense = tp.param_specs(params, rules=gpt.TENSOR_RULES)
  assert dense['blocks'][1]['attn']['value']['kernel'] == P(None, 'tensor',
                                                            None)
  assert dense['pos'] == dense['blocks'][0]['ln1']['scale'] == P()
  pp = jax.eval_shape(lambda: gpt.split_for_pipeline(params, num_stages=2)[0])
  embed, stages, head = (tp.param_specs(part, rules=gpt.TENSOR_RULES)
                         for part in pp)
  assert embed['embed']['embedding'] == P('tensor', None)
  assert stages['attn']['value']['kernel'] == P(None, None, None, 'tensor',
                                                None)
  assert stages['mlp']['fc_out']['kernel'] == P(None, None, 'tensor', None)
  assert head['lm_head'] == {'kernel': P(None, 'tensor'), 'bias': P('tensor')}


def user_trainer(rules=None, **sizes):
  """parallel.trainer of a user's residual MLP stages (not jaxpar's
  layers), and its params."""
  def stage_fn(p, x):
    return x + jnp.tanh(x @ p['up']['kernel']) @ p['down']['kernel']
  def loss_fn(p, y, t):
    return jnp.mean((y @ p['w'] - t) ** 2)
  rng = np.random.default_rng(15)
  params = jaxpar.parallel.PipelineParams(
      embed={}, stages={'up': {'kernel': rand(rng, 2, D, F)},
                        'down': {'kernel': rand(rng, 2, F, D)}},
      head={'w': rand(rng, D, 1)})
  trainer = jaxpar.parallel.trainer(
      lambda p, x: x, stage_fn, loss_fn, optax.sgd(0.1),
      schedule=jaxpar.pipeline.one_f_one_b(2, 2),
      mesh=jaxpar.make_mesh(**sizes), tensor_rules=rules)
  return trainer, params


def test_unused_tensor_axis_raises():
  """data=2, stage=2, tensor=2 with a user's stage_fn and no rules for it:
  every tensor rank would compute the whole model; init says so."""
  trainer, params = user_trainer(data=2, stage=2, tensor=2)
  with pytest.raises(ValueError) as err:
    trainer.init(params)
  msg = str(err.value)
  for part in ("{'data': 2, 'stage': 2, 'tensor': 2} has a 'tensor' axis of "
               'size 2', "no parameter is split over 'tensor'",
               'tensor_rules=', 'jaxpar.models.gpt.TENSOR_RULES',
               'nnx.with_partitioning', 'jaxpar.make_mesh(data=4, stage=2)'):
    assert part in msg, (part, msg)
  # Without the tensor axis, or with a rule splitting a layer, init runs.
  trainer, params = user_trainer(data=4, stage=2)
  trainer.init(params)
  trainer, params = user_trainer({'up/kernel': ('tensor',)}, data=2, stage=2,
                                 tensor=2)
  state = trainer.init(params)
  kernel = state.params.stages['up']['kernel']
  assert kernel.sharding.shard_shape(kernel.shape)[-1] == F // 2


def test_shard_and_unshard_round_trip():
  rng = np.random.default_rng(13)
  params = block_params(rng)
  mesh = mesh_of(4)
  sharded = tp.shard_params(params, mesh=mesh, rules=gpt.TENSOR_RULES)
  kernel = sharded['mlp']['fc_in']['kernel']
  assert kernel.sharding.shard_shape(kernel.shape) == (D, F // 4)
  dense = tp.unshard_params(sharded)
  for got, want in zip(jax.tree.leaves(dense), jax.tree.leaves(params)):
    assert got.sharding.is_fully_replicated
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_flax_multi_head_attention_runs_tensor_parallel():
  """nnx.MultiHeadAttention's own params, sharded, give its own output."""
  mha = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False,
                               rngs=nnx.Rngs(0))
  x = np.random.default_rng(14).standard_normal((B, S, D)).astype(np.float32)
  mask = nnx.make_causal_mask(np.zeros((B, S)))
  want = jax.jit(lambda x: mha(x, mask=mask))(x)   # one compile, not op by op
  _, state = nnx.split(mha, nnx.Param)
  params = nnx.to_pure_dict(state)
  mesh = mesh_of(4)
  attn = jax.jit(jax.shard_map(
      functools.partial(tp.parallel_self_attention, causal=True), mesh=mesh,
      in_specs=(tp.param_specs(params, rules=RULES), REP), out_specs=REP))
  got = attn(tp.shard_params(params, mesh=mesh, rules=RULES),
             put(mesh, x, REP))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('sequence_parallel', [False, True])
def test_nnx_modules_split_merge(x64, sequence_parallel):
  """ParallelMLP / ParallelSelfAttention as pure functions: values and grads."""
  rngs = nnx.Rngs(1)
  kw = dict(sequence_parallel=sequence_parallel, param_dtype=jnp.float64)
  mlp = tp.ParallelMLP(D, F, rngs=rngs, **kw)
  attn = tp.ParallelSelfAttention(D, H, causal=True, rngs=rngs, **kw)
  model = nnx.Sequential(attn, mlp)   # params: layers.0 (attn), layers.1 (mlp)
  graphdef, state = nnx.split(model)
  spec = SEQ if sequence_parallel else REP

  def tp_fn(state, x):
    return nnx.merge(graphdef, state)(x)

  def dense_fn(p, x):
    return dense_mlp(p['layers'][1], dense_attention(p['layers'][0], x))

  x = np.random.default_rng(15).standard_normal((B, S, D))
  w = np.random.default_rng(16).standard_normal((B, S, D))
  y, (g_state, g_x) = tp_value_and_grads(tp_fn, state, x, w, n=4, x_spec=spec,
                                         out_spec=spec)
  y_ref, (g_ref, gx_ref) = dense_value_and_grads(
      dense_fn, nnx.to_pure_dict(state), x, w)
  tree_allclose((y, nnx.to_pure_dict(g_state), g_x), (y_ref, g_ref, gx_ref),
                rtol=1e-10, atol_scale='tree')


def test_pure_functions_take_an_nnx_state(x64):
  model = tp.ParallelMLP(D, F, param_dtype=jnp.float64, rngs=nnx.Rngs(3))
  _, state = nnx.split(model)
  x = np.random.default_rng(19).standard_normal((B, D))
  mesh = mesh_of(4)
  mlp = jax.jit(jax.shard_map(tp.parallel_mlp, mesh=mesh,
                              in_specs=(tp.param_specs(state), REP),
                              out_specs=REP))
  got = mlp(tp.shard_params(state, mesh=mesh), put(mesh, x, REP))
  tree_allclose(got, dense_mlp(nnx.to_pure_dict(state), x), rtol=1e-10,
                atol_scale='tree')


def test_nnx_linear_modules(x64):
  rngs = nnx.Rngs(2)
  col = tp.ColumnParallelLinear(D, F, gather_output=True, rngs=rngs,
                                param_dtype=jnp.float64)
  row = tp.RowParallelLinear(F, D, input_is_parallel=False, use_bias=False,
                             rngs=rngs, param_dtype=jnp.float64)
  graphdef, state = nnx.split(nnx.Dict(fc_in=col, fc_out=row))

  def tp_fn(state, x):
    layers = nnx.merge(graphdef, state)
    return layers['fc_out'](jnp.tanh(layers['fc_in'](x)))

  def dense_fn(p, x):
    return jnp.tanh(x @ p['fc_in']['kernel'] + p['fc_in']['bias']) @ (
        p['fc_out']['kernel'])

  rng = np.random.default_rng(17)
  x, w = rand(rng, B, D), rand(rng, B, D)
  got = tp_value_and_grads(tp_fn, state, x, w, n=4, x_spec=REP, out_spec=REP)
  want = dense_value_and_grads(dense_fn, nnx.to_pure_dict(state), x, w)
  tree_allclose((got[0], (nnx.to_pure_dict(got[1][0]), got[1][1])), want,
                rtol=1e-10, atol_scale='tree')


# ---------------------------------------------------------------------------
# Errors name the sizes and the fix.


def run_in_tensor_map(fn, *args, specs, n=4, check_vma=True):
  mesh = mesh_of(n)
  placed = [put(mesh, a, s) for a, s in zip(args, specs)]
  return jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=P(),
                       check_vma=check_vma)(*placed)


def test_shard_params_rejects_indivisible_sizes():
  params = {'mlp': {'fc_in': {'kernel': np.zeros((D, 30)),
                              'bias': np.zeros(30)}},
            'attn': {'query': {'kernel': np.zeros((D, 6, 2))}},
            'embed': {'embedding': np.zeros((30, D))}}
  with pytest.raises(ValueError) as err:
    tp.shard_params(params, mesh=mesh_of(4), rules=gpt.TENSOR_RULES)
  msg = str(err.value)
  rule = repr(r'(blocks/\d+/)?mlp/fc_in/(kernel|bias)')
  for part in ("param 'mlp/fc_in/kernel' (16, 30): dim 1 of size 30 is split "
               f"over 'tensor' by rule {rule} but does not divide by its size "
               '4',
               "'mlp/fc_in/bias' (30,): dim 0",
               "'attn/query/kernel' (16, 6, 2): dim 1 of size 6",
               "'embed/embedding' (30, 16): dim 0 of size 30",
               "over the mesh {'data': 1, 'stage': 1, 'tensor': 4}"):
    assert part in msg, (part, msg)
  with pytest.raises(ValueError, match="dim 1 is split over 'model' by rule "
                     "'w', an axis the mesh does not have"):
    tp_internal.check_divisible({'w': np.zeros((4, 4))}, mesh=mesh_of(2),
                                rules={'w': ('model',)})
  # The split of Flax metadata is named too.
  bad = {'w': nnx.Param(np.zeros((4, 6)), out_sharding=(None, 'tensor'),
                        eager_sharding=False)}
  with pytest.raises(ValueError, match="param 'w' \\(4, 6\\): dim 1 of size "
                     "6 is split over 'tensor' by its Flax metadata"):
    tp_internal.check_divisible(bad, mesh=mesh_of(4))


def test_shard_params_rejects_missing_axis():
  with pytest.raises(ValueError, match="no axis 'model'"):
    tp.shard_params({}, mesh=mesh_of(2), tensor_axis='model')


def test_param_specs_rejects_bad_rules():
  with pytest.raises(TypeError, match='tensor rules must map regexes'):
    tp.param_specs({}, rules=['fc_in'])
  with pytest.raises(TypeError, match='tensor rule 0 must be a regex string'):
    tp.param_specs({}, rules={0: ('tensor',)})
  with pytest.raises(ValueError, match=r"tensor rule 'fc_in/\(' is not a "
                     'valid regex'):
    tp.param_specs({}, rules={'fc_in/(': ('tensor',)})
  for spec in ('tensor', ('tensor', 0), None):
    with pytest.raises(TypeError, match=r"tensor rule 'w': .* must be the "
                       'PartitionSpec entries'):
      tp.param_specs({}, rules={'w': spec})
  with pytest.raises(ValueError, match=r"tensor rule 'fc_in/kernel': \(None, "
                     r"'tensor'\) has 2 entries but param 'fc_in/kernel' has "
                     '1 dims'):
    tp.param_specs({'fc_in': {'kernel': np.zeros(3)}},
                   rules={'fc_in/kernel': (None, 'tensor')})
  bad = {'w': nnx.Param(np.zeros(3), out_sharding=(None, 'tensor'),
                        eager_sharding=False)}
  with pytest.raises(ValueError, match=r"Flax metadata out_sharding=\(None, "
                     r"'tensor'\) has 2 entries but param 'w' has 1 dims"):
    tp.param_specs(bad)


def test_layer_outside_shard_map_names_the_fix():
  with pytest.raises(ValueError, match="axis 'tensor' is not bound.*shard_map"):
    tp.column_parallel_linear(jnp.ones((2, 4)), jnp.ones((4, 4)))


def test_column_errors():
  x, k = np.ones((2, D)), np.ones((D, F))
  col = lambda x, k, b=None: tp.column_parallel_linear(x, k, b)
  with pytest.raises(ValueError,
                     match=r'x \(2, 8\) and kernel shard \(16, 8\)'):
    run_in_tensor_map(col, x[:, :8], k, specs=[REP, P(None, 'tensor')])
  with pytest.raises(ValueError, match=r"kernel \(16, 32\) is not sharded over"
                     r" 'tensor'.*P\(None, 'tensor'\)"):
    run_in_tensor_map(col, x, k, specs=[REP, REP])
  with pytest.raises(ValueError, match='check_vma=True'):
    run_in_tensor_map(col, x, k, specs=[REP, P(None, 'tensor')],
                      check_vma=False)
  with pytest.raises(ValueError, match=r'bias shape \(32,\) does not match the '
                     r"8 output features.*P\('tensor'\)"):
    run_in_tensor_map(col, x, k, np.ones(F),
                      specs=[REP, P(None, 'tensor'), REP])


def test_row_errors():
  x, k = np.ones((2, F)), np.ones((F, D))
  row = lambda x, k, b=None: tp.row_parallel_linear(x, k, b)
  with pytest.raises(ValueError, match='32 input features.*expects 8.*'
                     'input_is_parallel=False'):
    run_in_tensor_map(row, x, k, specs=[REP, P('tensor', None)])
  with pytest.raises(ValueError, match=r'bias shape \(4,\).*16 output'):
    run_in_tensor_map(row, x, k, np.ones(D),
                      specs=[P(None, 'tensor'), P('tensor', None), P('tensor')])


def test_sequence_parallel_errors():
  k = np.ones((D, F))
  col = lambda x, k: tp.column_parallel_linear(x, k, sequence_parallel=True)
  with pytest.raises(ValueError, match=r'sharded along the sequence.*'
                     'replicated'):
    run_in_tensor_map(col, np.ones((B, S, D)), k,
                      specs=[REP, P(None, 'tensor')])
  row = lambda x, k: tp.row_parallel_linear(x, k, sequence_parallel=True)
  with pytest.raises(ValueError, match=r'outputs \[..., S, d\] to scatter'):
    run_in_tensor_map(row, np.ones(F), np.ones((F, D)),
                      specs=[P('tensor'), P('tensor', None)])
  with pytest.raises(ValueError, match='sequence length 6 is not divisible by '
                     '4'):
    run_in_tensor_map(row, np.ones((B, 6, F)), np.ones((F, D)),
                      specs=[P(None, None, 'tensor'), P('tensor', None)])


def test_attention_shape_errors_list_every_mismatch():
  params = attention_params(np.random.default_rng(18))
  params['out']['kernel'] = params['out']['kernel'][:, :1]   # head_dim 1 != 2
  params['key']['bias'] = params['key']['bias'][:, :1]
  mesh = mesh_of(4)
  specs = tp.param_specs(params, rules=RULES)
  attn = jax.shard_map(tp.parallel_self_attention, mesh=mesh,
                       in_specs=(specs, REP), out_specs=REP)
  with pytest.raises(ValueError) as err:
    attn(tp.shard_params(params, mesh=mesh, rules=RULES),
         put(mesh, np.ones((B, S, D)), REP))
  msg = str(err.value)
  for part in ('for 2 local heads (of 8 over 4 devices) of size 2',
               "params['key']['bias'] has shape (2, 1), expected (2, 2)",
               "params['out']['kernel'] has shape (2, 1, 16), expected "
               '(2, 2, 16)'):
    assert part in msg, msg


def test_vocab_errors():
  with pytest.raises(TypeError, match='labels must be integers'):
    run_in_tensor_map(tp.vocab_parallel_cross_entropy, np.ones((2, V)),
                      np.ones(2), specs=[P(None, 'tensor'), REP])
  with pytest.raises(ValueError, match=r'labels \(3,\) must have the shape of '
                     r'logits \(2, 8\)'):
    run_in_tensor_map(tp.vocab_parallel_cross_entropy, np.ones((2, V)),
                      np.ones(3, np.int32), specs=[P(None, 'tensor'), REP])
  with pytest.raises(TypeError, match='ids must be integers'):
    run_in_tensor_map(tp.vocab_parallel_embed, np.ones(2), np.ones((V, D)),
                      specs=[REP, P('tensor', None)])


def test_nnx_module_sizes_are_ints():
  layer = tp.ColumnParallelLinear(np.int64(4), np.int32(8), rngs=nnx.Rngs(0))
  assert layer.kernel.shape == (4, 8) and type(layer.in_features) is int
  with pytest.raises(TypeError, match='out_features=True must be an int'):
    tp.RowParallelLinear(4, True, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r'num_heads=2.0 must be an int'):
    tp.ParallelSelfAttention(D, 2.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='hidden_features=0 must be an int >= 1'):
    tp.ParallelMLP(D, 0, rngs=nnx.Rngs(0))


def test_nnx_module_errors():
  with pytest.raises(ValueError, match='features 16 is not divisible by '
                     'num_heads 6'):
    tp.ParallelSelfAttention(D, 6, rngs=nnx.Rngs(0))
  # The checks run while tracing: abstract modules and inputs suffice.
  def traced(module, x_shape):
    """Traces the module called on replicated (unsplit) params."""
    graphdef, state = nnx.split(nnx.eval_shape(module))
    call = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x),
                         mesh=mesh_of(4), out_specs=REP,
                         in_specs=(jax.tree.map(lambda _: REP, state), REP))
    jax.eval_shape(call, state, jax.ShapeDtypeStruct(x_shape, jnp.float32))
  with pytest.raises(ValueError, match='num_heads 6 is not divisible by the '
                     'tensor axis size 4'):
    traced(lambda: tp.ParallelSelfAttention(D, 6, head_dim=2,
                                            rngs=nnx.Rngs(0)), (B, S, D))
  with pytest.raises(ValueError, match=r'kernel shard has shape \(16, 32\), '
                     r'expected \(16, 8\).*shard_params'):
    traced(lambda: tp.ColumnParallelLinear(D, F, rngs=nnx.Rngs(0)), (B, D))
