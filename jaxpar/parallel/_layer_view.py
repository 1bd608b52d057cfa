"""The 3D optimizer's view: a pipelined model's params one tree per layer.

The 3D train step keeps stage leaves stacked in the executor's rank order
``[p, v, m_1, ..., *layer_shape]`` (``p`` ranks, ``v`` stages each, then the
dims a stage mask covers, e.g. GPT's block slots). An optimizer run on those
stacks would compute its per-leaf statistics -- LAMB/LARS trust ratios,
Adafactor's factored moments and parameter scale, Muon's orthogonalization,
per-leaf clipping -- over every layer of a kind at once, and shape rules
(``optax.masked`` by ``ndim``, Muon's 2-D routing, Adafactor's factoring)
would see ``[p, v, ...]`` shapes. So the optimizer sees
``LayerParams(embed, layers, head)`` instead: ``layers[i]`` is layer ``i``
of the model in model order, shaped like one layer of the dense model::

  layers = [stages[r, j, *slot] for each real layer in model order]
           (logical stage k sits at (r, j) as the schedule places it;
            slots the stage mask marks False -- identity padding -- are no
            layer: no optimizer state, never updated)

``LayerView`` maps between the two; ``layerwise`` wraps an optax
optimizer so that it runs on the view of rank-order ``PipelineParams``;
``mirror_specs`` gives an optimizer state's shardings from the view's.

**Sharding.** A layer is one global array, so it cannot live on one stage
rank only: each layer's optimizer leaves are split over the ``stage`` axis
along one of their own dims (as ZeRO splits over ``data``), besides their
tensor split and, with ZeRO, the ``data`` axis. The update reshards the
gradients and params from the rank order to the view (one all-to-all over
``stage`` per leaf: ``[p, v, ..., d, ...]`` split on ``p`` becomes split on
``d``, and then every layer is a local slice) and the updates back.

Example:
  >>> import jax.numpy as jnp, numpy as np, jaxpar
  >>> from jaxpar.parallel._layer_view import LayerView
  >>> view = LayerView.of(jaxpar.pipeline.interleaved_one_f_one_b(2, 2, 2),
  ...                     stage_mask=np.array([[1, 1], [1, 0], [1, 1], [1, 0]]))
  >>> view.positions        # (rank, local stage, slot) of layers 0..5
  ((0, 0, 0), (0, 0, 1), (1, 0, 0), (0, 1, 0), (0, 1, 1), (1, 1, 0))
  >>> stages = {'w': jnp.zeros((2, 2, 2, 3))}          # [p, v, slots, 3]
  >>> [layer['w'].shape for layer in view.layers(stages)][:2]
  [(3,), (3,)]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline.schedules import Schedule, local_stages
from jaxpar.parallel._params import LayerParams, PipelineParams

PyTree = Any


def _constrain(tree: PyTree, specs: PyTree | None) -> PyTree:
  if specs is None:
    return tree
  return jax.lax.with_sharding_constraint(tree, specs)


class LayerView(NamedTuple):
  """Where each layer of a pipelined model sits in the rank order.

  Attributes:
    positions: per layer, in model order, its index into a stage leaf's
      leading dims ``[p, v, m_1, ...]``.
    shape: those leading dims.
  """
  positions: tuple[tuple[int, ...], ...]
  shape: tuple[int, ...]

  @classmethod
  def of(cls, schedule: Schedule,
         stage_mask: np.ndarray | None = None) -> 'LayerView':
    """The view of ``schedule``'s rank order; a layer is a ``True`` entry
    of ``stage_mask`` (``[num_stages, m_1, ...]``), default one per stage."""
    where = {k: (r, j) for r, ks in enumerate(local_stages(schedule))
             for j, k in enumerate(ks)}
    mask = (np.ones(schedule.num_stages, bool) if stage_mask is None
            else np.asarray(stage_mask, bool))
    positions = tuple(where[idx[0]] + idx[1:] for idx in np.ndindex(mask.shape)
                      if mask[idx])
    p = schedule.num_ranks
    return cls(positions, (p, schedule.num_stages // p) + mask.shape[1:])

  def spec(self, layer_spec: P) -> P:
    """A stage leaf's spec in which every layer is a local slice."""
    return P(*(None,) * len(self.shape), *layer_spec)

  def layers(self, stages: PyTree, specs: PyTree | None = None) -> list:
    """``[layer_0, ..., layer_{L-1}]`` of rank-order ``stages``.

    ``specs``: one layer's ``PartitionSpec`` tree; under ``jit`` the stacks
    are resharded to ``spec(...)`` first, so each slice is local.
    """
    if specs is not None:
      stages = _constrain(stages, jax.tree.map(self.spec, specs))
    return [_constrain(jax.tree.map(lambda a, pos=pos: a[pos], stages), specs)
            for pos in self.positions]

  def stack(self, layers: list, fill: PyTree | None = None,
            specs: PyTree | None = None) -> PyTree:
    """Inverse of ``layers``: rank-order stages; slots that are no layer
    come from ``fill`` (rank order too), or are zeros."""
    at = {pos: i for i, pos in enumerate(self.positions)}

    def one(path_fill, *leaves):
      rows = [leaves[at[pos]] if pos in at
              else (jnp.zeros_like(leaves[0]) if path_fill is None
                    else path_fill[pos]) for pos in np.ndindex(self.shape)]
      return jnp.stack(rows).reshape(self.shape + rows[0].shape)
    fills = (jax.tree.map(lambda _: None, layers[0]) if fill is None
             else fill)
    out = jax.tree.map(one, fills, *layers, is_leaf=lambda x: x is None)
    return _constrain(out, None if specs is None
                      else jax.tree.map(self.spec, specs))

  def of_params(self, params: PipelineParams,
                specs: LayerParams | None = None) -> LayerParams:
    """``LayerParams`` of rank-order ``params`` (``specs``: the view's)."""
    layers = self.layers(params.stages,
                         None if specs is None else specs.layers[0])
    if specs is not None:
      params = _constrain(params._replace(stages=None),
                          PipelineParams(specs.embed, None, specs.head))
    return LayerParams(params.embed, layers, params.head)


