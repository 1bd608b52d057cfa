"""Megatron layers: linear, MLP and layer norm on local shards (``shard_map``).

These functions run *inside* ``jax.shard_map`` over a mesh with a ``tensor``
axis of size ``N`` and receive the local shards of their parameters;
activations are replicated over the axis (or, with ``sequence_parallel=True``,
sharded along the sequence). They follow Shoeybi et al. 2019 (Megatron-LM)
and Korthikanti et al. 2022 (sequence parallelism):

* a *column*-parallel linear holds ``kernel[:, cols]``, ``[in, out/N]``: its
  output is sharded over features and needs no communication;
* a *row*-parallel linear holds ``kernel[rows, :]``, ``[in/N, out]``: each
  device computes a partial sum, one all-reduce (``psum``) finishes it;
* an MLP (column -> activation -> row) thus costs exactly one all-reduce
  forward. In the backward the conjugate operators swap: the input gradient
  of the column layer needs one all-reduce (Megatron's ``f``), the row
  layer's ``psum`` transposes to the identity (Megatron's ``g``);
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
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.tensor_parallel import _checks
from jaxpar.tensor_parallel import _collectives
from jaxpar.tensor_parallel._checks import Params


def column_parallel_linear(x: jax.Array, kernel: jax.Array,
                           bias: jax.Array | None = None, *,
                           tensor_axis: str = 'tensor',
                           gather_output: bool = False,
                           sequence_parallel: bool = False) -> jax.Array:
  """``y = x @ kernel + bias`` with the kernel split by output columns.

  Device ``r`` of the ``N`` along ``tensor_axis`` holds
  ``kernel[:, r*o:(r+1)*o]`` and ``bias[r*o:(r+1)*o]`` with ``o = out/N``
  (``in_specs P(None, tensor_axis)`` and ``P(tensor_axis)``), and computes
  those output features.

  Communication, forward / backward: none / one all-reduce of ``dx``
  (``[..., in]``). With ``gather_output``: plus an all-gather of ``y`` /
  nothing (the backward just slices). With ``sequence_parallel``: an
  all-gather of the ``x`` sequence shards / a reduce-scatter of ``dx``.

  Args:
    x: ``[..., in]`` replicated over ``tensor_axis``; with
      ``sequence_parallel``, ``[..., S/N, in]``, this device's sequence
      shard.
    kernel: local shard ``[in, out/N]``.
    bias: local shard ``[out/N]`` or ``None``.
    tensor_axis: the tensor-parallel mesh axis.
    gather_output: all-gather the output features, returning the replicated
      ``[..., out]`` instead of the shard ``[..., out/N]``.
    sequence_parallel: ``x`` is sharded along the sequence (dim -2) and is
      all-gathered first.

  Returns:
    ``[..., out/N]`` (``[..., S, out/N]`` with ``sequence_parallel``), or the
    full ``[..., out]`` with ``gather_output``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> tp = jaxpar.tensor_parallel
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> specs = (P(), P(None, 'tensor'), P('tensor'))
    >>> x, kernel, bias = jnp.ones((2, 8)), jnp.ones((8, 16)), jnp.arange(16.)
    >>> placed = [jax.device_put(a, jax.NamedSharding(mesh, s))
    ...           for a, s in zip((x, kernel, bias), specs)]
    >>> f = jax.jit(jax.shard_map(tp.column_parallel_linear, mesh=mesh,
    ...                           in_specs=specs, out_specs=P(None, 'tensor')))
    >>> y = f(*placed)                          # [2, 16], 4 columns each
    >>> bool(jnp.allclose(y, x @ kernel + bias))
    True
  """
  fn = 'column_parallel_linear'
  n = _checks.bound_axis_size(tensor_axis, fn)
  if kernel.ndim != 2 or x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(
        f'{fn}: x {tuple(x.shape)} and kernel shard {tuple(kernel.shape)} do '
        'not fit: the kernel shard must be [in, out/N] with in = '
        'x.shape[-1].')
  _checks.check_sharded(kernel, tensor_axis, fn, 'kernel',
                        f'P(None, {tensor_axis!r})')
  _checks.check_bias(bias, kernel.shape[1], fn,
                     'shard the bias like the kernel columns, in_specs '
                     f'P({tensor_axis!r})')
  if bias is not None:
    _checks.check_sharded(bias, tensor_axis, fn, 'bias', f'P({tensor_axis!r})')
  if sequence_parallel:
    _checks.check_sequence_sharded(x, tensor_axis, n, fn)
    x = _collectives.gather_sequence(x, tensor_axis)
  y = x @ kernel
  if bias is not None:
    y = y + bias
  if gather_output:
    # Invariant result: its transpose slices this device's columns instead of
    # reduce-scattering N identical copies (which would scale grads by N).
    y = jax.lax.all_gather(y, tensor_axis, axis=y.ndim - 1, tiled=True,
                           to='invarying')
  return y


def row_parallel_linear(x: jax.Array, kernel: jax.Array,
                        bias: jax.Array | None = None, *,
                        tensor_axis: str = 'tensor',
                        input_is_parallel: bool = True,
                        sequence_parallel: bool = False) -> jax.Array:
  """``y = x @ kernel + bias`` with the kernel split by input rows.

  Device ``r`` holds ``kernel[r*i:(r+1)*i, :]`` with ``i = in/N``
  (``in_specs P(tensor_axis, None)``) and the matching input features
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
    tensor_axis: the tensor-parallel mesh axis.
    input_is_parallel: whether ``x`` is already split over ``tensor_axis``.
    sequence_parallel: reduce-scatter the result along the sequence (dim -2)
      instead of all-reducing it.

  Returns:
    ``[..., out]`` replicated over ``tensor_axis``; with ``sequence_parallel``,
    ``[..., S/N, out]``, this device's sequence shard.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> tp = jaxpar.tensor_parallel
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> specs = (P(None, 'tensor'), P('tensor', None), P())
    >>> x, kernel = jnp.arange(32.0).reshape(2, 16), jnp.ones((16, 8))
    >>> bias = jnp.ones(8)
    >>> placed = [jax.device_put(a, jax.NamedSharding(mesh, s))
    ...           for a, s in zip((x, kernel, bias), specs)]
    >>> f = jax.jit(jax.shard_map(tp.row_parallel_linear, mesh=mesh,
    ...                           in_specs=specs, out_specs=P()))
    >>> y = f(*placed)                          # one psum of [2, 8]
    >>> bool(jnp.allclose(y, x @ kernel + bias))
    True
  """
  fn = 'row_parallel_linear'
  n = _checks.bound_axis_size(tensor_axis, fn)
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
  _checks.check_sharded(kernel, tensor_axis, fn, 'kernel',
                        f'P({tensor_axis!r}, None)')
  _checks.check_bias(bias, kernel.shape[1], fn,
                     f'pass the full, replicated bias [{kernel.shape[1]}] '
                     'with in_specs P()')
  if not input_is_parallel:
    start = jax.lax.axis_index(tensor_axis) * rows
    x = jax.lax.dynamic_slice_in_dim(x, start, rows, axis=x.ndim - 1)
  return _collectives.reduce_partial(x @ kernel, bias, tensor_axis,
                                     sequence_parallel, fn)


def parallel_mlp(params: Params, x: jax.Array, *, tensor_axis: str = 'tensor',
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
    tensor_axis: the tensor-parallel mesh axis.
    activation: elementwise nonlinearity (default ``jax.nn.gelu``).
    sequence_parallel: ``x`` and the result are sequence shards.

  Returns:
    Same shape as ``x``: replicated, or this device's sequence shard.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> tp = jaxpar.tensor_parallel
    >>> dense = jaxpar.models.MLP(8, 32, rngs=nnx.Rngs(0))
    >>> params = nnx.to_pure_dict(nnx.state(dense, nnx.Param))
    >>> rules = jaxpar.models.mlp.TENSOR_RULES   # fc_in columns, fc_out rows
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> specs = tp.param_specs(params, rules=rules)
    >>> mlp = jax.jit(jax.shard_map(tp.parallel_mlp, mesh=mesh,
    ...                             in_specs=(specs, P()), out_specs=P()))
    >>> x = jnp.ones((2, 8))
    >>> y = mlp(tp.shard_params(params, mesh=mesh, rules=rules), x)
    >>> bool(jnp.allclose(y, dense(x), atol=1e-6))
    True
  """
  params = _checks.as_arrays(params, 'parallel_mlp')
  fc_in, fc_out = params['fc_in'], params['fc_out']
  h = column_parallel_linear(x, fc_in['kernel'], fc_in.get('bias'),
                             tensor_axis=tensor_axis,
                             sequence_parallel=sequence_parallel)
  return row_parallel_linear(activation(h), fc_out['kernel'],
                             fc_out.get('bias'), tensor_axis=tensor_axis,
                             sequence_parallel=sequence_parallel)


