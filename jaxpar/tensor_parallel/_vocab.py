"""Vocabulary-parallel embedding and cross-entropy: the vocabulary split.

The embedding table ``[V, d]`` and the LM head's logits ``[..., V]`` are split
over the ``tensor`` axis by vocabulary, so neither the table nor the full
logits ever sit on one device. Both run inside ``jax.shard_map``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.tensor_parallel import _checks
from jaxpar.tensor_parallel import _collectives


def vocab_parallel_embed(ids: jax.Array, table: jax.Array, *,
                         tensor_axis: str = 'tensor',
                         sequence_parallel: bool = False) -> jax.Array:
  """Embedding lookup ``table[ids]`` with the vocabulary split over
  ``tensor_axis``.

  Device ``r`` holds rows ``r*V/N .. (r+1)*V/N - 1`` (``in_specs
  P(tensor_axis, None)``), looks up the ids in its range, zeros the others
  and one
  all-reduce (with ``sequence_parallel``: a reduce-scatter along the
  sequence) combines them. The backward needs no communication: each device
  scatter-adds into its own rows. Ids must lie in ``[0, V)``; others embed to
  zeros.

  Args:
    ids: integer ``[...]`` (``[..., S]`` with ``sequence_parallel``),
      replicated.
    table: local shard ``[V/N, d]``.
    tensor_axis: the tensor-parallel mesh axis.
    sequence_parallel: return this device's sequence shard.

  Returns:
    ``[..., d]`` replicated, or ``[..., S/N, d]`` with ``sequence_parallel``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> table = jnp.arange(32.0).reshape(16, 2)        # V = 16, d = 2
    >>> shards = jax.device_put(table, jax.NamedSharding(mesh, P('tensor')))
    >>> embed = jax.jit(jax.shard_map(
    ...     jaxpar.tensor_parallel.vocab_parallel_embed, mesh=mesh,
    ...     in_specs=(P(), P('tensor', None)), out_specs=P()))
    >>> ids = jnp.array([[0, 5, 15]])
    >>> bool(jnp.array_equal(embed(ids, shards), table[ids]))
    True
  """
  fn = 'vocab_parallel_embed'
  _checks.bound_axis_size(tensor_axis, fn)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f'{fn}: ids must be integers, got {ids.dtype}.')
  if table.ndim != 2:
    raise ValueError(f'{fn}: table shard must be [V/N, d], got '
                     f'{tuple(table.shape)}.')
  _checks.check_sharded(table, tensor_axis, fn, 'table',
                        f'P({tensor_axis!r}, None)')
  rows = table.shape[0]
  local = ids - jax.lax.axis_index(tensor_axis) * rows
  mine = (local >= 0) & (local < rows)
  vectors = jnp.take(table, jnp.where(mine, local, 0), axis=0)
  vectors = jnp.where(mine[..., None], vectors, jnp.zeros((), table.dtype))
  return _collectives.reduce_partial(vectors, None, tensor_axis,
                                     sequence_parallel, fn)


def vocab_parallel_cross_entropy(logits: jax.Array, labels: jax.Array, *,
                                 tensor_axis: str = 'tensor') -> jax.Array:
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
    tensor_axis: the tensor-parallel mesh axis.

  Returns:
    per-example loss ``[...]``, replicated.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> logits = jax.random.normal(jax.random.key(0), (3, 16))   # V = 16
    >>> split = jax.NamedSharding(mesh, P(None, 'tensor'))
    >>> labels = jnp.array([0, 7, 15])
    >>> xent = jax.jit(jax.shard_map(
    ...     jaxpar.tensor_parallel.vocab_parallel_cross_entropy, mesh=mesh,
    ...     in_specs=(P(None, 'tensor'), P()), out_specs=P()))
    >>> want = optax.losses.softmax_cross_entropy_with_integer_labels(
    ...     logits, labels)
    >>> got = xent(jax.device_put(logits, split), labels)
    >>> bool(jnp.allclose(got, want, atol=1e-6))
    True
  """
  fn = 'vocab_parallel_cross_entropy'
  _checks.bound_axis_size(tensor_axis, fn)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f'{fn}: labels must be integers, got {labels.dtype}.')
  if logits.ndim < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
    raise ValueError(
        f'{fn}: labels {tuple(labels.shape)} must have the shape of logits '
        f'{tuple(logits.shape)} without its last (vocabulary) axis.')
  _checks.check_sharded(logits, tensor_axis, fn, 'logits',
                 f'P(..., {tensor_axis!r}) (split over the last axis)')
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  vocab = logits.shape[-1]
  m = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), tensor_axis)
  shifted = logits - m[..., None]
  local = labels - jax.lax.axis_index(tensor_axis) * vocab
  mine = (local >= 0) & (local < vocab)
  target = jnp.take_along_axis(shifted, jnp.where(mine, local, 0)[..., None],
                               axis=-1)[..., 0]
  local_sums = jnp.stack(
      [jnp.sum(jnp.exp(shifted), axis=-1), jnp.where(mine, target, 0.)], -1)
  sums = jax.lax.psum(local_sums, tensor_axis)
  return jnp.log(sums[..., 0]) - sums[..., 1]