def layerwise(optimizer: optax.GradientTransformation, view: LayerView, *,
              specs: Callable[[PyTree], LayerParams] | None = None
              ) -> optax.GradientTransformationExtraArgs:
  """``optimizer`` on the ``LayerParams`` view of rank-order params.

  ``init(params)`` is ``optimizer.init(view.of_params(params))``;
  ``update(g, state, params, **extra_args)`` runs ``optimizer.update`` on the
  views (extra args such as ``value=`` passed on, optax's
  ``with_extra_args_support``) and stacks the updates back into the rank
  order (zeros where no layer is). ``specs(params) -> LayerParams`` of
  ``PartitionSpec``s places the views under ``jit`` (inside a mesh context).
  """
  optimizer = optax.with_extra_args_support(optimizer)

  def view_of(tree, like):
    return view.of_params(tree, None if specs is None else specs(like))

  def init(params):
    return optimizer.init(view_of(params, params))

  def update(updates, state, params=None, **extra_args):
    like = updates if params is None else params
    new, state = optimizer.update(
        view_of(updates, like), state,
        None if params is None else view_of(params, like), **extra_args)
    layer_specs = None if specs is None else specs(like).layers[0]
    return PipelineParams(new.embed, view.stack(new.layers, specs=layer_specs),
                          new.head), state
  return optax.GradientTransformationExtraArgs(init, update)


def in_model_order(opt_state: PyTree, view: LayerView,
                   to_stages: Callable[[PyTree], PyTree]) -> PyTree:
  """``opt_state`` with each ``LayerParams`` subtree (Adam's ``mu``,
  schedule-free's ``z``) as ``PipelineParams``: its layers stacked by
  ``view.stack`` (zeros where no layer is), then ``to_stages`` (rank
  order -> model order). What ``optimizer.init`` of model-order params
  would give: optax helpers take it with them
  (``schedule_free_eval_params``)."""
  def one(node):
    if not isinstance(node, LayerParams):
      return node
    return PipelineParams(node.embed, to_stages(view.stack(node.layers)),
                          node.head)
  return jax.tree.map(one, opt_state,
                      is_leaf=lambda x: isinstance(x, LayerParams))


def _masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def mirror_specs(opt_state: PyTree, params: PyTree, specs: PyTree) -> PyTree:
  """``PartitionSpec``s of ``opt_state`` from those of ``params``.

  A subtree of ``opt_state`` with the structure of ``params`` (Adam's
  ``mu``, a momentum trace; ``optax.MaskedNode`` placeholders of
  ``masked``/``multi_transform``/``partition`` allowed in place of leaves)
  gets ``specs`` on every leaf shaped like its param; its other leaves
  (Adafactor's ``(1,)`` placeholders) and all other leaves (counts,
  factored moments) are replicated, ``P()``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar.parallel._layer_view import mirror_specs
    >>> params = {'w': jnp.ones((4, 2)), 'b': jnp.ones(2)}
    >>> opt = optax.masked(optax.adam(0.1), {'w': True, 'b': False})
    >>> specs = mirror_specs(
    ...     opt.init(params), params, {'w': P('data'), 'b': P()})
    >>> specs.inner_state[0].mu
    {'b': MaskedNode(), 'w': P('data',)}
  """
  treedef = jax.tree.structure(params)
  pairs = list(zip([np.shape(x) for x in jax.tree.leaves(params)],
                   treedef.flatten_up_to(specs)))

  def items(node):
    try:
      return treedef.flatten_up_to(node)
    except (ValueError, TypeError):
      return None

  def mirrors(node) -> bool:
    got = items(node)
    return got is not None and all(
        _masked(x) or hasattr(x, 'shape') for x in got)

  def one(node):
    if not mirrors(node):
      return P()
    return treedef.unflatten([
        x if _masked(x) else spec if np.shape(x) == shape else P()
        for x, (shape, spec) in zip(items(node), pairs)])
  return jax.tree.map(one, opt_state, is_leaf=mirrors)
