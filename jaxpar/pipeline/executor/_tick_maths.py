"""The maths of the tick scan's blocks (``_tick_scan``): the user's
functions called on one microbatch with its key and model state.

A block of ``_tick_scan`` reads its rank's view (``Rank``) and one cell of
the tick table; these are the calls it makes: a stage's parameters and
key, stage 0's embedding of a raw microbatch, the last stage's loss and its
cotangent (``seed``), and the types of the new model state each ``F``
writes (``new_state``). Model state (``ModelState``) is threaded as the
stages' is: a function given ``state=s`` returns ``(value, new_state)``;
the embedding's and the loss's state are those of stage 0's and the last
stage's ``F`` (``owner``), handed to every rank at the end (``_tick_scan.
_result``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.pipeline.executor._microbatches import extras, row
from jaxpar.pipeline.executor._tick_state import ModelState, Rank
from jaxpar.pipeline.executor._vma import like, stored
from jaxpar.pipeline.schedules import KIND_CODES, TickTable

PyTree = Any


def params_of(rank: Rank, j: Any) -> PyTree:
  """The rank's ``j``-th local stage's parameters."""
  return row(rank.local_params, j)


def key_of(rank: Rank, stage: Any, microbatch: Any) -> jax.Array | None:
  """The key of (logical ``stage``, ``microbatch``); the loss of a
  microbatch has ``stage = num_stages``. A function of the global
  microbatch index, so of the batch rows, not of the schedule or mesh."""
  options = rank.options
  if options.key is None:
    return None
  return jax.random.fold_in(jax.random.fold_in(
      options.key, options.microbatch_offset + microbatch), stage)


def embed_params(rank: Rank) -> PyTree:
  """The embedding's parameters (``None`` without an embedding)."""
  return None if rank.embedding is None else rank.embedding.params


def embedded(rank: Rank, params: PyTree, microbatch: Any,
             state: PyTree = None) -> tuple[PyTree, PyTree]:
  """``(x, new_state)``: stage 0's input for ``microbatch``, the embedding
  of its raw rows, and the embedding's new state (``None`` without a
  ``state``)."""
  embedding = rank.embedding
  raw = jax.tree.map(lambda a: a[microbatch], rank.inputs)
  key = (None if embedding.key is None else jax.random.fold_in(
      embedding.key, rank.options.microbatch_offset + microbatch))
  out = embedding.fn(params, raw, **extras(key, state))
  return (out, None) if state is None else tuple(out)


def seed(rank: Rank, loss_params: PyTree, y: PyTree, target: PyTree,
         key: jax.Array | None, state: PyTree = None):
  """``((loss, aux), (dloss_params, dy), new_state)``: this microbatch's
  share of the mean loss (and aux, at least float32), its gradient, and
  the loss's new state (``None`` without a ``state``)."""
  def share(lp, y):
    out = rank.loss_fn(lp, y, target, **extras(key, state))
    out, new = (out, None) if state is None else out
    loss, aux = jax.tree.map(lambda a: a.astype(jnp.promote_types(
        a.dtype, jnp.float32)) / rank.num_microbatches,
        out if rank.options.has_aux else (out, ()))
    return loss, (aux, new)
  (loss, (aux, new)), (dhead, dy) = jax.value_and_grad(
      share, argnums=(0, 1), has_aux=True, allow_int=True)(loss_params, y)
  return (loss, aux), (dhead, stored(dy, y)), new


def new_state(rank: Rank, params: PyTree, x: PyTree, key: Any,
              state: ModelState, target: PyTree) -> PyTree:
  """The avals of the new state each ``F`` writes (``None`` parts where
  there is no state): the stage's, the embedding's, the loss's."""
  stage = None if state.stages is None else jax.eval_shape(
      lambda p, x, k, s: rank.stage.stage_fn(p, x, **extras(k, s))[1],
      params, x, key, state.stages)
  embed = None if state.embed is None else jax.eval_shape(
      lambda p, s: embedded(rank, p, 0, s)[1], embed_params(rank),
      state.embed)
  head = None if state.head is None else jax.eval_shape(
      lambda lp, y, s: seed(rank, lp, y, target, key, s)[2],
      rank.loss_params, x, state.head)
  return stage, embed, head


def written(old: PyTree, new: PyTree) -> PyTree:
  """``new`` typed as the buffer ``old`` it replaces (``None``: none)."""
  return None if old is None else like(
      jax.tree.map(lambda n, o: n.astype(o.dtype), new, old), old)


def owner(table: TickTable, stage: int) -> int:
  """The rank that runs ``stage``'s forwards (stage 0: the embedding's,
  the last stage: the loss's)."""
  ranks = np.nonzero((table.kind == KIND_CODES['F'])
                     & (table.stage == stage))[1]
  return int(ranks[0])


def zeros_like(tree: PyTree) -> PyTree:
  return jax.tree.map(jnp.zeros_like, tree)


def cast(tree: PyTree, avals: PyTree) -> PyTree:
  """Each leaf of ``tree`` in the dtype of the matching aval."""
  return jax.tree.map(lambda a, t: a.astype(t.dtype), tree, avals)


def add(acc: PyTree, d: PyTree) -> PyTree:
  return jax.tree.map(lambda a, d: a + like(d, a), acc, d)
