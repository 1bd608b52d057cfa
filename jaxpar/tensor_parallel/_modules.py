"""Flax NNX modules for the tensor-parallel layers.

They are built with the dense shapes (initialise on one device, then
``shard_params``); inside ``jax.shard_map`` ``nnx.merge`` them with the local
shards and call them: each call checks the shards against the dense shapes
and runs the pure function of ``layers`` / ``attention``.

Each module marks its ``nnx.Param``s with its layer's kind (metadata
``tensor_layout``: ``column``, ``row``, ``heads_in``, ``heads_out``), so
``param_specs`` splits their state wherever the modules sit in a model,
whatever their names; ``nnx.to_pure_dict`` drops the marks (a pure dict is
laid out by its paths, ``DEFAULT_LAYOUT`` or ``layout=``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from jaxpar._validate import check_int
from jaxpar.tensor_parallel import _checks
from jaxpar.tensor_parallel._attention import parallel_self_attention
from jaxpar.tensor_parallel._rules import MARK
from jaxpar.tensor_parallel._layers import (column_parallel_linear,
                                           row_parallel_linear)

_default_kernel_init = nnx.initializers.lecun_normal()
_zeros = nnx.initializers.zeros_init()


def _shard_problem(name: str, shard: jax.Array, dense: tuple[int, ...],
                   split_dim: int, n: int, what: str) -> str | None:
  """Why ``shard`` is not ``dense`` split over ``n`` devices along
  ``split_dim``, or ``None``."""
  if dense[split_dim] % n:
    return (f'{what} {dense[split_dim]} is not divisible by the tensor axis '
            f'size {n}')
  want = list(dense)
  want[split_dim] //= n
  if tuple(shard.shape) != tuple(want):
    return (f'{name} shard has shape {tuple(shard.shape)}, expected '
            f'{tuple(want)} (dense {tuple(dense)} split over {n} devices)')
  return None


def _check_shards(module: str, problems: list[str | None]) -> None:
  """One ``ValueError`` listing every wrong shard of ``module``."""
  problems = list(dict.fromkeys(p for p in problems if p is not None))
  if problems:
    raise ValueError(
        f'{module}: ' + '; '.join(problems) + '. Place the params with '
        'tensor_parallel.shard_params and pass them through jax.shard_map '
        'with in_specs=tensor_parallel.param_specs(state).')


def _bias(p: nnx.Param | None) -> jax.Array | None:
  return None if p is None else p[...]


class _ParallelLinear(nnx.Module):
  """Dense ``kernel [in, out]`` and ``bias [out]`` of a tensor-parallel
  linear; subclasses say which kernel dim is split over ``axis``."""
  _split_dim: int
  _split_name: str
  _kind: str     # its layout (tensor_parallel.layout), marked on its params

  def __init__(self, in_features: int, out_features: int, *,
               use_bias: bool = True, axis: str = 'tensor',
               sequence_parallel: bool = False,
               kernel_init: nnx.Initializer = _default_kernel_init,
               bias_init: nnx.Initializer = _zeros,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    name = type(self).__name__
    self.in_features = check_int('in_features', in_features, where=name)
    self.out_features = check_int('out_features', out_features, where=name)
    self.axis, self.sequence_parallel = axis, sequence_parallel
    mark = {MARK: self._kind}
    self.kernel = nnx.Param(kernel_init(
        rngs.params(), (self.in_features, self.out_features), param_dtype),
                            **mark)
    self.bias = (nnx.Param(bias_init(rngs.params(), (self.out_features,),
                                     param_dtype), **mark)
                 if use_bias else nnx.data(None))

  def _local(self) -> tuple[jax.Array, jax.Array | None]:
    """The local kernel and bias, checked against the dense shape."""
    name = type(self).__name__
    n = _checks.bound_axis_size(self.axis, name)
    _check_shards(name, [_shard_problem(
        'kernel', self.kernel, (self.in_features, self.out_features),
        self._split_dim, n, self._split_name)])
    return self.kernel[...], _bias(self.bias)


class ColumnParallelLinear(_ParallelLinear):
  """NNX module for ``column_parallel_linear``: ``kernel [in, out]`` and
  ``bias [out]``, dense at init, split by columns when called.

  Args: ``in_features``, ``out_features``, ``gather_output`` and the
  keyword-only ``use_bias``, ``axis``, ``sequence_parallel``,
  ``kernel_init``, ``bias_init``, ``param_dtype``, ``rngs`` (as
  ``nnx.Linear`` and ``column_parallel_linear``).

  Example:
    >>> tp = jaxpar.tensor_parallel
    >>> layer = tp.ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
    >>> graphdef, state = nnx.split(nnx.Dict(fc_in=layer))   # named layer
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> apply = lambda s, x: nnx.merge(graphdef, s)['fc_in'](x)
    >>> f = jax.jit(jax.shard_map(apply, mesh=mesh,
    ...                           in_specs=(tp.param_specs(state), P()),
    ...                           out_specs=P(None, 'tensor')))
    >>> x = jnp.ones((2, 16))
    >>> y = f(tp.shard_params(state, mesh=mesh), x)
    >>> bool(jnp.allclose(y, x @ layer.kernel[...] + layer.bias[...]))
    True
  """
  _split_dim, _split_name, _kind = 1, 'out_features', 'column'

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
    >>> layer = jaxpar.tensor_parallel.RowParallelLinear(32, 16,
    ...                                                  rngs=nnx.Rngs(0))
    >>> layer.kernel.shape                        # dense until sharded
    (32, 16)
  """
  _split_dim, _split_name, _kind = 0, 'in_features', 'row'

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
    >>> tp = jaxpar.tensor_parallel
    >>> mlp = tp.ParallelMLP(16, 64, rngs=nnx.Rngs(0))
    >>> graphdef, state = nnx.split(mlp)
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> apply = lambda s, x: nnx.merge(graphdef, s)(x)
    >>> f = jax.jit(jax.shard_map(apply, mesh=mesh,
    ...                           in_specs=(tp.param_specs(state), P()),
    ...                           out_specs=P()))
    >>> f(tp.shard_params(state, mesh=mesh), jnp.ones((2, 16))).shape
    (2, 16)
  """

  def __init__(self, features: int, hidden_features: int, *,
               activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
               use_bias: bool = True, axis: str = 'tensor',
               sequence_parallel: bool = False, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    name = 'ParallelMLP'
    features = check_int('features', features, where=name)
    hidden_features = check_int('hidden_features', hidden_features, where=name)
    kw = dict(use_bias=use_bias, axis=axis, sequence_parallel=sequence_parallel,
              param_dtype=param_dtype, rngs=rngs)
    self.fc_in = ColumnParallelLinear(features, hidden_features, **kw)
    self.fc_out = RowParallelLinear(hidden_features, features, **kw)
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc_out(self.activation(self.fc_in(x)))


class _Projection(nnx.Module):
  """Kernel and optional bias of one attention projection (no call), its
  params marked with its layout ``kind`` (``heads_in`` or ``heads_out``)."""

  def __init__(self, kernel_shape: tuple[int, ...],
               bias_shape: tuple[int, ...] | None, param_dtype: Any,
               rngs: nnx.Rngs, kind: str):
    mark = {MARK: kind}
    self.kernel = nnx.Param(_default_kernel_init(rngs.params(), kernel_shape,
                                                 param_dtype), **mark)
    self.bias = (nnx.Param(_zeros(rngs.params(), bias_shape, param_dtype),
                           **mark)
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
    >>> tp = jaxpar.tensor_parallel
    >>> attn = tp.ParallelSelfAttention(16, num_heads=4, causal=True,
    ...                                 rngs=nnx.Rngs(0))
    >>> graphdef, state = nnx.split(attn)
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> apply = lambda s, x: nnx.merge(graphdef, s)(x)
    >>> f = jax.jit(jax.shard_map(apply, mesh=mesh,
    ...                           in_specs=(tp.param_specs(state), P()),
    ...                           out_specs=P()))
    >>> f(tp.shard_params(state, mesh=mesh), jnp.ones((2, 8, 16))).shape
    (2, 8, 16)
  """

  def __init__(self, features: int, num_heads: int, *,
               head_dim: int | None = None, causal: bool = False,
               use_bias: bool = True, axis: str = 'tensor',
               sequence_parallel: bool = False,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    name = 'ParallelSelfAttention'
    features = check_int('features', features, where=name)
    num_heads = check_int('num_heads', num_heads, where=name)
    if head_dim is None:
      if features % num_heads:
        raise ValueError(
            f'{name}: features {features} is not divisible by num_heads '
            f'{num_heads}; pass head_dim= explicitly.')
      head_dim = features // num_heads
    head_dim = check_int('head_dim', head_dim, where=name)
    self.num_heads, self.head_dim = num_heads, head_dim
    self.causal, self.axis = causal, axis
    self.sequence_parallel = sequence_parallel
    qkv_bias = (num_heads, head_dim) if use_bias else None
    self.query, self.key, self.value = (
        _Projection((features, num_heads, head_dim), qkv_bias, param_dtype,
                    rngs, 'heads_in') for _ in range(3))
    self.out = _Projection((num_heads, head_dim, features),
                           (features,) if use_bias else None, param_dtype, rngs,
                           'heads_out')

  def __call__(self, x: jax.Array) -> jax.Array:
    name = 'ParallelSelfAttention'
    n = _checks.bound_axis_size(self.axis, name)
    d = self.out.kernel.shape[-1]
    dense = (d, self.num_heads, self.head_dim)
    _check_shards(name, [
        _shard_problem(f'{proj}.kernel', getattr(self, proj).kernel, dense, 1,
                       n, 'num_heads') for proj in ('query', 'key', 'value')
    ] + [_shard_problem('out.kernel', self.out.kernel,
                        (self.num_heads, self.head_dim, d), 0, n,
                        'num_heads')])
    params = {p: getattr(self, p).params()
              for p in ('query', 'key', 'value', 'out')}
    return parallel_self_attention(params, x, axis=self.axis,
                                   causal=self.causal,
                                   sequence_parallel=self.sequence_parallel)
