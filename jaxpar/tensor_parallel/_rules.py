"""Dense parameter pytrees <-> their tensor-parallel shards.

``param_specs`` maps a dense params pytree (e.g. ``nnx.split`` of a Flax
model) to the ``PartitionSpec`` of every leaf, ``shard_params`` places it on
a mesh, ``unshard_params`` replicates it again. A *layout* says which layers
are split, by their full path from the pytree's root (``'mlp.fc_in'``), never
by a bare name found anywhere: a user's model with a layer called ``query``
is split only if the user's layout says so. ``DEFAULT_LAYOUT`` holds the
paths of jaxpar's own param trees; the NNX modules of ``modules`` mark their
``nnx.Param``s with their kind (metadata ``tensor_layout``), so their state
is laid out at any path of a model. jaxpar's layers use Flax's names:
``{'kernel', 'bias'}`` per linear, ``{'scale', 'bias'}`` per norm,
``{'query', 'key', 'value', 'out'}`` projections laid out like
``nnx.MultiHeadAttention``, ``{'embedding'}`` for ``nnx.Embed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.mesh import axis_size

PyTree = Any

# How each kind of layer is split: leaf name -> spec of its trailing dims
# (`TP` stands for the axis), and the size being split, for error messages.
_TP = object()
_LAYOUTS = {
    'column': {'kernel': (None, _TP), 'bias': (_TP,)},
    'row': {'kernel': (_TP, None), 'bias': ()},
    'heads_in': {'kernel': (None, _TP, None), 'bias': (_TP, None)},
    'heads_out': {'kernel': (_TP, None, None), 'bias': ()},
    'vocab': {'embedding': (_TP, None)},
}
_SPLIT_SIZE = {'column': 'output features', 'row': 'input features',
               'heads_in': 'heads', 'heads_out': 'heads', 'vocab': 'vocab size'}
# The nnx.Param metadata key by which jaxpar's tensor-parallel modules mark
# their params with their layer's kind.
MARK = 'tensor_layout'
# Layer paths -> layout, for jaxpar's own param trees, each from its root:
# the MLP (`parallel_mlp`, `ParallelMLP`, `models.MLP`), the attention
# (`parallel_self_attention`, `ParallelSelfAttention`, nnx.MultiHeadAttention),
# a block (`transformer_block`: a GPT pipeline stage, `models.gpt.Block`) and
# the embed and head parts of `models.gpt.split_for_pipeline`. Leaves under
# no listed path are replicated.
DEFAULT_LAYOUT = {
    'fc_in': 'column', 'fc_out': 'row',
    'query': 'heads_in', 'key': 'heads_in', 'value': 'heads_in',
    'out': 'heads_out',
    'mlp.fc_in': 'column', 'mlp.fc_out': 'row',
    'attn.query': 'heads_in', 'attn.key': 'heads_in',
    'attn.value': 'heads_in', 'attn.out': 'heads_out',
    'embed': 'vocab', 'lm_head': 'column',
}


def _path_names(path: tuple[Any, ...]) -> list[str]:
  """The names along a key path, e.g. ``['attn', 'query', 'kernel']``."""
  names = [jax.tree_util.keystr((k,), simple=True, separator='.')
           for k in path]
  # nnx.Variable leaves (nnx.split states) add a trailing `.value`.
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and (
      path[-1].name == 'value'):
    names.pop()
  return names


def _check_layout(layout: Mapping[str, str] | None) -> Mapping[str, str]:
  if layout is None:
    return DEFAULT_LAYOUT
  if not isinstance(layout, Mapping):
    raise TypeError(f'layout must map layer paths to kinds, e.g. '
                    f"{{**DEFAULT_LAYOUT, 'transformer.wte': 'vocab'}}, got a "
                    f'{type(layout).__name__}.')
  keys = [path for path in layout if not isinstance(path, str)]
  if keys:
    raise TypeError(f'layout keys must be layer paths, strings of keys '
                    f"joined by '.' (e.g. 'mlp.fc_in'), got {keys!r}.")
  bad = [f'layout[{path!r}] = {kind!r}' for path, kind in layout.items()
         if kind not in _LAYOUTS]
  if bad:
    raise ValueError(f"{'; '.join(bad)} is not one of {sorted(_LAYOUTS)}.")
  return layout


def _layer_kind(layer: list[str], layout: Mapping[str, str]) -> str | None:
  """The kind of the first ``layout`` path that is the whole ``layer`` path;
  a ``*`` in a path stands for any one key (``'blocks.*.mlp.fc_in'``)."""
  for path, kind in layout.items():
    keys = path.split('.')
    if len(keys) == len(layer) and all(
        k in ('*', name) for k, name in zip(keys, layer)):
      return kind
  return None


def _marks(params: PyTree) -> list[str | None]:
  """Per leaf of ``params``, the kind its ``nnx.Variable`` is marked with
  (``MARK``), or ``None``."""
  is_variable = lambda x: isinstance(x, nnx.Variable)
  marks = []
  for node in jax.tree.leaves(params, is_leaf=is_variable):
    mark = node.get_metadata().get(MARK) if is_variable(node) else None
    marks += [mark] * len(jax.tree.leaves(node))
  return marks


def _leaf_rule(names: list[str], leaf: Any, kind: str | None
               ) -> tuple[tuple[Any, ...], str | None]:
  """(spec template aligned to the leaf's trailing dims, problem) of a leaf
  of a layer of layout ``kind``.

  The template is ``()`` (replicated) for ``kind=None``; ``problem`` says why
  the leaf cannot be laid out, else ``None``.
  """
  if kind is None:
    return (), None
  where, layer = '.'.join(names), '.'.join(names[:-1])
  rule = _LAYOUTS[kind].get(names[-1])
  if rule is None:
    return (), (
        f'param {where!r}: layer {layer!r} has layout {kind!r}, whose '
        f'leaves are {sorted(_LAYOUTS[kind])}, not {names[-1]!r}. Rename '
        'the layer or pass layout= mapping its path to the right kind.')
  ndim = len(getattr(leaf, 'shape', ()))
  if ndim < len(rule):
    return (), (
        f'param {where!r} of shape {tuple(leaf.shape)} has fewer than the '
        f'{len(rule)} dims of a {kind!r} {names[-1]}.')
  return (None,) * (ndim - len(rule)) + rule, None


def _rules(params: PyTree, layout: Mapping[str, str] | None
           ) -> tuple[list[tuple[list[str], Any, tuple[Any, ...], str | None]],
                      Any]:
  """``[(names, leaf, template, kind)]`` of every leaf, and the treedef.

  Raises one ``ValueError`` listing every leaf that cannot be laid out.
  """
  layout = _check_layout(layout)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  rules, problems = [], []
  for (path, leaf), mark in zip(leaves, _marks(params), strict=True):
    names = _path_names(path)
    kind = mark or _layer_kind(names[:-1], layout)
    rule, problem = _leaf_rule(names, leaf, kind)
    rules.append((names, leaf, rule, kind))
    if problem is not None:
      problems.append(problem)
  if problems:
    raise ValueError('\n'.join(problems))
  return rules, treedef


def param_specs(params: PyTree, *, axis: str = 'tensor',
                layout: Mapping[str, str] | None = None) -> PyTree:
  """The ``PartitionSpec`` of every leaf of a dense params pytree.

  A leaf is split according to its layer, the path of the dict holding it
  (``'attn.query'`` for ``params['attn']['query']['kernel']``), if that full
  path is in ``layout``, or to the kind its ``nnx.Param`` is marked with by
  jaxpar's tensor-parallel modules; everything else (norms, ...) is
  replicated, ``P()``. ``DEFAULT_LAYOUT`` knows the paths of jaxpar's
  modules (``fc_in``/``fc_out`` and ``mlp.*``, ``query``/``key``/``value``/
  ``out`` and ``attn.*``, ``embed``, ``lm_head``); a user's model names its
  own paths with ``layout=``. The split dims count from the end, so stacked
  layers (extra leading dims) work:

  * ``column``: kernel ``[in, out]`` ``P(None, axis)``, bias ``P(axis)``;
  * ``row``: kernel ``[in, out]`` ``P(axis, None)``, bias ``P()``;
  * ``heads_in``: kernel ``[d, H, k]`` ``P(None, axis, None)``, bias
    ``[H, k]`` ``P(axis, None)``;
  * ``heads_out``: kernel ``[H, k, d]`` ``P(axis, None, None)``, bias ``P()``;
  * ``vocab``: embedding ``[V, d]`` ``P(axis, None)``.

  Args:
    params: dense params: nested dicts of arrays, or an ``nnx.State`` from
      ``nnx.split``.
    axis: the tensor-parallel mesh axis.
    layout: full layer path (keys joined by ``.``; ``*`` matches any one
      key) -> one of the kinds above; default ``DEFAULT_LAYOUT``, e.g.
      ``{'encoder.*.ffn.up': 'column', 'encoder.*.ffn.down': 'row'}`` for a
      user's model with a list of layers.

  Returns:
    a pytree of ``PartitionSpec`` with the structure of ``params``: the
    ``in_specs`` (and gradient ``out_specs``) for ``jax.shard_map``.

  Raises:
    TypeError: ``layout`` is not a mapping of path strings.
    ValueError: leaves under a laid-out layer that its layout does not know,
      or a kind not in the list above; every such leaf is listed.

  Example:
    >>> mlp = jaxpar.models.MLP(8, 32, rngs=nnx.Rngs(0))
    >>> params = nnx.to_pure_dict(nnx.state(mlp, nnx.Param))
    >>> jaxpar.tensor_parallel.param_specs(params)
    {'fc_in': {'bias': P('tensor',), 'kernel': P(None, 'tensor')},
     'fc_out': {'bias': P(), 'kernel': P('tensor', None)}}
  """
  rules, treedef = _rules(params, layout)
  return treedef.unflatten(
      P(*(axis if d is _TP else None for d in rule)) if _TP in rule else P()
      for _, _, rule, _ in rules)


def check_divisible(params: PyTree, *, mesh: jax.sharding.Mesh,
                    axis: str = 'tensor',
                    layout: Mapping[str, str] | None = None) -> None:
  """``ValueError`` unless every split size of ``params`` divides by ``axis``.

  The sizes ``param_specs`` splits (hidden size, heads, vocabulary) must be
  multiples of the ``axis`` size; all offending leaves are listed.

  Raises:
    TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
    ValueError: ``mesh`` has no ``axis``, or a split size does not divide.

  Example:
    >>> params = {'fc_in': {'kernel': jnp.ones((8, 12))}}
    >>> jaxpar.tensor_parallel.check_divisible(
    ...     params, mesh=jaxpar.make_mesh(tensor=8))
    Traceback (most recent call last):
    ...
    ValueError: cannot split these params over 8 devices:
      fc_in.kernel (8, 12): output features 12 (dim 1) is not divisible by
      the 'tensor' axis size 8
    Choose sizes divisible by 8, or a 'tensor' axis size that divides them.
  """
  n = axis_size(mesh, axis)
  rules, _ = _rules(params, layout)
  errors = [
      f"  {'.'.join(names)} {tuple(leaf.shape)}: {_SPLIT_SIZE[kind]} "
      f'{leaf.shape[dim]} (dim {dim}) is not divisible by the {axis!r} axis '
      f'size {n}'
      for names, leaf, rule, kind in rules
      for dim, d in enumerate(rule) if d is _TP and leaf.shape[dim] % n]
  if errors:
    raise ValueError(
        f'cannot split these params over {n} devices:\n'
        + '\n'.join(errors) + f'\nChoose sizes divisible by {n}, or a '
        f'{axis!r} axis size that divides them.')


def shard_params(params: PyTree, *, mesh: jax.sharding.Mesh,
                 axis: str = 'tensor',
                 layout: Mapping[str, str] | None = None) -> PyTree:
  """Places dense params on ``mesh`` with the specs of ``param_specs``.

  The result has the same (dense, global) shapes; each device stores only
  its shard, which ``jax.shard_map`` with ``in_specs=param_specs(params)``
  hands to the layers.

  Args:
    params: dense params (dicts of arrays or an ``nnx.State``).
    mesh: the mesh, e.g. ``jaxpar.make_mesh(tensor=4)``.
    axis: the tensor-parallel mesh axis.
    layout: as in ``param_specs``.

  Returns:
    params with every leaf a ``jax.Array`` sharded as ``param_specs`` says.

  Raises:
    ValueError: a split size (hidden size, heads, vocabulary) not divisible
      by the axis size; all offending leaves are listed.

  Example:
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> mlp = jaxpar.models.MLP(8, 32, rngs=nnx.Rngs(0))
    >>> params = jaxpar.tensor_parallel.shard_params(
    ...     nnx.state(mlp, nnx.Param), mesh=mesh)
    >>> kernel = params['fc_in']['kernel'][...]
    >>> kernel.shape, kernel.sharding.shard_shape(kernel.shape)
    ((8, 32), (8, 8))
  """
  check_divisible(params, mesh=mesh, axis=axis, layout=layout)
  specs = param_specs(params, axis=axis, layout=layout)
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                      params, specs)


def check_axis_used(specs: PyTree, *, mesh: jax.sharding.Mesh,
                    axis: str = 'tensor') -> None:
  """``ValueError`` if ``axis`` has size > 1 but no spec in ``specs`` uses it.

  Without a parameter split over ``axis``, each of its devices holds and
  computes the whole model: the same numbers as a mesh without the axis,
  for ``size`` times the memory and time. The 3D train step
  (``jaxpar.parallel.trainer``) checks its layout with it.

  Args:
    specs: a pytree of ``PartitionSpec`` (``param_specs`` of the params).
    mesh: the mesh.
    axis: the tensor-parallel mesh axis.

  Raises:
    ValueError: ``mesh`` has no ``axis``, or ``axis`` is unused.

  Example:
    >>> mesh = jaxpar.make_mesh(data=2, stage=2, tensor=2)
    >>> specs = jaxpar.tensor_parallel.param_specs({'w': jnp.ones((4, 4))})
    >>> jaxpar.tensor_parallel.check_axis_used(specs, mesh=mesh)
    Traceback (most recent call last):
    ...
    ValueError: the mesh {'data': 2, 'stage': 2, 'tensor': 2} has a 'tensor'
    axis of size 2, but no parameter is split over 'tensor' ... or leave
    'tensor' out of the mesh (e.g. jaxpar.make_mesh(data=4, stage=2)).
  """
  n = axis_size(mesh, axis)
  specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  if n == 1 or any(axis in (d if isinstance(d, tuple) else (d,))
                   for spec in specs for d in spec):
    return
  sizes = dict(mesh.shape)
  others = [name for name in sizes if name != axis]
  without = ''
  if others and set(sizes) <= {'data', 'stage', 'tensor'}:  # make_mesh axes
    sizes[others[0]] *= n
    without = ' (e.g. jaxpar.make_mesh({}))'.format(
        ', '.join(f'{name}={sizes[name]}' for name in others))
  raise ValueError(
      f'the mesh {dict(mesh.shape)} has a {axis!r} axis of size {n}, but no '
      f'parameter is split over {axis!r} (its layout matches no layer '
      f'path): each of its {n} devices would hold and compute the whole '
      f'model, for nothing. Split the params over {axis!r}: tensor rules '
      "(tensor_rules= of jaxpar.parallel.from_nnx), or jaxpar's "
      'tensor-parallel layers (jaxpar.tensor_parallel) in your functions '
      'with layout= naming their layer paths (see '
      f'tensor_parallel.param_specs); or leave {axis!r} out of the mesh'
      f'{without}.')


def unshard_params(params: PyTree) -> PyTree:
  """Replicates every leaf (``P()``) on its mesh: the dense params again.

  Use it to leave tensor parallelism, e.g. to ``nnx.update`` a dense model
  or to save a checkpoint; ``np.asarray`` of a leaf also gives its dense
  value.

  Args:
    params: params placed by ``shard_params`` (or gradients returned by
      ``shard_map`` with ``out_specs=param_specs(...)``).

  Returns:
    the same pytree, every ``NamedSharding`` leaf fully replicated.

  Example:
    >>> tp = jaxpar.tensor_parallel
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> params = {'fc_in': {'kernel': jnp.ones((8, 32))}}
    >>> dense = tp.unshard_params(tp.shard_params(params, mesh=mesh))
    >>> dense['fc_in']['kernel'].sharding.spec
    P()
  """
  def replicate(x):
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding):
      return jax.device_put(x, NamedSharding(sharding.mesh, P()))
    return x

  return jax.tree.map(replicate, params)
