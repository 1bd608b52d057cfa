"""Tensor (Megatron) parallelism: layers sharded over the ``tensor`` mesh axis.

The functions of the first half run *inside* ``jax.shard_map`` over a mesh
with a ``tensor`` axis of size ``N`` and receive the local shards of their
parameters; activations are replicated over the axis (or, with
``sequence_parallel=True``, sharded along the sequence). They follow Shoeybi
et al. 2019 (Megatron-LM) and Korthikanti et al. 2022 (sequence parallelism):

* a *column*-parallel linear holds ``kernel[:, cols]``, ``[in, out/N]``: its
  output is sharded over features and needs no communication;
* a *row*-parallel linear holds ``kernel[rows, :]``, ``[in/N, out]``: each
  device computes a partial sum, one all-reduce (``psum``) finishes it;
* an MLP (column -> activation -> row) or a self-attention (heads split over
  the axis, then the row-parallel output projection) thus costs exactly one
  all-reduce forward. In the backward the conjugate operators swap: the
  input gradient of the column layer needs one all-reduce (Megatron's ``f``),
  the row layer's ``psum`` transposes to the identity (Megatron's ``g``);
* with sequence parallelism the activations between layers (norms,
  residuals) are sharded along the sequence: the all-reduce becomes an
  all-gather before the column layer plus a reduce-scatter after the row
  layer, the same bytes on a ring. Their transposes swap again in the backward.

All of this relies on ``shard_map``'s ``check_vma=True`` (the default): the
replicated-vs-sharded type of each value makes ``jax.grad`` insert exactly the
backward collectives above, so gradients w.r.t. replicated inputs equal the
dense ones (not ``N`` times them) and gradients w.r.t. the local shards are the
slices of the dense gradient. The layers check that their kernels really vary
over the axis, which fails loudly under ``check_vma=False``.

The second half maps dense parameter pytrees (e.g. ``nnx.split`` of a Flax
model) to their ``PartitionSpec`` trees and places them (``param_specs``,
``shard_params``, ``unshard_params``), and wraps the layers as Flax NNX
modules. Parameter pytrees use Flax's names: ``{'kernel', 'bias'}`` per
linear, ``{'scale', 'bias'}`` per norm, ``{'query', 'key', 'value', 'out'}``
projections laid out like ``nnx.MultiHeadAttention``.

Example:
  >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
  >>> specs = tensor_parallel.param_specs(params)      # dense MLP params
  >>> params = tensor_parallel.shard_params(params, mesh=mesh)
  >>> mlp = jax.shard_map(tensor_parallel.parallel_mlp, mesh=mesh,
  ...                     in_specs=(specs, P()), out_specs=P())
  >>> y = jax.jit(mlp)(params, x)                     # == dense MLP(x)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.mesh import axis_size as _mesh_axis_size

PyTree = Any
Params = Mapping[str, Any]

# ---------------------------------------------------------------------------
# Checks shared by the layers (they run while tracing, before any compute).


def _axis_size(axis: str, fn: str) -> int:
  try:
    return jax.lax.axis_size(axis)
  except NameError:
    raise ValueError(
        f'{fn}: mesh axis {axis!r} is not bound here. Call it inside '
        f'jax.shard_map over a mesh with that axis (e.g. '
        f"jaxpar.make_mesh(tensor=N)), or pass axis=<the mesh's tensor axis "
        'name>.') from None


def _check_sharded(a: jax.Array, axis: str, fn: str, what: str,
                   spec: str) -> None:
  """A parameter shard must vary over ``axis`` (else every device holds the
  same slice, or shard_map runs with check_vma=False and grads go wrong)."""
  if axis not in jax.typeof(a).mat.varying:
    raise ValueError(
        f'{fn}: {what} {tuple(a.shape)} is not sharded over {axis!r}. Pass it '
        f'through jax.shard_map with in_specs {spec} (see '
        'tensor_parallel.param_specs), and keep check_vma=True (the default): '
        'the layers need it for exact gradients.')


def _check_sequence_sharded(x: jax.Array, axis: str, n: int, fn: str) -> None:
  if x.ndim < 2:
    raise ValueError(
        f'{fn}: sequence_parallel=True needs x of shape [..., S/{n}, d], got '
        f'{tuple(x.shape)}.')
  if axis not in jax.typeof(x).mat.varying:
    raise ValueError(
        f'{fn}: sequence_parallel=True needs x {tuple(x.shape)} sharded along '
        f'the sequence (dim -2) over {axis!r}, e.g. in_specs P(None, {axis!r}, '
        'None) for [B, S, d]; it is replicated. Pass sequence_parallel=False '
        'for replicated activations.')


def _check_scatter(y: jax.Array, n: int, fn: str) -> None:
  if y.ndim < 2:
    raise ValueError(
        f'{fn}: sequence_parallel=True needs outputs [..., S, d] to scatter '
        f'along the sequence, got {tuple(y.shape)}.')
  if y.shape[-2] % n:
    raise ValueError(
        f'{fn}: sequence_parallel=True reduce-scatters the sequence (dim -2 of '
        f'{tuple(y.shape)}) over {n} devices; sequence length {y.shape[-2]} '
        f'is not divisible by {n}. Pad the sequence to a multiple of {n}.')


def _check_bias(bias: jax.Array | None, size: int, fn: str,
                hint: str) -> None:
  if bias is not None and tuple(bias.shape) != (size,):
    raise ValueError(
        f'{fn}: bias shape {tuple(bias.shape)} does not match the {size} '
        f'output features of the kernel; {hint}.')


def _arrays(params: Params) -> Params:
  """An ``nnx.State`` (from ``nnx.split``) as nested dicts of arrays."""
  return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


# Collectives. Each forward collective's transpose is the backward one that
# Megatron prescribes; jax.grad derives it from the check_vma types.


def _gather_sequence(x: jax.Array, axis: str) -> jax.Array:
  """[..., S/N, d] sequence shard -> [..., S, d] (backward: reduce-scatter)."""
  return jax.lax.all_gather(x, axis, axis=x.ndim - 2, tiled=True)


def _reduce(partial: jax.Array, bias: jax.Array | None, axis: str,
            sequence_parallel: bool, fn: str) -> jax.Array:
  """Sums per-device partial outputs, then adds the (replicated) bias once.

  ``psum`` -> replicated ``[..., S, d]`` (backward: identity), or with
  ``sequence_parallel`` ``psum_scatter`` over the sequence -> ``[..., S/N, d]``
  (backward: all-gather).
  """
  if sequence_parallel:
    _check_scatter(partial, _axis_size(axis, fn), fn)
    y = jax.lax.psum_scatter(partial, axis, scatter_dimension=partial.ndim - 2,
                             tiled=True)
  else:
    y = jax.lax.psum(partial, axis)
  return y if bias is None else y + bias


# ---------------------------------------------------------------------------
# Layers, used inside shard_map on local shards.


def column_parallel_linear(x: jax.Array, kernel: jax.Array,
                           bias: jax.Array | None = None, *,
                           axis: str = 'tensor', gather_output: bool = False,
                           sequence_parallel: bool = False) -> jax.Array:
  """``y = x @ kernel + bias`` with the kernel split by output columns.

  Device ``r`` of the ``N`` along ``axis`` holds ``kernel[:, r*o:(r+1)*o]``
  and ``bias[r*o:(r+1)*o]`` with ``o = out/N`` (``in_specs
  P(None, axis)`` and ``P(axis)``), and computes those output features.

  Communication, forward / backward: none / one all-reduce of ``dx``
  (``[..., in]``). With ``gather_output``: plus an all-gather of ``y`` /
  nothing (the backward just slices). With ``sequence_parallel``: an
  all-gather of the ``x`` sequence shards / a reduce-scatter of ``dx``.

  Args:
    x: ``[..., in]`` replicated over ``axis``; with ``sequence_parallel``,
      ``[..., S/N, in]``, this device's sequence shard.
    kernel: local shard ``[in, out/N]``.
    bias: local shard ``[out/N]`` or ``None``.
    axis: the tensor-parallel mesh axis.
    gather_output: all-gather the output features, returning the replicated
      ``[..., out]`` instead of the shard ``[..., out/N]``.
    sequence_parallel: ``x`` is sharded along the sequence (dim -2) and is
      all-gathered first.

  Returns:
    ``[..., out/N]`` (``[..., S, out/N]`` with ``sequence_parallel``), or the
    full ``[..., out]`` with ``gather_output``.

  Example:
    >>> f = jax.shard_map(column_parallel_linear, mesh=mesh,
    ...                   in_specs=(P(), P(None, 'tensor'), P('tensor')),
    ...                   out_specs=P(None, 'tensor'))
    >>> f(x, kernel, bias)    # == x @ kernel + bias
  """
  fn = 'column_parallel_linear'
  n = _axis_size(axis, fn)
  if kernel.ndim != 2 or x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(
        f'{fn}: x {tuple(x.shape)} and kernel shard {tuple(kernel.shape)} do '
        'not fit: the kernel shard must be [in, out/N] with in = '
        'x.shape[-1].')
  _check_sharded(kernel, axis, fn, 'kernel', f'P(None, {axis!r})')
  _check_bias(bias, kernel.shape[1], fn,
              f'shard the bias like the kernel columns, in_specs P({axis!r})')
  if bias is not None:
    _check_sharded(bias, axis, fn, 'bias', f'P({axis!r})')
  if sequence_parallel:
    _check_sequence_sharded(x, axis, n, fn)
    x = _gather_sequence(x, axis)
  y = x @ kernel
  if bias is not None:
    y = y + bias
  if gather_output:
    # Invariant result: its transpose slices this device's columns instead of
    # reduce-scattering N identical copies (which would scale grads by N).
    y = jax.lax.all_gather(y, axis, axis=y.ndim - 1, tiled=True,
                           to='invarying')
  return y


def row_parallel_linear(x: jax.Array, kernel: jax.Array,
                        bias: jax.Array | None = None, *,
                        axis: str = 'tensor', input_is_parallel: bool = True,
                        sequence_parallel: bool = False) -> jax.Array:
  """``y = x @ kernel + bias`` with the kernel split by input rows.

  Device ``r`` holds ``kernel[r*i:(r+1)*i, :]`` with ``i = in/N``
  (``in_specs P(axis, None)``) and the matching input features
  ``x[..., r*i:(r+1)*i]``; ``psum`` adds the ``N`` partial products and the
  replicated ``bias`` is added once, after the sum.

  Communication, forward / backward: one all-reduce of ``y`` (``[..., out]``)
  / none. With ``sequence_parallel``: a reduce-scatter of ``y`` along the
  sequence / an all-gather of ``dy``. With ``input_is_parallel=False``: plus,
  in the backward, an all-reduce of the zero-padded ``dx``.

  Args:
    x: ``[..., in/N]``, the column-parallel features of this device; with
      ``input_is_parallel=False`` the replicated ``[..., in]``, of which this
      device takes its slice.
    kernel: local shard ``[in/N, out]``.
    bias: replicated ``[out]`` or ``None``.
    axis: the tensor-parallel mesh axis.
    input_is_parallel: whether ``x`` is already split over ``axis``.
    sequence_parallel: reduce-scatter the result along the sequence (dim -2)
      instead of all-reducing it.

  Returns:
    ``[..., out]`` replicated over ``axis``; with ``sequence_parallel``,
    ``[..., S/N, out]``, this device's sequence shard.

  Example:
    >>> f = jax.shard_map(row_parallel_linear, mesh=mesh,
    ...                   in_specs=(P(None, 'tensor'), P('tensor', None), P()),
    ...                   out_specs=P())
    >>> f(x, kernel, bias)    # == x @ kernel + bias
  """
  fn = 'row_parallel_linear'
  n = _axis_size(axis, fn)
  if kernel.ndim != 2 or x.ndim < 1:
    raise ValueError(f'{fn}: need x [..., in/N] and a kernel shard '
                     f'[in/N, out], got {tuple(x.shape)} and '
                     f'{tuple(kernel.shape)}.')
  rows = kernel.shape[0]
  want = rows if input_is_parallel else n * rows
  if x.shape[-1] != want:
    hint = ''
    if input_is_parallel and x.shape[-1] == n * rows:
      hint = ' x looks replicated: pass input_is_parallel=False.'
    raise ValueError(
        f'{fn}: x has {x.shape[-1]} input features but the kernel shard '
        f'{tuple(kernel.shape)} on {n} devices expects {want} '
        f'(input_is_parallel={input_is_parallel}).{hint}')
  _check_sharded(kernel, axis, fn, 'kernel', f'P({axis!r}, None)')
  _check_bias(bias, kernel.shape[1], fn, f'pass the full, replicated bias '
              f'[{kernel.shape[1]}] with in_specs P()')
  if not input_is_parallel:
    start = jax.lax.axis_index(axis) * rows
    x = jax.lax.dynamic_slice_in_dim(x, start, rows, axis=x.ndim - 1)
  return _reduce(x @ kernel, bias, axis, sequence_parallel, fn)


def parallel_mlp(params: Params, x: jax.Array, *, axis: str = 'tensor',
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
                 sequence_parallel: bool = False) -> jax.Array:
  """Megatron MLP ``act(x @ W1 + b1) @ W2 + b2``: column then row parallel.

  ``W1 [d, f]`` is split by columns and ``W2 [f, d]`` by rows, so the hidden
  activation ``[..., f/N]`` never leaves its device. Communication, forward /
  backward: one all-reduce of ``[..., d]`` / one all-reduce of ``dx``; with
  ``sequence_parallel`` an all-gather + a reduce-scatter each way instead
  (plus, in the backward, an all-reduce of ``db2``, used on sequence shards).

  Args:
    params: ``{'fc_in': {'kernel': [d, f/N], 'bias': [f/N]}, 'fc_out':
      {'kernel': [f/N, d], 'bias': [d]}}`` local shards (dicts of arrays or
      an ``nnx.State``); biases optional.
    x: ``[..., d]`` replicated, or ``[..., S/N, d]`` with
      ``sequence_parallel``.
    axis: the tensor-parallel mesh axis.
    activation: elementwise nonlinearity (default ``jax.nn.gelu``).
    sequence_parallel: ``x`` and the result are sequence shards.

  Returns:
    Same shape as ``x``: replicated, or this device's sequence shard.

  Example:
    >>> mlp = jax.shard_map(parallel_mlp, mesh=mesh,
    ...                     in_specs=(param_specs(params), P()), out_specs=P())
  """
  params = _arrays(params)
  fc_in, fc_out = params['fc_in'], params['fc_out']
  h = column_parallel_linear(x, fc_in['kernel'], fc_in.get('bias'), axis=axis,
                             sequence_parallel=sequence_parallel)
  return row_parallel_linear(activation(h), fc_out['kernel'],
                             fc_out.get('bias'), axis=axis,
                             sequence_parallel=sequence_parallel)


def parallel_self_attention(params: Params, x: jax.Array, *,
                            axis: str = 'tensor', causal: bool = False,
                            sequence_parallel: bool = False) -> jax.Array:
  """Multi-head self-attention with the heads split over ``axis``.

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
      (the layout of ``nnx.MultiHeadAttention``); biases optional.
    x: ``[..., S, d]`` replicated, or ``[..., S/N, d]`` with
      ``sequence_parallel``.
    axis: the tensor-parallel mesh axis.
    causal: mask keys after each query position.
    sequence_parallel: ``x`` and the result are sequence shards.

  Returns:
    Same shape as ``x``: replicated, or this device's sequence shard.

  Example:
    >>> attn = jax.shard_map(
    ...     functools.partial(parallel_self_attention, causal=True), mesh=mesh,
    ...     in_specs=(param_specs(params), P()), out_specs=P())
  """
  fn = 'parallel_self_attention'
  n = _axis_size(axis, fn)
  params = _arrays(params)
  wq = params['query']['kernel']
  if wq.ndim != 3 or x.ndim < 2 or x.shape[-1] != wq.shape[0]:
    raise ValueError(
        f'{fn}: x {tuple(x.shape)} [..., S, d] and query kernel shard '
        f'{tuple(wq.shape)} [d, H/N, head_dim] do not fit.')
  _, heads, head_dim = wq.shape
  want = {'query': (wq.shape, (heads, head_dim)),
          'key': (wq.shape, (heads, head_dim)),
          'value': (wq.shape, (heads, head_dim)),
          'out': ((heads, head_dim, wq.shape[0]), (wq.shape[0],))}
  for name, (kernel_shape, bias_shape) in want.items():
    p = params[name]
    for leaf, shape in (('kernel', kernel_shape), ('bias', bias_shape)):
      if p.get(leaf) is not None and tuple(p[leaf].shape) != tuple(shape):
        raise ValueError(
            f"{fn}: params['{name}']['{leaf}'] has shape "
            f'{tuple(p[leaf].shape)}, expected {tuple(shape)} for {heads} '
            f'local heads (of {heads * n} over {n} devices) of size '
            f'{head_dim}.')
    spec = (f'P({axis!r}, None, None)' if name == 'out' else
            f'P(None, {axis!r}, None)')
    _check_sharded(p['kernel'], axis, fn, f"params['{name}']['kernel']", spec)
  if sequence_parallel:
    _check_sequence_sharded(x, axis, n, fn)
    x = _gather_sequence(x, axis)

  def project(name):
    y = jnp.einsum('...sd,dhk->...shk', x, params[name]['kernel'])
    bias = params[name].get('bias')
    return y if bias is None else y + bias

  q = project('query') / jnp.sqrt(head_dim).astype(x.dtype)
  scores = jnp.einsum('...qhk,...shk->...hqs', q, project('key'))
  if causal:
    seq = x.shape[-2]
    keep = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
    scores = jnp.where(keep, scores, jnp.finfo(scores.dtype).min)
  probs = jax.nn.softmax(scores, axis=-1)
  heads_out = jnp.einsum('...hqs,...shk->...qhk', probs, project('value'))
  partial = jnp.einsum('...qhk,hkd->...qd', heads_out, params['out']['kernel'])
  return _reduce(partial, params['out'].get('bias'), axis, sequence_parallel,
                 fn)


def layer_norm(params: Params, x: jax.Array, *,
               epsilon: float = 1e-6) -> jax.Array:
  """``(x - mean) / sqrt(var + epsilon) * scale + bias`` over the last axis.

  Local (no communication): with sequence parallelism each device normalises
  its own sequence shard. Same parameters and default ``epsilon`` as
  ``nnx.LayerNorm``.

  Args:
    params: ``{'scale': [d], 'bias': [d]}`` (replicated), either optional.
    x: ``[..., d]``.
    epsilon: added to the variance.

  Returns:
    ``[..., d]``.

  Example:
    >>> layer_norm({'scale': jnp.ones(4), 'bias': jnp.zeros(4)}, x)
  """
  params = _arrays(params)
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + epsilon)
  if params.get('scale') is not None:
    y = y * params['scale']
  if params.get('bias') is not None:
    y = y + params['bias']
  return y


def transformer_block(params: Params, x: jax.Array, *, axis: str = 'tensor',
                      causal: bool = True,
                      sequence_parallel: bool = False) -> jax.Array:
  """Pre-norm transformer block with tensor-parallel attention and MLP.

  ``h = x + attn(ln1(x)); y = h + mlp(ln2(h))`` (GELU MLP). Forward
  communication: two all-reduces; with ``sequence_parallel`` two all-gathers
  and two reduce-scatters and no all-reduce (the norms and residuals run on
  sequence shards). The backward mirrors it, plus (with
  ``sequence_parallel``) all-reduces of the gradients of the replicated
  parameters used on sequence shards (norms, output biases).

  Args:
    params: ``{'ln1': norm, 'attn': attention, 'ln2': norm, 'mlp': mlp}``
      with the layouts of ``layer_norm``, ``parallel_self_attention`` and
      ``parallel_mlp``; ``param_specs`` gives the matching specs.
    x: ``[..., S, d]`` replicated, or ``[..., S/N, d]`` with
      ``sequence_parallel``.
    axis: the tensor-parallel mesh axis.
    causal: causal self-attention.
    sequence_parallel: ``x`` and the result are sequence shards.

  Returns:
    Same shape as ``x``.

  Example:
    >>> block = jax.shard_map(
    ...     functools.partial(transformer_block, sequence_parallel=True),
    ...     mesh=mesh, in_specs=(param_specs(params), P(None, 'tensor')),
    ...     out_specs=P(None, 'tensor'))
  """
  params = _arrays(params)
  h = x + parallel_self_attention(
      params['attn'], layer_norm(params['ln1'], x), axis=axis, causal=causal,
      sequence_parallel=sequence_parallel)
  return h + parallel_mlp(params['mlp'], layer_norm(params['ln2'], h),
                          axis=axis, sequence_parallel=sequence_parallel)


def vocab_parallel_embed(ids: jax.Array, table: jax.Array, *,
                         axis: str = 'tensor',
                         sequence_parallel: bool = False) -> jax.Array:
  """Embedding lookup ``table[ids]`` with the vocabulary split over ``axis``.

  Device ``r`` holds rows ``r*V/N .. (r+1)*V/N - 1`` (``in_specs
  P(axis, None)``), looks up the ids in its range, zeros the others and one
  all-reduce (with ``sequence_parallel``: a reduce-scatter along the
  sequence) combines them. The backward needs no communication: each device
  scatter-adds into its own rows. Ids must lie in ``[0, V)``; others embed to
  zeros.

  Args:
    ids: integer ``[...]`` (``[..., S]`` with ``sequence_parallel``),
      replicated.
    table: local shard ``[V/N, d]``.
    axis: the tensor-parallel mesh axis.
    sequence_parallel: return this device's sequence shard.

  Returns:
    ``[..., d]`` replicated, or ``[..., S/N, d]`` with ``sequence_parallel``.

  Example:
    >>> embed = jax.shard_map(vocab_parallel_embed, mesh=mesh,
    ...                       in_specs=(P(), P('tensor', None)), out_specs=P())
  """
  fn = 'vocab_parallel_embed'
  _axis_size(axis, fn)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f'{fn}: ids must be integers, got {ids.dtype}.')
  if table.ndim != 2:
    raise ValueError(f'{fn}: table shard must be [V/N, d], got '
                     f'{tuple(table.shape)}.')
  _check_sharded(table, axis, fn, 'table', f'P({axis!r}, None)')
  rows = table.shape[0]
  local = ids - jax.lax.axis_index(axis) * rows
  mine = (local >= 0) & (local < rows)
  vectors = jnp.take(table, jnp.where(mine, local, 0), axis=0)
  vectors = jnp.where(mine[..., None], vectors, jnp.zeros((), table.dtype))
  return _reduce(vectors, None, axis, sequence_parallel, fn)


def vocab_parallel_cross_entropy(logits: jax.Array, labels: jax.Array, *,
                                 axis: str = 'tensor') -> jax.Array:
  """Softmax cross-entropy over logits split by vocabulary, never gathered.

  With device ``r`` holding ``logits[..., r*V/N:(r+1)*V/N]``::

    m      = pmax(max_v logits)                # all-reduce (max), no grad
    loss   = log psum(sum_v exp(logits - m)) - psum(logit[label] - m)

  The two sums travel in one all-reduce (sum), so the forward costs two small
  all-reduces of ``[...]``-shaped values and the backward none
  (``softmax - onehot`` on the local shard). Shifting by the global max keeps
  it finite for logits of any size. Equals
  ``optax.losses.softmax_cross_entropy_with_integer_labels`` on the gathered
  logits, gradients included.

  Args:
    logits: local shard ``[..., V/N]`` (e.g. from ``column_parallel_linear``
      of the LM head).
    labels: integer ``[...]`` in ``[0, V)``, replicated.
    axis: the tensor-parallel mesh axis.

  Returns:
    per-example loss ``[...]``, replicated.

  Example:
    >>> xent = jax.shard_map(vocab_parallel_cross_entropy, mesh=mesh,
    ...                      in_specs=(P(None, 'tensor'), P()), out_specs=P())
    >>> loss = xent(logits, labels).mean()
  """
  fn = 'vocab_parallel_cross_entropy'
  _axis_size(axis, fn)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f'{fn}: labels must be integers, got {labels.dtype}.')
  if logits.ndim < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
    raise ValueError(
        f'{fn}: labels {tuple(labels.shape)} must have the shape of logits '
        f'{tuple(logits.shape)} without its last (vocabulary) axis.')
  _check_sharded(logits, axis, fn, 'logits',
                 f'P(..., {axis!r}) (split over the last axis)')
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  vocab = logits.shape[-1]
  m = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), axis)
  shifted = logits - m[..., None]
  local = labels - jax.lax.axis_index(axis) * vocab
  mine = (local >= 0) & (local < vocab)
  target = jnp.take_along_axis(shifted, jnp.where(mine, local, 0)[..., None],
                               axis=-1)[..., 0]
  local_sums = jnp.stack(
      [jnp.sum(jnp.exp(shifted), axis=-1), jnp.where(mine, target, 0.)], -1)
  sums = jax.lax.psum(local_sums, axis)
  return jnp.log(sums[..., 0]) - sums[..., 1]


# ---------------------------------------------------------------------------
# Dense parameter pytrees <-> tensor-parallel shards.

# How each kind of layer is split: leaf name -> spec of its trailing dims
# (`TP` stands for the axis), and the size being split, for error messages.
_TP = object()
_LAYOUTS = {
    'column': {'kernel': (None, _TP), 'bias': (_TP,)},
    'row': {'kernel': (_TP, None), 'bias': ()},
    'heads_in': {'kernel': (None, _TP, None), 'bias': (_TP, None)},
    'heads_out': {'kernel': (_TP, None, None), 'bias': ()},
    'vocab': {'embedding': (_TP, None)},
}
_SPLIT_SIZE = {'column': 'output features', 'row': 'input features',
               'heads_in': 'heads', 'heads_out': 'heads', 'vocab': 'vocab size'}
# Layer names -> layout, for the names used by this module, nnx.Embed and
# nnx.MultiHeadAttention. Leaves under no listed layer are replicated.
DEFAULT_LAYOUT = {
    'fc_in': 'column', 'fc_out': 'row', 'lm_head': 'column',
    'query': 'heads_in', 'key': 'heads_in', 'value': 'heads_in',
    'out': 'heads_out', 'embed': 'vocab',
}


def _path_names(path: tuple[Any, ...]) -> list[str]:
  names = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      names.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      names.append(k.name)
    elif isinstance(k, jax.tree_util.SequenceKey):
      names.append(str(k.idx))
  # nnx.Variable leaves (nnx.split states) add a trailing `.value`.
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and (
      path[-1].name == 'value'):
    names.pop()
  return names


def _leaf_rule(path: tuple[Any, ...], leaf: Any, layout: Mapping[str, str]
               ) -> tuple[tuple[Any, ...], str | None]:
  """(spec template aligned to the leaf's trailing dims, layout kind)."""
  names = _path_names(path)
  where = '.'.join(names)
  for name in reversed(names[:-1]):
    if name in layout:
      kind = layout[name]
      if kind not in _LAYOUTS:
        raise ValueError(
            f'layout[{name!r}] = {kind!r} is not one of {sorted(_LAYOUTS)}.')
      rule = _LAYOUTS[kind].get(names[-1])
      if rule is None:
        raise ValueError(
            f'param {where!r}: layer {name!r} has layout {kind!r}, whose '
            f'leaves are {sorted(_LAYOUTS[kind])}, not {names[-1]!r}. Rename '
            'the layer or pass layout= mapping it to the right kind.')
      ndim = len(getattr(leaf, 'shape', ()))
      if ndim < len(rule):
        raise ValueError(
            f'param {where!r} of shape {tuple(leaf.shape)} has fewer than the '
            f'{len(rule)} dims of a {kind!r} {names[-1]}.')
      return (None,) * (ndim - len(rule)) + rule, kind
  return (), None


def param_specs(params: PyTree, *, axis: str = 'tensor',
                layout: Mapping[str, str] | None = None) -> PyTree:
  """The ``PartitionSpec`` of every leaf of a dense params pytree.

  A leaf is split according to the nearest enclosing layer whose name is in
  ``layout`` (``DEFAULT_LAYOUT``: ``fc_in``/``lm_head`` column, ``fc_out``
  row, ``query``/``key``/``value``/``out`` attention heads, ``embed``
  vocabulary); everything else (norms, ...) is replicated, ``P()``. The
  split dims count from the end, so stacked layers (extra leading dims) work:

  * ``column``: kernel ``[in, out]`` ``P(None, axis)``, bias ``P(axis)``;
  * ``row``: kernel ``[in, out]`` ``P(axis, None)``, bias ``P()``;
  * ``heads_in``: kernel ``[d, H, k]`` ``P(None, axis, None)``, bias
    ``[H, k]`` ``P(axis, None)``;
  * ``heads_out``: kernel ``[H, k, d]`` ``P(axis, None, None)``, bias ``P()``;
  * ``vocab``: embedding ``[V, d]`` ``P(axis, None)``.

  Args:
    params: dense params: nested dicts of arrays, or an ``nnx.State`` from
      ``nnx.split``.
    axis: the tensor-parallel mesh axis.
    layout: layer name -> one of the kinds above; default
      ``DEFAULT_LAYOUT``. Extend it for other names, e.g.
      ``{**DEFAULT_LAYOUT, 'wte': 'vocab'}``.

  Returns:
    a pytree of ``PartitionSpec`` with the structure of ``params``: the
    ``in_specs`` (and gradient ``out_specs``) for ``jax.shard_map``.

  Raises:
    ValueError: a leaf under a laid-out layer that its layout does not know.

  Example:
    >>> param_specs({'fc_in': {'kernel': w1, 'bias': b1},
    ...              'fc_out': {'kernel': w2, 'bias': b2}})
    {'fc_in': {'bias': P('tensor'), 'kernel': P(None, 'tensor')},
     'fc_out': {'bias': P(), 'kernel': P('tensor', None)}}
  """
  layout = DEFAULT_LAYOUT if layout is None else layout

  def spec(path, leaf):
    rule, _ = _leaf_rule(path, leaf, layout)
    if _TP not in rule:
      return P()
    return P(*(axis if d is _TP else None for d in rule))

  return jax.tree_util.tree_map_with_path(spec, params)


def check_divisible(params: PyTree, *, mesh: jax.sharding.Mesh,
                    axis: str = 'tensor',
                    layout: Mapping[str, str] | None = None) -> None:
  """``ValueError`` unless every split size of ``params`` divides by ``axis``.

  The sizes ``param_specs`` splits (hidden size, heads, vocabulary) must be
  multiples of the ``axis`` size; all offending leaves are listed.

  Example:
    >>> check_divisible(params, mesh=jaxpar.make_mesh(tensor=8))
  """
  n = _mesh_axis_size(mesh, axis)
  layout = DEFAULT_LAYOUT if layout is None else layout
  errors = []

  def check(path, leaf):
    rule, kind = _leaf_rule(path, leaf, layout)
    for dim, d in enumerate(rule):
      if d is _TP and leaf.shape[dim] % n:
        errors.append(
            f"  {'.'.join(_path_names(path))} {tuple(leaf.shape)}: "
            f'{_SPLIT_SIZE[kind]} {leaf.shape[dim]} (dim {dim}) is not '
            f'divisible by the {axis!r} axis size {n}')

  jax.tree_util.tree_map_with_path(check, params)
  if errors:
    raise ValueError(
        f'cannot split these params over {n} devices:\n'
        + '\n'.join(errors) + f'\nChoose sizes divisible by {n}, or a '
        f'{axis!r} axis size that divides them.')


def shard_params(params: PyTree, *, mesh: jax.sharding.Mesh,
                 axis: str = 'tensor',
                 layout: Mapping[str, str] | None = None) -> PyTree:
  """Places dense params on ``mesh`` with the specs of ``param_specs``.

  The result has the same (dense, global) shapes; each device stores only
  its shard, which ``jax.shard_map`` with ``in_specs=param_specs(params)``
  hands to the layers.

  Args:
    params: dense params (dicts of arrays or an ``nnx.State``).
    mesh: the mesh, e.g. ``jaxpar.make_mesh(tensor=4)``.
    axis: the tensor-parallel mesh axis.
    layout: as in ``param_specs``.

  Returns:
    params with every leaf a ``jax.Array`` sharded as ``param_specs`` says.

  Raises:
    ValueError: a split size (hidden size, heads, vocabulary) not divisible
      by the axis size; all offending leaves are listed.

  Example:
    >>> params = shard_params(nnx.split(model)[1], mesh=mesh)
  """
  check_divisible(params, mesh=mesh, axis=axis, layout=layout)
  specs = param_specs(params, axis=axis, layout=layout)
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                      params, specs)


