"""The forward collectives of the tensor-parallel layers.

Each one's transpose is the backward collective that Megatron prescribes;
``jax.grad`` derives it from the ``check_vma`` types.
"""

from __future__ import annotations

import jax

from jaxpar.tensor_parallel import _checks


def gather_sequence(x: jax.Array, tensor_axis: str) -> jax.Array:
  """[..., S/N, d] sequence shard -> [..., S, d] (backward: reduce-scatter)."""
  return jax.lax.all_gather(x, tensor_axis, axis=x.ndim - 2, tiled=True)


def reduce_partial(partial: jax.Array, bias: jax.Array | None,
                   tensor_axis: str, sequence_parallel: bool,
                   fn: str) -> jax.Array:
  """Sums per-device partial outputs, then adds the (replicated) bias once.

  ``psum`` -> replicated ``[..., S, d]`` (backward: identity), or with
  ``sequence_parallel`` ``psum_scatter`` over the sequence -> ``[..., S/N, d]``
  (backward: all-gather).
  """
  if sequence_parallel:
    _checks.check_scatter(partial, _checks.bound_axis_size(tensor_axis, fn), fn)
    y = jax.lax.psum_scatter(partial, tensor_axis,
                             scatter_dimension=partial.ndim - 2, tiled=True)
  else:
    y = jax.lax.psum(partial, tensor_axis)
  return y if bias is None else y + bias