def dropout(x: jax.Array, rate: float, key: jax.Array | None, *,
            tensor_axis: str = 'tensor', sequence_parallel: bool = False
            ) -> jax.Array:
  """Inverted dropout: ``where(keep, x / (1 - rate), 0)``, ``keep ~
  Bernoulli(1 - rate)``, drawn from ``key``.

  For activations replicated over ``tensor_axis``: give every device the same
  ``key`` and each draws the same mask. With ``sequence_parallel`` (``x`` is
  ``[..., S/N, d]``) each device draws the mask of the whole ``[..., S, d]``
  and keeps its slice, so the result is that of the replicated activations.
  ``rate == 0`` or ``key is None``: ``x`` unchanged.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxpar
    >>> x = jnp.ones((2, 1000))
    >>> y = jaxpar.tensor_parallel.dropout(x, 0.25, jax.random.key(0))
    >>> sorted(set(np.unique(y).tolist())), round(float(jnp.mean(y)), 1)
    ([0.0, 1.3333333730697632], 1.0)
  """
  if isinstance(rate, bool) or not isinstance(rate, (int, float, np.floating)):
    raise TypeError(f'dropout rate={rate!r} must be a float in [0, 1).')
  if not 0 <= rate < 1:
    raise ValueError(f'dropout rate={rate!r} must be in [0, 1): the fraction '
                     'of activations zeroed (0 for none).')
  if key is None or rate == 0:
    return x
  shape = x.shape
  if sequence_parallel:
    n = _checks.bound_axis_size(tensor_axis, 'dropout')
    shape = shape[:-2] + (n * shape[-2], shape[-1])
  keep = jax.random.bernoulli(key, 1 - rate, shape)
  if sequence_parallel:
    keep = jax.lax.dynamic_slice_in_dim(
        keep, jax.lax.axis_index(tensor_axis) * x.shape[-2], x.shape[-2],
        x.ndim - 2)
  return jnp.where(keep, x / (1 - rate), jnp.zeros((), x.dtype))


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
    >>> import jax.numpy as jnp, jaxpar
    >>> from flax import nnx
    >>> x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    >>> y = jaxpar.tensor_parallel.layer_norm(
    ...     {'scale': jnp.ones(4), 'bias': jnp.zeros(4)}, x)
    >>> bool(jnp.allclose(y, nnx.LayerNorm(4, rngs=nnx.Rngs(0))(x)))
    True
  """
  params = _checks.as_arrays(params, 'layer_norm')
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + epsilon)
  if params.get('scale') is not None:
    y = y * params['scale']
  if params.get('bias') is not None:
    y = y + params['bias']
  return y
