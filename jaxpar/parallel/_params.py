"""A pipelined model's params: stacked for the pipeline, per layer for the optimizer.

``jaxpar.models`` builds these (``gpt.split_for_pipeline``) and
``jaxpar.parallel`` trains them.

* ``PipelineParams(embed, stages, head)``: what the pipeline runs, stage
  leaves stacked ``[num_stages, ...]``;
* ``LayerParams(embed, layers, head)``: what the 3D trainer's optimizer sees
  (the layer view): the same arrays with one tree per layer, in model order
  and with the model's shapes;
* ``LayerSplit(num_layers, num_stages, stage_counts)``: which layers sit on
  which stage, and the mask of the identity slots of uneven splits;
* tied params (``with_tied``, ``untied``): ``embed`` params that the head
  reads too (tied embeddings) are one param, stored in ``embed``: the head
  gets their values, and the gradient of their two uses is one sum.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


class PipelineParams(NamedTuple):
  """A pipelined model's params: ``embed`` -> ``stages`` -> ``head``.

  ``stages`` leaves are stacked ``[num_stages, ...]`` in model order (in a
  ``TrainState`` from ``Trainer.init`` they are in the executor's rank
  placement ``[p, v, ...]``; ``Trainer.params`` converts back).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpar.parallel import PipelineParams
    >>> pp = PipelineParams(embed={'w': jnp.ones(2)},
    ...                     stages={'w': jnp.ones((4, 2))}, head={})
    >>> pp.stages['w'].shape
    (4, 2)
  """
  embed: PyTree
  stages: PyTree
  head: PyTree


class LayerParams(NamedTuple):
  """The per-layer view of ``PipelineParams``: ``embed``, ``layers``, ``head``.

  ``layers`` is a list with one tree per real layer in model order (identity
  slots of uneven splits are not layers), each shaped like one layer of the
  dense model. The 3D trainer's ``optimizer.init``/``update`` see this, and
  its optimizer state holds it (e.g. Adam's ``mu``).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpar.parallel import LayerParams
    >>> view = LayerParams(embed={}, layers=[{'w': jnp.ones(2)}] * 3, head={})
    >>> len(view.layers), view.layers[0]['w'].shape
    (3, (2,))
  """
  embed: PyTree
  layers: list
  head: PyTree


class LayerSplit(NamedTuple):
  """How ``num_layers`` blocks sit on ``num_stages`` pipeline stages.

  Stage ``k`` holds ``counts[k]`` real blocks (``stage_counts`` if given,
  e.g. from ``jaxpar.pipeline.balance``; else balanced, the first
  ``num_layers % num_stages`` stages one more) in ``slots`` slots; the rest
  are identity. ``mask[k, j]``: slot ``j`` of stage ``k`` is real.
  """
  num_layers: int
  num_stages: int
  stage_counts: tuple[int, ...] | None = None

  @property
  def counts(self) -> tuple[int, ...]:
    if self.stage_counts is not None:
      return self.stage_counts
    q, r = divmod(self.num_layers, self.num_stages)
    return tuple(q + (k < r) for k in range(self.num_stages))

  @property
  def slots(self) -> int:
    return max(self.counts)

  @property
  def mask(self) -> np.ndarray:
    return np.arange(self.slots)[None, :] < np.array(self.counts)[:, None]

  def stack(self, layers: list) -> Any:
    """``num_layers`` layer pytrees -> one pytree of ``[num_stages, slots,
    ...]`` leaves, the identity slots zero (frozen by ``mask``).

    One jitted program per split and layer signature (eager stacking
    compiles an op per leaf shape)."""
    return _stacked(self, layers)


@functools.partial(jax.jit, static_argnums=0)
def _stacked(split: LayerSplit, layers: list) -> Any:
  zero = jax.tree.map(jnp.zeros_like, layers[0])
  stages, i = [], 0
  for count in split.counts:
    stage = list(layers[i:i + count]) + [zero] * (split.slots - count)
    stages.append(jax.tree.map(lambda *xs: jnp.stack(xs), *stage))
    i += count
  return jax.tree.map(lambda *xs: jnp.stack(xs), *stages)


# ------------------------------------------------------------- tied params
# Nested dicts by key path, as from_nnx builds embed and head.

Path = tuple[Any, ...]


def nest(flat: dict[Path, Any]) -> dict:
  """``{('a', 'b'): x}`` -> ``{'a': {'b': x}}``."""
  out: dict = {}
  for path, value in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = value
  return out


def flat(tree: dict, prefix: Path = ()) -> dict[Path, Any]:
  """Inverse of ``nest``."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(flat(v, prefix + (k,)))
    else:
      out[prefix + (k,)] = v
  return out


def with_tied(head: dict, embed: dict, tied: tuple[Path, ...]) -> dict:
  """``head`` with the ``embed`` leaves at the ``tied`` key paths (the
  tree the head function takes)."""
  if not tied:
    return head
  embed = flat(embed)
  return nest({**flat(head), **{p: embed[p] for p in tied}})


def untied(grads: PipelineParams, tied: tuple[Path, ...]) -> PipelineParams:
  """Gradients of ``PipelineParams(embed, stages, with_tied(head, ...))``
  as those of the params: each tied leaf's head gradient added to its
  embed gradient.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpar.parallel._params import PipelineParams, untied
    >>> g = PipelineParams({'wte': jnp.ones(2)}, {},
    ...                    {'wte': jnp.full(2, 2.), 'ln': jnp.ones(1)})
    >>> got = untied(g, (('wte',),))
    >>> got.embed['wte'].tolist(), sorted(got.head)
    ([3.0, 3.0], ['ln'])
  """
  if not tied:
    return grads
  embed, head = flat(grads.embed), flat(grads.head)
  for p in tied:
    embed[p] = jax.tree.map(jnp.add, embed[p], head.pop(p))
  return grads._replace(embed=nest(embed), head=nest(head))
