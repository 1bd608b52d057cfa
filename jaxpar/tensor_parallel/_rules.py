"""Tensor rules: which params are split over the ``tensor`` axis, and how.

A param's *path* is its keys from the pytree's root joined by ``/``
(``'blocks/0/attn/query/kernel'``; the ``.value`` of an ``nnx.Variable`` is
not a key). *Tensor rules* map a regex to the ``PartitionSpec`` entries of a
param's trailing dims: the first rule, in order, whose regex matches the
whole path (``re.fullmatch``) splits the param; a param that no rule matches
is replicated. The entries count from the last dim, so one rule fits a
kernel and its bias (``('tensor',)``: kernel ``[in, out]`` ->
``P(None, 'tensor')``, bias ``[out]`` -> ``P('tensor')``) and stacked layers
(extra leading dims) alike.

Without rules (``rules=None``) the params' own Flax metadata says: the
``out_sharding`` of each ``nnx.Variable`` (``nnx.with_partitioning``,
``nnx.Param(..., out_sharding=...)``), its ``tensor_axis`` entries only.
jaxpar's
NNX modules (``ParallelMLP``, ...) mark their params so; a pure dict
(``nnx.to_pure_dict``) has no metadata and needs rules, such as
``jaxpar.models.gpt.TENSOR_RULES`` for jaxpar's GPT.

``match_rules`` is the matcher (here and in ``jaxpar.parallel.from_nnx``);
``param_specs`` turns its matches into a ``PartitionSpec`` tree,
``shard_params`` places params on a mesh, ``unshard_params`` replicates them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from flax import nnx
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.mesh import axis_size

PyTree = Any
Rules = Mapping[str, Sequence[Any]]


class RuleMatch(NamedTuple):
  """How one param is split: by ``rule``, or by its Flax metadata.

  Attributes:
    rule: the regex that matched the param's path; ``None``: the param's
      Flax ``out_sharding`` metadata.
    spec: the ``PartitionSpec`` entries of the param's trailing dims
      (``None``, a mesh axis name or a tuple of them), at most its rank.
  """
  rule: str | None
  spec: tuple[Any, ...]


class _Leaf(NamedTuple):
  """A leaf of a params pytree: its path, shape and Flax sharding metadata."""
  path: str
  shape: tuple[int, ...]
  sharding: Any


def _path(key_path: tuple[Any, ...]) -> str:
  """``'attn/query/kernel'`` of a key path; an ``nnx.Variable``'s trailing
  ``.value`` is dropped."""
  if key_path and isinstance(key_path[-1], jax.tree_util.GetAttrKey) and (
      key_path[-1].name == 'value'):
    key_path = key_path[:-1]
  return '/'.join(jax.tree_util.keystr((k,), simple=True, separator='/')
                  for k in key_path)


def _leaves(params: PyTree) -> tuple[list[_Leaf], Any]:
  """The leaves of ``params`` with their paths and metadata, and the treedef."""
  is_variable = lambda x: isinstance(x, nnx.Variable)
  shardings = []
  for node in jax.tree.leaves(params, is_leaf=is_variable):
    sharding = (node.get_metadata().get('out_sharding')
                if is_variable(node) else None)
    shardings += [sharding] * len(jax.tree.leaves(node))
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  leaves = [_Leaf(_path(path), tuple(getattr(leaf, 'shape', ())), sharding)
            for (path, leaf), sharding in zip(flat, shardings, strict=True)]
  return leaves, treedef


def _check_entry(entry: Any) -> bool:
  """Whether ``entry`` is a ``PartitionSpec`` entry: None, a name, names."""
  return entry is None or isinstance(entry, str) or (
      isinstance(entry, tuple) and all(isinstance(e, str) for e in entry))


def _check_rules(rules: Rules, tensor_axis: str) -> dict[str, tuple[Any, ...]]:
  """``rules`` as ``{regex: spec tuple}``, each regex and spec checked."""
  example = f"{{r'mlp/fc_in/(kernel|bias)': ({tensor_axis!r},)}}"
  if not isinstance(rules, Mapping):
    raise TypeError(f'tensor rules must map regexes over /-joined param paths '
                    f'to PartitionSpec entries, e.g. {example}, got a '
                    f'{type(rules).__name__}.')
  checked = {}
  for rule, spec in rules.items():
    if not isinstance(rule, str):
      raise TypeError(f'tensor rule {rule!r} must be a regex string over '
                      f"/-joined param paths (e.g. 'mlp/fc_in/kernel').")
    try:
      re.compile(rule)
    except re.error as e:
      raise ValueError(f'tensor rule {rule!r} is not a valid regex: {e}.'
                       ) from None
    if isinstance(spec, str) or not isinstance(spec, Sequence) or not all(
        _check_entry(e) for e in spec):
      raise TypeError(
          f'tensor rule {rule!r}: {spec!r} must be the PartitionSpec entries '
          f"of the param's trailing dims, a tuple of None, axis names or "
          f'tuples of them, e.g. (None, {tensor_axis!r}).')
    checked[rule] = tuple(spec)
  return checked


def _metadata_spec(sharding: Any, tensor_axis: str) -> tuple[Any, ...]:
  """The ``tensor_axis`` entries of a Flax ``out_sharding`` (others:
  ``None``)."""
  if isinstance(sharding, NamedSharding):
    sharding = sharding.spec
  if sharding is None or isinstance(sharding, str):
    return ()
  return tuple(tensor_axis if e == tensor_axis
               or (isinstance(e, tuple) and tensor_axis in e)
               else None for e in sharding)


def match_rules(paths: Mapping[str, int], rules: Rules | None = None, *,
                metadata: Mapping[str, Any] | None = None,
                tensor_axis: str = 'tensor') -> dict[str, RuleMatch]:
  """How the params at ``paths`` are split, by tensor rules or metadata.

  With ``rules``, the first rule (in order) whose regex matches a param's
  whole ``/``-joined path (``re.fullmatch``) gives the ``PartitionSpec``
  entries of its trailing dims, as written. With ``rules=None``, each
  param's Flax ``out_sharding`` in ``metadata`` gives them, its ``tensor_axis``
  entries only (other axes become ``None``).

  Args:
    paths: ``/``-joined param path -> the param's rank.
    rules: ``{regex: spec entries}``, e.g. ``{r'mlp/fc_in/(kernel|bias)':
      ('tensor',)}``; ``None``: ``metadata``.
    metadata: path -> the param's Flax ``out_sharding`` (a tuple of names
      or a ``PartitionSpec``; ``None`` for none), used when ``rules`` is
      ``None``.
    tensor_axis: the tensor-parallel mesh axis, the one entry kept from
      metadata.

  Returns:
    ``{path: RuleMatch(rule, spec)}`` for the matched paths (``rule`` is
    ``None`` for metadata, whose params without a ``tensor_axis`` entry are
    left out); the rules that match no path are those not among the
    ``rule`` s.

  Raises:
    TypeError: ``rules`` is not a mapping of regex strings to tuples of
      ``PartitionSpec`` entries.
    ValueError: a regex does not compile, or a spec has more entries than
      the param it matches has dims (both named).

  Example:
    >>> import jaxpar
    >>> rules = {r'mlp/fc_in/(kernel|bias)': ('tensor',),
    ...          r'mlp/fc_out/kernel': ('tensor', None)}
    >>> jaxpar.tensor_parallel.match_rules(
    ...     {'mlp/fc_in/kernel': 2, 'mlp/fc_out/bias': 1}, rules)
    {'mlp/fc_in/kernel': RuleMatch(rule='mlp/fc_in/(kernel|bias)',
                                   spec=('tensor',))}
  """
  if rules is None:
    metadata = {} if metadata is None else metadata
    found = {path: (None, _metadata_spec(metadata.get(path), tensor_axis))
             for path in paths}
    found = {path: m for path, m in found.items() if tensor_axis in m[1]}
  else:
    checked = _check_rules(rules, tensor_axis)
    found = {}
    for path in paths:
      rule = next((r for r in checked if re.fullmatch(r, path)), None)
      if rule is not None:
        found[path] = (rule, checked[rule])
  for path, (rule, spec) in found.items():
    if len(spec) > paths[path]:
      by = ('its Flax metadata out_sharding=' + repr(metadata.get(path))
            if rule is None else f'tensor rule {rule!r}: {spec}')
      raise ValueError(
          f'{by} has {len(spec)} entries but param {path!r} has '
          f"{paths[path]} dims; the entries are those of the param's trailing "
          'dims: give at most that many, or narrow the regex.')
  return {path: RuleMatch(*m) for path, m in found.items()}


def _matches(params: PyTree, rules: Rules | None, tensor_axis: str
             ) -> tuple[list[_Leaf], Any, dict[str, RuleMatch]]:
  """The leaves of ``params``, its treedef, and how its leaves are split."""
  leaves, treedef = _leaves(params)
  matches = match_rules({leaf.path: len(leaf.shape) for leaf in leaves},
                        rules, tensor_axis=tensor_axis,
                        metadata={leaf.path: leaf.sharding for leaf in leaves})
  return leaves, treedef, matches


def _partition_spec(match: RuleMatch | None, ndim: int) -> P:
  """The full ``PartitionSpec`` of a param of rank ``ndim``; ``P()`` when
  it is not split."""
  if match is None or all(e is None for e in match.spec):
    return P()
  return P(*(None,) * (ndim - len(match.spec)), *match.spec)


def param_specs(params: PyTree, *, rules: Rules | None = None,
                tensor_axis: str = 'tensor') -> PyTree:
  """The ``PartitionSpec`` of every leaf of a dense params pytree.

  A leaf whose ``/``-joined path a tensor rule matches whole
  (``re.fullmatch``, the first rule in order) is split as the rule says,
  over its trailing dims (so stacked layers, with extra leading dims, take
  the same rules); without ``rules``, as its ``nnx.Variable``'s Flax
  metadata says (``out_sharding``, its ``tensor_axis`` entries). Every other
  leaf is replicated, ``P()``. A spec splits ``kernel [in, out]`` by columns
  with
  ``('tensor',)`` (or ``(None, 'tensor')``), by rows with
  ``('tensor', None)``; attention kernels ``[d, H, k]`` by heads with
  ``('tensor', None)``, ``[H, k, d]`` with ``('tensor', None, None)``.

  Args:
    params: dense params: nested dicts of arrays (or shapes), or an
      ``nnx.State`` from ``nnx.split`` / ``nnx.state``.
    rules: ``{regex: spec entries}`` over ``/``-joined param paths (e.g.
      ``jaxpar.models.gpt.TENSOR_RULES``); rules that match no leaf are
      allowed (one rule set serves a model's several parts). ``None``: the
      params' Flax metadata; a pure dict then stays replicated.
    tensor_axis: the tensor-parallel mesh axis: the entry kept from Flax
      metadata.

  Returns:
    a pytree of ``PartitionSpec`` with the structure of ``params``: the
    ``in_specs`` (and gradient ``out_specs``) for ``jax.shard_map``.

  Raises:
    TypeError: ``rules`` is not a mapping of regexes to spec entries.
    ValueError: a regex that does not compile, or a spec with more entries
      than the dims of a param it matches (the path and rule named).

  Example:
    >>> import jaxpar
    >>> from flax import nnx
    >>> mlp = jaxpar.models.MLP(8, 32, rngs=nnx.Rngs(0))
    >>> params = nnx.to_pure_dict(nnx.state(mlp, nnx.Param))
    >>> jaxpar.tensor_parallel.param_specs(
    ...     params, rules=jaxpar.models.mlp.TENSOR_RULES)
    {'fc_in': {'bias': P('tensor',), 'kernel': P(None, 'tensor')},
     'fc_out': {'bias': P(), 'kernel': P('tensor', None)}}
    >>> state = nnx.state(jaxpar.tensor_parallel.ParallelMLP(   # Flax metadata
    ...     8, 32, rngs=nnx.Rngs(0)), nnx.Param)
    >>> jaxpar.tensor_parallel.param_specs(state)['fc_in']['kernel'].get_value()
    P(None, 'tensor')
  """
  leaves, treedef, matches = _matches(params, rules, tensor_axis)
  return treedef.unflatten(_partition_spec(matches.get(leaf.path),
                                           len(leaf.shape))
                           for leaf in leaves)


def _division_errors(leaf: _Leaf, match: RuleMatch,
                     sizes: Mapping[str, int]) -> list[str]:
  """Why ``leaf`` cannot be split as ``match`` says over a mesh of axis
  ``sizes``: one line per dim."""
  by = 'its Flax metadata' if match.rule is None else f'rule {match.rule!r}'
  offset = len(leaf.shape) - len(match.spec)
  errors = []
  for i, entry in enumerate(match.spec):
    if entry is None:
      continue
    names = entry if isinstance(entry, tuple) else (entry,)
    missing = [name for name in names if name not in sizes]
    dim = offset + i
    where = f'  param {leaf.path!r} {leaf.shape}: dim {dim}'
    if missing:
      errors.append(f'{where} is split over {missing[0]!r} by {by}, an axis '
                    f'the mesh does not have')
      continue
    size = math.prod(sizes[name] for name in names)
    if leaf.shape[dim] % size:
      errors.append(f'{where} of size {leaf.shape[dim]} is split over '
                    f'{entry!r} by {by} but does not divide by its size '
                    f'{size}')
  return errors


def check_divisible(params: PyTree, *, mesh: jax.sharding.Mesh,
                    rules: Rules | None = None,
                    tensor_axis: str = 'tensor') -> None:
  """``ValueError`` unless every split dim of ``params`` divides by its axes.

  The dims that ``param_specs`` splits (hidden size, heads, vocabulary) must
  be multiples of the sizes of the mesh axes they are split over; all
  offending params are listed, with the rule that splits them.

  Args:
    params: dense params (dicts of arrays or shapes, or an ``nnx.State``).
    mesh: the mesh.
    rules: as in ``param_specs``.
    tensor_axis: the tensor-parallel mesh axis; ``mesh`` must have it.

  Raises:
    TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
    ValueError: ``mesh`` has no ``tensor_axis``, a spec names an axis not in
      ``mesh``, or a split dim does not divide.

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> from jaxpar.tensor_parallel import internal
    >>> params = {'fc_in': {'kernel': jnp.ones((8, 12))}}
    >>> internal.check_divisible(
    ...     params, mesh=jaxpar.make_mesh(tensor=8),
    ...     rules={'fc_in/kernel': (None, 'tensor')})
    Traceback (most recent call last):
    ...
    ValueError: cannot split these params over the mesh {'data': 1,
    'stage': 1, 'tensor': 8}:
      param 'fc_in/kernel' (8, 12): dim 1 of size 12 is split over 'tensor'
      by rule 'fc_in/kernel' but does not divide by its size 8
    Choose sizes divisible by the axis sizes, smaller axes, or rules that
    split other dims.
  """
  axis_size(mesh, tensor_axis)   # a Mesh with the axis
  sizes = dict(mesh.shape)
  leaves, _, matches = _matches(params, rules, tensor_axis)
  errors = [error for leaf in leaves if leaf.path in matches
            for error in _division_errors(leaf, matches[leaf.path], sizes)]
  if errors:
    raise ValueError(
        f'cannot split these params over the mesh {sizes}:\n'
        + '\n'.join(errors) + '\nChoose sizes divisible by the axis sizes, '
        'smaller axes, or rules that split other dims.')


def shard_params(params: PyTree, *, mesh: jax.sharding.Mesh,
                 rules: Rules | None = None,
                 tensor_axis: str = 'tensor') -> PyTree:
  """Places dense params on ``mesh`` with the specs of ``param_specs``.

  The result has the same (dense, global) shapes; each device stores only
  its shard, which ``jax.shard_map`` with ``in_specs=param_specs(params)``
  hands to the layers.

  Args:
    params: dense params (dicts of arrays or an ``nnx.State``).
    mesh: the mesh, e.g. ``jaxpar.make_mesh(tensor=4)``.
    rules: as in ``param_specs``: tensor rules, or ``None`` for the params'
      Flax metadata.
    tensor_axis: the tensor-parallel mesh axis.

  Returns:
    params with every leaf a ``jax.Array`` sharded as ``param_specs`` says.

  Raises:
    ValueError: a split dim (hidden size, heads, vocabulary) not divisible
      by its axis size; all offending leaves are listed.

  Example:
    >>> import jax, jaxpar
    >>> from flax import nnx
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> mlp = jaxpar.models.MLP(8, 32, rngs=nnx.Rngs(0))
    >>> params = jaxpar.tensor_parallel.shard_params(
    ...     nnx.state(mlp, nnx.Param), mesh=mesh,
    ...     rules=jaxpar.models.mlp.TENSOR_RULES)
    >>> kernel = params['fc_in']['kernel'][...]
    >>> kernel.shape, kernel.sharding.shard_shape(kernel.shape)
    ((8, 32), (8, 8))
  """
  check_divisible(params, mesh=mesh, rules=rules, tensor_axis=tensor_axis)
  specs = param_specs(params, rules=rules, tensor_axis=tensor_axis)
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                      params, specs)


def check_axis_used(specs: PyTree, *, mesh: jax.sharding.Mesh,
                    tensor_axis: str = 'tensor') -> None:
  """``ValueError`` if ``tensor_axis`` has size > 1 but no spec in ``specs``
  uses it.

  Without a parameter split over ``tensor_axis``, each of its devices holds and
  computes the whole model: the same numbers as a mesh without the axis,
  for ``size`` times the memory and time. The 3D train step
  (``jaxpar.parallel.trainer``) checks its tensor rules with it.

  Args:
    specs: a pytree of ``PartitionSpec`` (``param_specs`` of the params).
    mesh: the mesh.
    tensor_axis: the tensor-parallel mesh axis.

  Raises:
    ValueError: ``mesh`` has no ``tensor_axis``, or ``tensor_axis`` is unused.

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> from jaxpar.tensor_parallel import internal
    >>> mesh = jaxpar.make_mesh(data=2, stage=2, tensor=2)
    >>> specs = jaxpar.tensor_parallel.param_specs({'w': jnp.ones((4, 4))})
    >>> internal.check_axis_used(specs, mesh=mesh)
    Traceback (most recent call last):
    ...
    ValueError: the mesh {'data': 2, 'stage': 2, 'tensor': 2} has a 'tensor'
    axis of size 2, but no parameter is split over 'tensor' ... or leave
    'tensor' out of the mesh (e.g. jaxpar.make_mesh(data=4, stage=2)).
  """
  n = axis_size(mesh, tensor_axis)
  specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  if n == 1 or any(tensor_axis in (d if isinstance(d, tuple) else (d,))
                   for spec in specs for d in spec):
    return
  sizes = dict(mesh.shape)
  others = [name for name in sizes if name != tensor_axis]
  without = ''
  if others and set(sizes) <= {'data', 'stage', 'tensor'}:  # make_mesh axes
    sizes[others[0]] *= n
    without = ' (e.g. jaxpar.make_mesh({}))'.format(
        ', '.join(f'{name}={sizes[name]}' for name in others))
  raise ValueError(
      f'the mesh {dict(mesh.shape)} has a {tensor_axis!r} axis of size {n}, '
      f'but no parameter is split over {tensor_axis!r} (no tensor rule '
      'matches a param, and no param carries Flax metadata naming '
      f'{tensor_axis!r}): each of its {n} '
      f'devices would hold and compute the whole model, for nothing. Split '
      f'the params over {tensor_axis!r} with tensor rules (tensor_rules= of '
      'jaxpar.parallel.trainer or from_nnx, e.g. '
      "jaxpar.models.gpt.TENSOR_RULES for jaxpar's GPT with "
      "jaxpar.tensor_parallel's layers; see tensor_parallel.param_specs) or "
      'Flax metadata (nnx.with_partitioning); or leave '
      f'{tensor_axis!r} out of the '
      f'mesh{without}.')


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
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> tp = jaxpar.tensor_parallel
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> params = {'fc_in': {'kernel': jnp.ones((8, 32))}}
    >>> sharded = tp.shard_params(params, mesh=mesh,
    ...                           rules={'fc_in/kernel': ('tensor',)})
    >>> tp.unshard_params(sharded)['fc_in']['kernel'].sharding.spec
    P()
  """
  def replicate(x):
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding):
      return jax.device_put(x, NamedSharding(sharding.mesh, P()))
    return x

  return jax.tree.map(replicate, params)