def unshard_params(params: PyTree) -> PyTree:
  """Replicates every leaf (``P()``) on its mesh: the dense params again.

  Use it to leave tensor parallelism, e.g. to ``nnx.update`` a dense model
  or to save a checkpoint; ``np.asarray`` of a leaf also gives its dense
  value.

  Args:
    params: params placed by ``shard_params`` (or gradients returned by
      ``shard_map`` with ``out_specs=param_specs(...)``).

  Returns:
    the same pytree, every ``NamedSharding`` leaf fully replicated.

  Example:
    >>> dense = unshard_params(shard_params(params, mesh=mesh))
  """
  def replicate(x):
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding):
      return jax.device_put(x, NamedSharding(sharding.mesh, P()))
    return x

  return jax.tree.map(replicate, params)


# ---------------------------------------------------------------------------
# Flax NNX modules. They are built with the dense shapes (initialise, then
# shard_params); inside shard_map, nnx.merge them with the local shards.

_default_kernel_init = nnx.initializers.lecun_normal()
_zeros = nnx.initializers.zeros_init()


def _check_module_shard(module: str, name: str, shard: jax.Array,
                        dense: tuple[int, ...], split_dim: int, n: int,
                        what: str) -> None:
  if dense[split_dim] % n:
    raise ValueError(
        f'{module}: {what} {dense[split_dim]} is not divisible by the tensor '
        f'axis size {n}.')
  want = list(dense)
  want[split_dim] //= n
  if tuple(shard.shape) != tuple(want):
    raise ValueError(
        f'{module}: {name} shard has shape {tuple(shard.shape)}, expected '
        f'{tuple(want)} (dense {tuple(dense)} split over {n} devices). Place '
        'the params with tensor_parallel.shard_params and pass them through '
        'jax.shard_map with in_specs=tensor_parallel.param_specs(state).')


