"""The batch as microbatches, and the call of a user function on one.

``microbatched`` splits the step's batch into the ``m`` microbatches the
tick table names. ``extras`` gives jaxpar's extra arguments of a user
function called on one microbatch, by keyword: every stage, loss and
embedding function takes its data positionally and ``key=`` (when the step
has a key) and ``state=`` (a stateful stage) by keyword::

  stage_fn(params, x)                      # no key, no state
  stage_fn(params, x, key=k)               # a step with a key
  stage_fn(params, x, state=s) -> (y, s)   # a stage with model state
  loss_fn(loss_params, y, target, key=k)
  embed_fn(embed_params, raw, key=k)
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


class StageFn(Protocol):
  """A pipeline stage: ``stage_fn(params, x) -> y``, ``y`` like ``x``.

  ``params`` is one stage's slice of the stacked stage parameters and ``x``
  one microbatch's activation. With a step key it is called
  ``stage_fn(params, x, key=k)``; with model state (``stage_state``)
  ``stage_fn(params, x, state=s)`` and returns ``(y, new_state)``.
  """

  def __call__(self, params: PyTree, x: jax.Array, /, **extras: Any) -> Any:
    ...


class LossFn(Protocol):
  """The loss after the last stage: ``loss_fn(loss_params, y, target)``.

  Returns one microbatch's mean loss, a float scalar (``(loss, aux)`` with
  ``has_aux``); called ``loss_fn(loss_params, y, target, key=k)`` with a
  step key.
  """

  def __call__(self, loss_params: PyTree, y: jax.Array, target: PyTree, /,
               **extras: Any) -> Any:
    ...


def microbatched(inputs: PyTree, targets: PyTree, m: int):
  """Every leaf of ``inputs`` and ``targets`` reshaped to ``[m, batch/m, ...]``.

  ``inputs`` is any pytree of arrays with a leading batch axis (a dict of
  token ids and a mask, a tuple of tensors), split leaf by leaf like the
  ``targets``; ``batch`` is its first leaf's leading size.

  Raises:
    ValueError: ``inputs`` has no leaves, a leaf has no leading axis or
      another batch size (named by its key path), or ``batch`` does not
      divide by ``m``.

  Example:
    >>> import numpy as np
    >>> from jaxpar.pipeline.executor._microbatches import microbatched
    >>> xs, ts = microbatched({'x': np.ones((6, 3)), 'ids': np.arange(6)},
    ...                       np.zeros(6), 2)
    >>> xs['x'].shape, xs['ids'].shape, ts.shape
    ((2, 3, 3), (2, 3), (2, 3))
  """
  leaves = jax.tree_util.tree_leaves_with_path(inputs)
  if not leaves:
    raise ValueError(f'inputs has no arrays ({inputs!r}); pass the batch, '
                     'an array or a pytree of arrays [batch, ...].')
  shapes = [(f'inputs{jax.tree_util.keystr(path)}', np.shape(leaf))
            for path, leaf in leaves]
  shapes += [(f'targets{jax.tree_util.keystr(path)}', np.shape(leaf))
             for path, leaf in jax.tree_util.tree_leaves_with_path(targets)]
  first, shape = shapes[0]
  if not shape:
    raise ValueError(f'{first} must have a leading batch axis, got shape '
                     f'{shape}.')
  batch = shape[0]
  for name, shape in shapes[1:]:
    if not shape or shape[0] != batch:
      raise ValueError(
          f'{name} has shape {shape} but {first} has batch size {batch}: '
          'every leaf of inputs and targets must share the leading batch '
          'axis.')
  if batch % m:
    raise ValueError(
        f'inputs batch size {batch} is not divisible by the schedule\'s '
        f'num_microbatches={m}: use a batch that is a multiple of {m} or a '
        f'schedule whose microbatch count divides {batch}.')
  split = lambda a: jnp.reshape(a, (m, batch // m) + np.shape(a)[1:])
  return jax.tree.map(split, inputs), jax.tree.map(split, targets)


def extras(key: Any = None, state: PyTree = None) -> dict[str, Any]:
  """The keyword arguments jaxpar adds to a user function's data: ``key``
  and ``state`` where they are not ``None``.

  Example:
    >>> from jaxpar.pipeline.executor._microbatches import extras
    >>> extras(), extras(key=1), extras(state={'n': 0})
    ({}, {'key': 1}, {'state': {'n': 0}})
  """
  return {name: value for name, value in (('key', key), ('state', state))
          if value is not None}


def row(tree: PyTree, j: Any) -> PyTree:
  """Row ``j`` of every leaf (``None`` stays ``None``): one microbatch, or
  one local stage of stacked ``[v, ...]`` params."""
  return jax.tree.map(lambda a: a[j], tree)


class Row:
  """Row ``index`` of ``buffer``, not read yet: a stash slot handed to a
  block that reads it where it uses it. ``StageVJP.input_grad`` and
  ``weight_grad`` take stash and weight-stash leaves as ``Row``s: a scan over
  the stage's layers then reads one layer of the row per iteration from the
  buffer, where a row read first is a copy of every layer's entry (the
  scan's operand). Not a pytree: one ``Row`` is one leaf."""

  __slots__ = ('buffer', 'index')

  def __init__(self, buffer: jax.Array, index: Any):
    self.buffer, self.index = buffer, index

  def read(self) -> jax.Array:
    """``buffer[index]``."""
    return jax.lax.dynamic_index_in_dim(self.buffer, self.index,
                                        keepdims=False)

  def entry(self, i: Any) -> jax.Array:
    """``buffer[index, i]``: entry ``i`` of the row (one layer)."""
    shape = self.buffer.shape[2:]
    starts = [jnp.asarray(s, jnp.int32) for s in (self.index, i)]
    return jax.lax.dynamic_slice(
        self.buffer, starts + [jnp.int32(0)] * len(shape), (1, 1) + shape
    ).reshape(shape)


def rows(tree: PyTree, j: Any) -> PyTree:
  """``row(tree, j)`` as ``Row``s, read where they are used.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpar.pipeline.executor._microbatches import rows
    >>> r = rows({'a': jnp.arange(12).reshape(2, 3, 2)}, 1)['a']
    >>> r.read().tolist(), r.entry(2).tolist()
    ([[6, 7], [8, 9], [10, 11]], [10, 11])
  """
  return jax.tree.map(lambda a: Row(a, j), tree)


def read(x: Any) -> Any:
  """``x``, read if it is a ``Row``."""
  return x.read() if isinstance(x, Row) else x
