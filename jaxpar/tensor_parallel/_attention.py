"""Self-attention with the heads split over the tensor axis, and the block.

A self-attention splits its heads over the ``tensor`` axis: query, key and
value projections are column-parallel (``[d, H/N, k]`` per device), the
output projection row-parallel (``[H/N, k, d]``), so the whole layer costs one
all-reduce forward and one backward, like the MLP of ``layers``.
``transformer_block`` chains norm, attention, norm and MLP (pre-norm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.tensor_parallel import _checks
from jaxpar.tensor_parallel import _collectives
from jaxpar.tensor_parallel._checks import Params
from jaxpar.tensor_parallel import _layers as layers
from jaxpar.tensor_parallel._layers import layer_norm, parallel_mlp


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                          *, causal: bool = False) -> jax.Array:
  """``softmax(q k^T / sqrt(k)) v`` per head: the attention core.

  ``jax.nn.dot_product_attention`` (cuDNN / flash kernels on GPU), except in
  float64: JAX's core runs the softmax in float32 whatever the input dtype
  (jax 0.10, ``_dot_product_attention_core``), 1e-7 off float64, so float64
  takes the same maths in einsums to stay exact to ~1e-10.

  Args:
    query: ``[..., T, H, k]``.
    key: ``[..., S, H, k]``.
    value: ``[..., S, H, k]``.
    causal: mask keys after each query position (``T == S``).

  Returns:
    ``[..., T, H, k]``, the dtype of ``query``.

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> q = k = v = jnp.ones((2, 8, 4, 16))      # [B, S, heads, head_dim]
    >>> core = jaxpar.tensor_parallel.dot_product_attention
    >>> core(q, k, v, causal=True).shape
    (2, 8, 4, 16)
  """
  if query.dtype == jnp.float64:
    scores = jnp.einsum('...qhk,...shk->...hqs', query, key)
    scores = scores / jnp.sqrt(query.shape[-1]).astype(scores.dtype)
    if causal:
      keep = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), bool))
      scores = jnp.where(keep, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum('...hqs,...shk->...qhk', probs, value)
  # jax.nn takes [B, T, H, k]: fold any leading dims into one batch dim.
  lead = query.shape[:-3]
  fold = lambda a: a.reshape((-1,) + a.shape[-3:])
  out = jax.nn.dot_product_attention(fold(query), fold(key), fold(value),
                                     is_causal=causal)
  return out.reshape(lead + out.shape[-3:])


def parallel_self_attention(params: Params, x: jax.Array, *,
                            tensor_axis: str = 'tensor', causal: bool = False,
                            sequence_parallel: bool = False) -> jax.Array:
  """Multi-head self-attention with the heads split over ``tensor_axis``.

  With ``H`` heads of size ``k``, device ``r`` holds heads
  ``r*H/N .. (r+1)*H/N - 1``: the query/key/value kernels ``[d, H/N, k]``
  (and biases ``[H/N, k]``) are column-parallel, the output kernel
  ``[H/N, k, d]`` row-parallel. Per head, as ``nnx.MultiHeadAttention``::

    q, k, v = x Wq + bq, x Wk + bk, x Wv + bv            # [..., S, H/N, k]
    a = softmax(q k^T / sqrt(k) [masked: key pos > query pos if causal])
    y = sum over heads (a v) Wo + bo                     # one psum

  Communication, forward / backward: one all-reduce of ``[..., S, d]`` / one
  all-reduce of ``dx``; with ``sequence_parallel`` an all-gather + a
  reduce-scatter each way instead (plus an all-reduce of ``dbo``).

  Args:
    params: ``{'query'|'key'|'value': {'kernel': [d, H/N, k], 'bias':
      [H/N, k]}, 'out': {'kernel': [H/N, k, d], 'bias': [d]}}`` local shards
      (the params of ``nnx.MultiHeadAttention``); biases optional.
    x: ``[..., S, d]`` replicated, or ``[..., S/N, d]`` with
      ``sequence_parallel``.
    tensor_axis: the tensor-parallel mesh axis.
    causal: mask keys after each query position.
    sequence_parallel: ``x`` and the result are sequence shards.

  Returns:
    Same shape as ``x``: replicated, or this device's sequence shard.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> tp = jaxpar.tensor_parallel
    >>> dense = nnx.MultiHeadAttention(num_heads=4, in_features=16,
    ...                                decode=False, rngs=nnx.Rngs(0))
    >>> params = nnx.to_pure_dict(nnx.state(dense, nnx.Param))
    >>> rules = {r'(query|key|value)/(kernel|bias)': ('tensor', None),
    ...          r'out/kernel': ('tensor', None, None)}    # split by heads
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> specs = tp.param_specs(params, rules=rules)
    >>> attn = jax.jit(jax.shard_map(tp.parallel_self_attention, mesh=mesh,
    ...                              in_specs=(specs, P()), out_specs=P()))
    >>> x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    >>> y = attn(tp.shard_params(params, mesh=mesh, rules=rules), x)
    >>> bool(jnp.allclose(y, dense(x), atol=1e-5))
    True
  """
  fn = 'parallel_self_attention'
  n = _checks.bound_axis_size(tensor_axis, fn)
  params = _checks.as_arrays(params, fn)
  wq = params['query']['kernel']
  if wq.ndim != 3 or x.ndim < 2 or x.shape[-1] != wq.shape[0]:
    raise ValueError(
        f'{fn}: x {tuple(x.shape)} [..., S, d] and query kernel shard '
        f'{tuple(wq.shape)} [d, H/N, head_dim] do not fit.')
  _, heads, head_dim = wq.shape
  d = wq.shape[0]
  want = {'query': ((d, heads, head_dim), (heads, head_dim)),
          'key': ((d, heads, head_dim), (heads, head_dim)),
          'value': ((d, heads, head_dim), (heads, head_dim)),
          'out': ((heads, head_dim, d), (d,))}
  wrong = [f"params['{name}']['{leaf}'] has shape {tuple(p[leaf].shape)}, "
           f'expected {shape}'
           for name, shapes in want.items() if (p := params[name]) is not None
           for leaf, shape in zip(('kernel', 'bias'), shapes)
           if p.get(leaf) is not None and tuple(p[leaf].shape) != shape]
  if wrong:
    raise ValueError(
        f'{fn}: for {heads} local heads (of {heads * n} over {n} devices) of '
        f'size {head_dim} and d={d}:\n  ' + '\n  '.join(wrong))
  for name in want:
    spec = (f'P({tensor_axis!r}, None, None)' if name == 'out' else
            f'P(None, {tensor_axis!r}, None)')
    _checks.check_sharded(params[name]['kernel'], tensor_axis, fn,
                          f"params['{name}']['kernel']", spec)
  if sequence_parallel:
    _checks.check_sequence_sharded(x, tensor_axis, n, fn)
    x = _collectives.gather_sequence(x, tensor_axis)

  def project(name):
    y = jnp.einsum('...sd,dhk->...shk', x, params[name]['kernel'])
    bias = params[name].get('bias')
    return y if bias is None else y + bias

  heads_out = dot_product_attention(project('query'), project('key'),
                                    project('value'), causal=causal)
  partial = jnp.einsum('...qhk,hkd->...qd', heads_out, params['out']['kernel'])
  return _collectives.reduce_partial(partial, params['out'].get('bias'),
                                     tensor_axis, sequence_parallel, fn)


def transformer_block(params: Params, x: jax.Array, *,
                      tensor_axis: str = 'tensor',
                      causal: bool = True, sequence_parallel: bool = False,
                      dropout: float = 0.0,
                      key: jax.Array | None = None) -> jax.Array:
  """Pre-norm transformer block with tensor-parallel attention and MLP.

  ``h = x + drop(attn(ln1(x))); y = h + drop(mlp(ln2(h)))`` (GELU MLP;
  ``drop`` is ``layers.dropout`` at rate ``dropout`` with the two halves of
  ``key``, the identity without a key). Forward
  communication: two all-reduces; with ``sequence_parallel`` two all-gathers
  and two reduce-scatters and no all-reduce (the norms and residuals run on
  sequence shards). The backward mirrors it, plus (with
  ``sequence_parallel``) all-reduces of the gradients of the replicated
  parameters used on sequence shards (norms, output biases).

  Args:
    params: ``{'ln1': norm, 'attn': attention, 'ln2': norm, 'mlp': mlp}``
      with the params of ``layer_norm``, ``parallel_self_attention`` and
      ``parallel_mlp`` (those of ``jaxpar.models.gpt.Block``);
      ``param_specs`` with ``rules=jaxpar.models.gpt.TENSOR_RULES`` gives
      the matching specs.
    x: ``[..., S, d]`` replicated, or ``[..., S/N, d]`` with
      ``sequence_parallel``.
    tensor_axis: the tensor-parallel mesh axis.
    causal: causal self-attention.
    sequence_parallel: ``x`` and the result are sequence shards.
    dropout: residual dropout rate in ``[0, 1)``.
    key: PRNG key of the dropout masks, the same on every device of
      ``tensor_axis``; ``None``: no dropout.

  Returns:
    Same shape as ``x``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> tp, gpt = jaxpar.tensor_parallel, jaxpar.models.gpt
    >>> dense = gpt.Block(gpt.GPTConfig(d_model=16), rngs=nnx.Rngs(0))
    >>> params = nnx.to_pure_dict(nnx.state(dense, nnx.Param))
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> seq = P(None, 'tensor', None)            # [B, S/4, d] on each device
    >>> specs = tp.param_specs(params, rules=gpt.TENSOR_RULES)
    >>> block = jax.jit(jax.shard_map(
    ...     lambda p, x: tp.transformer_block(p, x, sequence_parallel=True),
    ...     mesh=mesh, in_specs=(specs, seq), out_specs=seq))
    >>> x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    >>> x_seq = jax.device_put(x, jax.NamedSharding(mesh, seq))
    >>> y = block(tp.shard_params(params, mesh=mesh, rules=gpt.TENSOR_RULES),
    ...           x_seq)
    >>> bool(jnp.allclose(y, dense(x), atol=1e-5))
    True
  """
  params = _checks.as_arrays(params, 'transformer_block')
  keys = (None, None) if key is None else jax.random.split(key)
  drop = lambda y, k: layers.dropout(y, dropout, k, tensor_axis=tensor_axis,
                                     sequence_parallel=sequence_parallel)
  h = x + drop(parallel_self_attention(
      params['attn'], layer_norm(params['ln1'], x), tensor_axis=tensor_axis,
      causal=causal, sequence_parallel=sequence_parallel), keys[0])
  return h + drop(parallel_mlp(
      params['mlp'], layer_norm(params['ln2'], h), tensor_axis=tensor_axis,
      sequence_parallel=sequence_parallel), keys[1])