def _bias(p: nnx.Param | None) -> jax.Array | None:
  return None if p is None else p[...]


class _ParallelLinear(nnx.Module):
  """Dense ``kernel [in, out]`` and ``bias [out]`` of a tensor-parallel
  linear; subclasses say which kernel dim is split over ``axis``."""
  _split_dim: int
  _split_name: str

  def __init__(self, in_features: int, out_features: int, *,
               use_bias: bool = True, axis: str = 'tensor',
               sequence_parallel: bool = False,
               kernel_init: nnx.Initializer = _default_kernel_init,
               bias_init: nnx.Initializer = _zeros,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.in_features, self.out_features = in_features, out_features
    self.axis, self.sequence_parallel = axis, sequence_parallel
    self.kernel = nnx.Param(kernel_init(
        rngs.params(), (in_features, out_features), param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,),
                                     param_dtype))
                 if use_bias else nnx.data(None))

  def _local(self) -> tuple[jax.Array, jax.Array | None]:
    """The local kernel and bias, checked against the dense shape."""
    name = type(self).__name__
    _check_module_shard(name, 'kernel', self.kernel,
                        (self.in_features, self.out_features),
                        self._split_dim, _axis_size(self.axis, name),
                        self._split_name)
    return self.kernel[...], _bias(self.bias)


