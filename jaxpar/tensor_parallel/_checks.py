"""Checks shared by the tensor-parallel layers and modules.

They run while tracing (shapes and ``check_vma`` types are static), before
any compute, and name the value, the rule and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx
import jax
import numpy as np

from jaxpar.vma import varying_axes

Params = Mapping[str, Any]


def bound_axis_size(tensor_axis: str, fn: str) -> int:
  """Size of the mesh axis ``tensor_axis`` of the enclosing ``shard_map``."""
  try:
    return jax.lax.axis_size(tensor_axis)
  except NameError:
    raise ValueError(
        f'{fn}: mesh axis {tensor_axis!r} is not bound here. Call it inside '
        f'jax.shard_map over a mesh with that axis (e.g. '
        f"jaxpar.make_mesh(tensor=N)), or pass tensor_axis=<the mesh's "
        'tensor axis name>.') from None


def check_sharded(a: jax.Array, tensor_axis: str, fn: str, what: str,
                  spec: str) -> None:
  """A parameter shard must vary over ``tensor_axis`` (else every device
  holds the same slice, or shard_map runs with check_vma=False and grads go
  wrong)."""
  if tensor_axis not in varying_axes(a):
    raise ValueError(
        f'{fn}: {what} {tuple(a.shape)} is not sharded over '
        f'{tensor_axis!r}. Pass it through jax.shard_map with in_specs '
        f'{spec} (see tensor_parallel.param_specs), and keep check_vma=True '
        '(the default): '
        'the layers need it for exact gradients.')


def check_sequence_sharded(x: jax.Array, tensor_axis: str, n: int,
                           fn: str) -> None:
  if x.ndim < 2:
    raise ValueError(
        f'{fn}: sequence_parallel=True needs x of shape [..., S/{n}, d], got '
        f'{tuple(x.shape)}.')
  if tensor_axis not in varying_axes(x):
    raise ValueError(
        f'{fn}: sequence_parallel=True needs x {tuple(x.shape)} sharded along '
        f'the sequence (dim -2) over {tensor_axis!r}, e.g. in_specs '
        f'P(None, {tensor_axis!r}, None) for [B, S, d]; it is replicated. '
        'Pass sequence_parallel=False '
        'for replicated activations.')


def check_scatter(y: jax.Array, n: int, fn: str) -> None:
  if y.ndim < 2:
    raise ValueError(
        f'{fn}: sequence_parallel=True needs outputs [..., S, d] to scatter '
        f'along the sequence, got {tuple(y.shape)}.')
  if y.shape[-2] % n:
    raise ValueError(
        f'{fn}: sequence_parallel=True reduce-scatters the sequence (dim -2 of '
        f'{tuple(y.shape)}) over {n} devices; sequence length {y.shape[-2]} '
        f'is not divisible by {n}. Pad the sequence to a multiple of {n}.')


def check_bias(bias: jax.Array | None, size: int, fn: str, hint: str) -> None:
  if bias is not None and tuple(bias.shape) != (size,):
    raise ValueError(
        f'{fn}: bias shape {tuple(bias.shape)} does not match the {size} '
        f'output features of the kernel; {hint}.')


def as_arrays(params: Params, fn: str) -> Params:
  """An ``nnx.State`` (from ``nnx.split``) as nested dicts of arrays."""
  if isinstance(params, nnx.State):
    return nnx.to_pure_dict(params)
  if not isinstance(params, Mapping):
    raise TypeError(
        f'{fn}: params must be a dict of arrays or an nnx.State (e.g. '
        f'nnx.split(module)[1]), got a {type(params).__name__}.')
  return params


def resharding_permutes(fn: Any, args: tuple, specs: tuple,
                        axes: Mapping[str, int]) -> int:
  """How many ``collective-permute`` s XLA puts in ``fn`` and its VJP when
  it partitions them over ``axes`` (Auto mesh axes, the first devices), the
  arguments split as ``specs`` (a ``PartitionSpec`` per leaf, or ``None``:
  replicated).

  A ``collective-permute`` is how XLA reshards a dim split over an axis into
  pieces that must be split over it too (``jnp.split`` of a column-split
  fused projection: device 0 holds all of the gate, device 1 all of the up
  half). Compiled only: abstract ``args`` (``jax.ShapeDtypeStruct`` s), no
  data. ``fn(*args)`` must return arrays of floats.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar.tensor_parallel._checks import resharding_permutes
    >>> def glu(w, x):                    # fused gate|up, split in two
    ...   gate, up = jnp.split(x @ w, 2, axis=-1)
    ...   return jax.nn.silu(gate) * up
    >>> args = (jax.ShapeDtypeStruct((8, 16), jnp.float32),
    ...         jax.ShapeDtypeStruct((2, 8), jnp.float32))
    >>> resharding_permutes(glu, args, (P(None, 'tensor'), None),
    ...                     {'tensor': 2}) > 0
    True
    >>> resharding_permutes(glu, args, (None, None), {'tensor': 2})
    0
  """
  from jaxpar import hlo
  # Inside a trace (a shard_map's) the mesh keeps its size: take the
  # enclosing mesh's axes too, all Auto, the arguments replicated over them.
  outer = jax.sharding.get_abstract_mesh()
  axes = {**dict(zip(outer.axis_names, outer.axis_sizes)), **axes}
  size = int(np.prod(list(axes.values())))
  mesh = jax.sharding.Mesh(
      np.array(jax.devices()[:size]).reshape(tuple(axes.values())),
      tuple(axes), axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  def vjp(args, dy):
    y, pull = jax.vjp(fn, *args)
    return y, pull(dy)
  placed = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(
          a.shape, a.dtype, sharding=jax.sharding.NamedSharding(
              mesh, s if s is not None else jax.sharding.PartitionSpec())),
      args, specs, is_leaf=lambda s: s is None
      or isinstance(s, jax.sharding.PartitionSpec))
  dy = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=(
          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))),
      jax.eval_shape(fn, *args))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    program = jax.jit(vjp).lower(placed, dy).compile()
  return sum(c.kind == 'collective-permute' for c in hlo.collectives(program))
