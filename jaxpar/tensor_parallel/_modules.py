"""Flax NNX modules for the tensor-parallel layers.

They are built with the dense shapes (initialise on one device, then
``shard_params``); inside ``jax.shard_map`` ``nnx.merge`` them with the local
shards and call them: each call checks the shards against the dense shapes
and runs the pure function of ``layers`` / ``attention``.

Each module marks its ``nnx.Param``s with Flax sharding metadata
(``out_sharding``, as ``nnx.with_partitioning`` does: ``(None, tensor_axis)``
for a column kernel, ``(tensor_axis, None)`` for a row kernel, heads for
attention), so
``param_specs`` without rules splits their state wherever the modules sit in
a model, whatever their names, and Flax's own tools
(``nnx.get_partition_spec``) read the same specs. ``nnx.to_pure_dict`` drops
the metadata: a pure dict is split by tensor rules (``rules=``).
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
from jaxpar.tensor_parallel._layers import (column_parallel_linear,
                                           row_parallel_linear)

_default_kernel_init = nnx.initializers.lecun_normal()
_zeros = nnx.initializers.zeros_init()


def _param(init: nnx.Initializer, rngs: nnx.Rngs, shape: tuple[int, ...],
           dtype: Any, sharding: tuple[str | None, ...]) -> nnx.Param:
  """A dense ``nnx.Param`` marked with its tensor split (``out_sharding``).

  Not sharded when built (``eager_sharding=False``): the modules are built
  dense, on one device or under ``nnx.eval_shape``, with no mesh in context;
  ``shard_params`` places them.
  """
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=sharding,
                   eager_sharding=False)


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
  linear; subclasses say which kernel dim is split over ``tensor_axis``."""
  _split_dim: int
  _split_name: str

  def __init__(self, in_features: int, out_features: int, *,
               use_bias: bool = True, tensor_axis: str = 'tensor',
               sequence_parallel: bool = False,
               kernel_init: nnx.Initializer = _default_kernel_init,
               bias_init: nnx.Initializer = _zeros,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    name = type(self).__name__
    self.in_features = check_int('in_features', in_features, where=name)
    self.out_features = check_int('out_features', out_features, where=name)
    self.tensor_axis, self.sequence_parallel = tensor_axis, sequence_parallel
    kernel_split = [None, None]
    kernel_split[self._split_dim] = tensor_axis
    self.kernel = _param(kernel_init, rngs,
                         (self.in_features, self.out_features), param_dtype,
                         tuple(kernel_split))
    # The bias [out] is split with the columns, replicated with the rows.
    self.bias = (_param(bias_init, rngs, (self.out_features,), param_dtype,
                        (kernel_split[1],))
                 if use_bias else nnx.data(None))

  def _local(self) -> tuple[jax.Array, jax.Array | None]:
    """The local kernel and bias, checked against the dense shape."""
    name = type(self).__name__
    n = _checks.bound_axis_size(self.tensor_axis, name)
    _check_shards(name, [_shard_problem(
        'kernel', self.kernel, (self.in_features, self.out_features),
        self._split_dim, n, self._split_name)])
    return self.kernel[...], _bias(self.bias)


class ColumnParallelLinear(_ParallelLinear):
  """NNX module for ``column_parallel_linear``: ``kernel [in, out]`` and
  ``bias [out]``, dense at init, split by columns when called.

  Args: ``in_features``, ``out_features``, ``gather_output`` and the
  keyword-only ``use_bias``, ``tensor_axis``, ``sequence_parallel``,
  ``kernel_init``, ``bias_init``, ``param_dtype``, ``rngs`` (as
  ``nnx.Linear`` and ``column_parallel_linear``).

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> tp = jaxpar.tensor_parallel
    >>> layer = tp.ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
    >>> graphdef, state = nnx.split(layer)
    >>> tp.param_specs(state)['kernel'].get_value()    # its Flax metadata
    P(None, 'tensor')
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> apply = lambda s, x: nnx.merge(graphdef, s)(x)
    >>> f = jax.jit(jax.shard_map(apply, mesh=mesh,
    ...                           in_specs=(tp.param_specs(state), P()),
    ...                           out_specs=P(None, 'tensor')))
    >>> x = jnp.ones((2, 16))
    >>> y = f(tp.shard_params(state, mesh=mesh), x)
    >>> bool(jnp.allclose(y, x @ layer.kernel[...] + layer.bias[...]))
    True
  """
  _split_dim, _split_name = 1, 'out_features'

  def __init__(self, in_features: int, out_features: int, *,
               gather_output: bool = False, **kwargs: Any):
    super().__init__(in_features, out_features, **kwargs)
    self.gather_output = gather_output

  def __call__(self, x: jax.Array) -> jax.Array:
    return column_parallel_linear(
        x, *self._local(), tensor_axis=self.tensor_axis,
        gather_output=self.gather_output,
        sequence_parallel=self.sequence_parallel)


class RowParallelLinear(_ParallelLinear):
  """NNX module for ``row_parallel_linear``: ``kernel [in, out]`` and
  ``bias [out]``, dense at init, kernel split by rows when called.

  Args: ``in_features``, ``out_features``, ``input_is_parallel`` and the
  keyword-only arguments of ``ColumnParallelLinear``.

  Example:
    >>> import jaxpar
    >>> from flax import nnx
    >>> layer = jaxpar.tensor_parallel.RowParallelLinear(32, 16,
    ...                                                  rngs=nnx.Rngs(0))
    >>> layer.kernel.shape                        # dense until sharded
    (32, 16)
  """
  _split_dim, _split_name = 0, 'in_features'

  def __init__(self, in_features: int, out_features: int, *,
               input_is_parallel: bool = True, **kwargs: Any):
    super().__init__(in_features, out_features, **kwargs)
    self.input_is_parallel = input_is_parallel

  def __call__(self, x: jax.Array) -> jax.Array:
    return row_parallel_linear(
        x, *self._local(), tensor_axis=self.tensor_axis,
        input_is_parallel=self.input_is_parallel,
        sequence_parallel=self.sequence_parallel)


class ParallelMLP(nnx.Module):
  """NNX module for ``parallel_mlp``: ``fc_in`` (column) -> activation ->
  ``fc_out`` (row); one all-reduce forward.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
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
               use_bias: bool = True, tensor_axis: str = 'tensor',
               sequence_parallel: bool = False, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    name = 'ParallelMLP'
    features = check_int('features', features, where=name)
    hidden_features = check_int('hidden_features', hidden_features, where=name)
    kw = dict(use_bias=use_bias, tensor_axis=tensor_axis,
              sequence_parallel=sequence_parallel, param_dtype=param_dtype,
              rngs=rngs)
    self.fc_in = ColumnParallelLinear(features, hidden_features, **kw)
    self.fc_out = RowParallelLinear(hidden_features, features, **kw)
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc_out(self.activation(self.fc_in(x)))


class _Projection(nnx.Module):
  """Kernel and optional bias of one attention projection (no call), each
  param marked with its split over the heads (``kernel_split``,
  ``bias_split``: ``out_sharding`` entries)."""

  def __init__(self, kernel_shape: tuple[int, ...],
               bias_shape: tuple[int, ...] | None, param_dtype: Any,
               rngs: nnx.Rngs, kernel_split: tuple[str | None, ...],
               bias_split: tuple[str | None, ...]):
    self.kernel = _param(_default_kernel_init, rngs, kernel_shape,
                         param_dtype, kernel_split)
    self.bias = (_param(_zeros, rngs, bias_shape, param_dtype, bias_split)
                 if bias_shape is not None else nnx.data(None))

  def params(self) -> dict[str, jax.Array]:
    out = {'kernel': self.kernel[...]}
    if self.bias is not None:
      out['bias'] = self.bias[...]
    return out


class ParallelSelfAttention(nnx.Module):
  """NNX module for ``parallel_self_attention``, heads split over
  ``tensor_axis``.

  Params as ``nnx.MultiHeadAttention``: ``query``/``key``/``value`` kernels
  ``[d, H, k]`` (biases ``[H, k]``), ``out`` kernel ``[H, k, d]`` (bias
  ``[d]``), dense at init; ``num_heads`` must be divisible by the axis size.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
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
               use_bias: bool = True, tensor_axis: str = 'tensor',
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
    self.causal, self.tensor_axis = causal, tensor_axis
    self.sequence_parallel = sequence_parallel
    qkv_bias = (num_heads, head_dim) if use_bias else None
    # query/key/value [d, H, k] (bias [H, k]) and out [H, k, d] by heads.
    self.query, self.key, self.value = (
        _Projection((features, num_heads, head_dim), qkv_bias, param_dtype,
                    rngs, (None, tensor_axis, None), (tensor_axis, None))
        for _ in range(3))
    self.out = _Projection((num_heads, head_dim, features),
                           (features,) if use_bias else None, param_dtype, rngs,
                           (tensor_axis, None, None), (None,))

  def __call__(self, x: jax.Array) -> jax.Array:
    name = 'ParallelSelfAttention'
    n = _checks.bound_axis_size(self.tensor_axis, name)
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
    return parallel_self_attention(params, x, tensor_axis=self.tensor_axis,
                                   causal=self.causal,
                                   sequence_parallel=self.sequence_parallel)