class ColumnParallelLinear(_ParallelLinear):
  """NNX module for ``column_parallel_linear``: ``kernel [in, out]`` and
  ``bias [out]``, dense at init, split by columns when called.

  Args: ``in_features``, ``out_features``, ``gather_output`` and the
  keyword-only ``use_bias``, ``axis``, ``sequence_parallel``,
  ``kernel_init``, ``bias_init``, ``param_dtype``, ``rngs`` (as
  ``nnx.Linear`` and ``column_parallel_linear``).

  Example:
    >>> layer = ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
    >>> graphdef, state = nnx.split(layer)
    >>> f = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh,
    ...                   in_specs=(param_specs(state), P()),
    ...                   out_specs=P(None, 'tensor'))
  """
  _split_dim, _split_name = 1, 'out_features'

  def __init__(self, in_features: int, out_features: int, *,
               gather_output: bool = False, **kwargs: Any):
    super().__init__(in_features, out_features, **kwargs)
    self.gather_output = gather_output

  def __call__(self, x: jax.Array) -> jax.Array:
    return column_parallel_linear(
        x, *self._local(), axis=self.axis, gather_output=self.gather_output,
        sequence_parallel=self.sequence_parallel)


class RowParallelLinear(_ParallelLinear):
  """NNX module for ``row_parallel_linear``: ``kernel [in, out]`` and
  ``bias [out]``, dense at init, kernel split by rows when called.

  Args: ``in_features``, ``out_features``, ``input_is_parallel`` and the
  keyword-only arguments of ``ColumnParallelLinear``.

  Example:
    >>> layer = RowParallelLinear(32, 16, rngs=nnx.Rngs(0))
  """
  _split_dim, _split_name = 0, 'in_features'

  def __init__(self, in_features: int, out_features: int, *,
               input_is_parallel: bool = True, **kwargs: Any):
    super().__init__(in_features, out_features, **kwargs)
    self.input_is_parallel = input_is_parallel

  def __call__(self, x: jax.Array) -> jax.Array:
    return row_parallel_linear(
        x, *self._local(), axis=self.axis,
        input_is_parallel=self.input_is_parallel,
        sequence_parallel=self.sequence_parallel)


