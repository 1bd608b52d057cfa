"""The model state in a data-parallel step: threaded, then merged over ``data``.

``TrainState.model_state`` holds a model's variables that are not trained
(``nnx.BatchStat`` running statistics, counters). Each device threads it
through its microbatches in order, as one device runs them; then one value
per leaf comes out of the ``shard_map`` (``merged``):

* an entry every device computed alike -- a constant, or statistics synced
  over ``data`` (``nnx.BatchNorm(axis_name='data')``: each microbatch's
  batch statistics are those of the same microbatch on every device
  together) -- is that value, exactly;
* a float entry that differs between devices (statistics of each device's
  own shard) is the mean over ``data`` of the devices' values. For
  BatchNorm's running mean that is the running mean of the global batch
  (the shards are equal-sized); its running variance becomes the mean of
  the shards' variances, which leaves out the spread between the shards'
  means: sync the statistics to get the global batch's;
* any other entry (integer counters: every device runs the same number of
  microbatches, so they agree) is the largest of the devices' values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.vma import varying_axes

PyTree = Any


def stateful(loss_fn: Callable[..., Any], *, has_aux: bool,
             carries_state: bool) -> Callable[..., Any]:
  """The loss in the one form the step differentiates::

    f(params, model_state, batch, key=None) -> (loss, (aux, model_state))

  ``loss_fn`` is ``loss_fn(params, batch, state=model_state[, key=k]) ->
  (out, model_state)`` if it ``carries_state`` (``DataParallelModel.
  loss_fn``), else ``loss_fn(params, batch[, key=k]) -> out`` (the model
  state passes unchanged); the key is passed only when there is one.
  ``out`` is ``loss`` or, ``has_aux``, ``(loss, aux)``. The new model state
  keeps the dtypes of the old (a scan carries it).
  """
  def f(params, model_state, batch, key=None):
    extras = {} if key is None else {'key': key}
    if carries_state:
      out, new = loss_fn(params, batch, state=model_state, **extras)
      new = jax.tree.map(lambda n, o: n.astype(o.dtype), new, model_state)
    else:
      out, new = loss_fn(params, batch, **extras), model_state
    loss, aux = out if has_aux else (out, None)
    return loss, (aux, new)
  return f


def merged(tree: PyTree, axis: str) -> PyTree:
  """One value per leaf of the devices' model states (inside ``shard_map``,
  invariant over ``axis``): the module docstring's rule."""
  def one(x):
    if axis not in varying_axes(x):
      return x
    high = jax.lax.pmax(x, axis)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return high
    alike = high == jax.lax.pmin(x, axis)
    return jnp.where(alike, high, jax.lax.pmean(x, axis))
  return jax.tree.map(one, tree)