class ParallelMLP(nnx.Module):
  """NNX module for ``parallel_mlp``: ``fc_in`` (column) -> activation ->
  ``fc_out`` (row); one all-reduce forward.

  Example:
    >>> mlp = ParallelMLP(16, 64, rngs=nnx.Rngs(0))
    >>> graphdef, state = nnx.split(mlp)
    >>> f = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh,
    ...                   in_specs=(param_specs(state), P()), out_specs=P())
  """

  def __init__(self, features: int, hidden_features: int, *,
               activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
               use_bias: bool = True, axis: str = 'tensor',
               sequence_parallel: bool = False, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    kw = dict(use_bias=use_bias, axis=axis, sequence_parallel=sequence_parallel,
              param_dtype=param_dtype, rngs=rngs)
    self.fc_in = ColumnParallelLinear(features, hidden_features, **kw)
    self.fc_out = RowParallelLinear(hidden_features, features, **kw)
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc_out(self.activation(self.fc_in(x)))


class _Projection(nnx.Module):
  """Kernel and optional bias of one attention projection (no call)."""

  def __init__(self, kernel_shape: tuple[int, ...],
               bias_shape: tuple[int, ...] | None, param_dtype: Any,
               rngs: nnx.Rngs):
    self.kernel = nnx.Param(_default_kernel_init(rngs.params(), kernel_shape,
                                                 param_dtype))
    self.bias = (nnx.Param(_zeros(rngs.params(), bias_shape, param_dtype))
                 if bias_shape is not None else nnx.data(None))

  def params(self) -> dict[str, jax.Array]:
    out = {'kernel': self.kernel[...]}
    if self.bias is not None:
      out['bias'] = self.bias[...]
    return out


class ParallelSelfAttention(nnx.Module):
  """NNX module for ``parallel_self_attention``, heads split over ``axis``.

  Params as ``nnx.MultiHeadAttention``: ``query``/``key``/``value`` kernels
  ``[d, H, k]`` (biases ``[H, k]``), ``out`` kernel ``[H, k, d]`` (bias
  ``[d]``), dense at init; ``num_heads`` must be divisible by the axis size.

  Example:
    >>> attn = ParallelSelfAttention(16, num_heads=4, causal=True,
    ...                              rngs=nnx.Rngs(0))
  """

  def __init__(self, features: int, num_heads: int, *,
               head_dim: int | None = None, causal: bool = False,
               use_bias: bool = True, axis: str = 'tensor',
               sequence_parallel: bool = False,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    if head_dim is None:
      if features % num_heads:
        raise ValueError(
            f'ParallelSelfAttention: features {features} is not divisible by '
            f'num_heads {num_heads}; pass head_dim= explicitly.')
      head_dim = features // num_heads
    self.num_heads, self.head_dim = num_heads, head_dim
    self.causal, self.axis = causal, axis
    self.sequence_parallel = sequence_parallel
    qkv_bias = (num_heads, head_dim) if use_bias else None
    self.query, self.key, self.value = (
        _Projection((features, num_heads, head_dim), qkv_bias, param_dtype,
                    rngs) for _ in range(3))
    self.out = _Projection((num_heads, head_dim, features),
                           (features,) if use_bias else None, param_dtype, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    name = 'ParallelSelfAttention'
    n = _axis_size(self.axis, name)
    d = self.out.kernel.shape[-1]
    dense = (d, self.num_heads, self.head_dim)
    for proj in ('query', 'key', 'value'):
      _check_module_shard(name, f'{proj}.kernel', getattr(self, proj).kernel,
                          dense, 1, n, 'num_heads')
    _check_module_shard(name, 'out.kernel', self.out.kernel,
                        (self.num_heads, self.head_dim, d), 0, n, 'num_heads')
    params = {p: getattr(self, p).params()
              for p in ('query', 'key', 'value', 'out')}
    return parallel_self_attention(params, x, axis=self.axis,
                                   causal=self.causal,
                                   sequence_parallel=self.sequence_parallel)
