"""How ``from_nnx`` reads a Flax NNX model: the ``Cut``.

The blocks (where the model keeps them: a sequence of modules, numbered
attributes ``blocks_0 ... blocks_N`` as ``nnx.bridge.ToNNX`` keeps a Linen
model's list, a list of paths, or one module stacked over layers), grouped
into *kinds* (one structure and one ``block`` function each), their split over
stages, the non-block params split between ``embed`` and ``head``, the blocks'
``nnx.BatchStat`` s; and the moves between the model's own state and the
pipeline's stacked trees (``from_state``, ``to_state``, ``stacked_blocks``).

With one kind a slot's params are one block's, by path inside the block.
With several (an encoder's layers, then a decoder's) a slot holds the union
``{kind: params}``: the layer's own kind, the others zeros that it never
reads (``_nnx_functions`` picks the kind whose params are not all zero).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.parallel._nnx_linen import NUMBERED as _NUMBERED
from jaxpar.parallel._nnx_linen import linen_block as _linen_block
from jaxpar.parallel._params import LayerSplit, PipelineParams
from jaxpar.parallel._params import flat as _flat
from jaxpar.parallel._params import nest as _nest

PyTree = Any
Path = tuple[Any, ...]
BlockFn = Callable[[Any, Any], Any]

def path_name(path: Path) -> str:
  return '/'.join(str(k) for k in path)


def call_block(b: Any, x: Any) -> Any:
  """The default ``block``: ``b(x)``."""
  return b(x)


def _attributes(node: Any) -> list[str]:
  """A module's attribute names in definition order; a dict's keys."""
  if isinstance(node, dict):
    return [k for k in node if isinstance(k, str)]
  return [k for k in vars(node) if not k.startswith('_')]


def _child(node: Any, name: Any) -> Any:
  if isinstance(node, (dict, nnx.List, list, tuple)):
    return node[name]
  return getattr(node, name)


def _numbered(node: Any, base: str) -> list[str]:
  """``base_0, base_1, ...``: the attributes of ``node`` numbered from 0."""
  names, found = set(_attributes(node)), []
  while f'{base}_{len(found)}' in names:
    found.append(f'{base}_{len(found)}')
  return found


def _candidates(model: nnx.Module) -> list[str]:
  """``blocks`` values that name several layers of ``model``: its sequences
  of modules and its numbered attributes (``'blocks'`` for ``blocks_0,
  blocks_1, ...``)."""
  found = []
  for path, node in nnx.iter_graph(model):
    where = '.'.join(map(str, path))
    if (isinstance(node, (nnx.List, list, tuple)) and len(node)
        and all(isinstance(n, nnx.Module) for n in node)):
      found.append(where)
    if isinstance(node, (nnx.Module, dict)) and not isinstance(node, nnx.List):
      for name in _attributes(node):
        m = _NUMBERED.fullmatch(name)
        if m and m['index'] == '0' and len(_numbered(node, m['base'])) > 1:
          found.append('.'.join(filter(None, (where, m['base']))))
  return found


class _Entry(NamedTuple):
  """One entry of ``blocks``: its layers' model paths and nodes."""
  name: str
  paths: list[Path]
  nodes: list[Any]
  single: bool          # one module (stacked over layers if it is all)


def _entry(model: nnx.Module, name: Any) -> _Entry:
  """The layers one ``blocks`` path names."""
  if not isinstance(name, str) or not name:
    raise TypeError(f"blocks must be an attribute path such as 'blocks' or "
                    f"'decoder.layers' (or a list of them), got {name!r}.")
  node, path = model, ()
  parts = name.split('.')
  for i, part in enumerate(parts):
    if part in _attributes(node):
      node, path = _child(node, part), path + (part,)
      continue
    members = _numbered(node, part) if i == len(parts) - 1 else []
    if members:
      return _Entry(name, [path + (m,) for m in members],
                    [_child(node, m) for m in members], False)
    where = type(model).__name__ + ''.join('.' + str(p) for p in path)
    raise ValueError(
        f'blocks={name!r}: {where} has no attribute {part!r}; its '
        f'attributes are {_attributes(node)}. Pass the path of the layers: '
        f'these name several layers of this model: {_candidates(model)} '
        "(or a list of paths, one per layer).")
  if isinstance(node, (nnx.List, list, tuple)):
    return _Entry(name, [path + (i,) for i in range(len(node))], list(node),
                  False)
  return _Entry(name, [path], [node], True)


# ------------------------------------------------------------- block kinds


class Kind(NamedTuple):
  """Layers of one structure run by one ``block`` function.

  Attributes:
    key: the kind's key in a slot's union of params (the first ``blocks``
      entry of the kind), ``None`` when it is the only kind.
    call: ``block(b, x) -> x``.
    graphdef: one layer as a callable module (a ``LinenBlock`` for Linen
      layers); ``inner`` the path of the layer's variables in it.
    params: one layer's params as ``nnx.Param`` s by path inside a block;
      ``stats`` its ``nnx.BatchStat`` s; ``other`` its other variables.
    sharding: the Flax ``out_sharding`` of each param.
  """
  key: str | None
  call: BlockFn
  graphdef: Any
  inner: Path
  params: dict[Path, nnx.Param]
  stats: dict[Path, Any]
  other: list[tuple[Path, Any]]
  sharding: dict[Path, Any]


def _structure(module: Any) -> tuple:
  graphdef, params = nnx.split(module, nnx.Param, ...)[:2]
  return graphdef, {k: (np.shape(v.get_value()), v.get_value().dtype)
                    for k, v in nnx.to_flat_state(params)}


def _kind(key: str | None, call: BlockFn, module: Any, inner: Path) -> Kind:
  graphdef, params, stats, other = nnx.split(module, nnx.Param,
                                             nnx.BatchStat, ...)
  strip = lambda flat: {p[len(inner):]: v for p, v in flat}
  params = strip(nnx.to_flat_state(params))
  return Kind(key, call, graphdef, inner,
              {p: nnx.Param(v.get_value()) for p, v in params.items()},
              strip(nnx.to_flat_state(stats)),
              list(nnx.to_flat_state(other)),
              {p: v.get_metadata().get('out_sharding')
               for p, v in params.items()})


def _block_fns(block: Any, entries: list[_Entry]) -> list[BlockFn]:
  """Each entry's ``block`` function."""
  if block is None:
    return [call_block] * len(entries)
  if callable(block):
    return [block] * len(entries)
  names = [e.name for e in entries]
  if not isinstance(block, Mapping) or sorted(block) != sorted(names) or not (
      all(callable(f) for f in block.values())):
    raise TypeError(
        f'block must be a function block(b, x) -> x (how a block b runs on '
        f'the carried activation x), or a dict of one per blocks entry '
        f'{names}; got {block!r}.')
  return [block[n] for n in names]


def _kinds(model: nnx.Module, entries: list[_Entry], block: Any
           ) -> tuple[list[Kind], list[int]]:
  """The kinds of the layers, and each layer's kind, in model order."""
  kinds, of, seen, lists = [], [], {}, {}
  for entry, call in zip(entries, _block_fns(block, entries)):
    first = None
    for i, (path, node) in enumerate(zip(entry.paths, entry.nodes)):
      module, at = node, ()
      if not isinstance(node, nnx.Module):
        # Layers of one Linen list (`blocks_0`, `blocks_1`, ...) all run
        # as the first: one graphdef.
        module = _linen_block(model, path, node)
        at = lists.setdefault(_list_of(module.to_nnx__path),
                              module.to_nnx__path)
        if at != module.to_nnx__path:
          module = _linen_block(model, path, node, at)
      shape = _structure(module)
      if first is None:
        first = (shape, type(node).__name__, at)
      elif shape != first[0]:
        diff = sorted(set(shape[1].items()) ^ set(first[0][1].items()))
        raise ValueError(
            f'blocks={entry.name!r}: block {i} ({type(node).__name__}) '
            f'differs in structure from block 0 ({first[1]})'
            + (f', e.g. at {path_name(diff[0][0][len(at):])!r}'
               if diff else '')
            + '. Pipeline stages stack identical blocks: keep the differing '
            'layers out of `blocks` (in embed or head_loss), list them as '
            'an entry of their own, or make them the same.')
      sig = (shape[0], str(shape[1]), call)
      if sig not in seen:
        seen[sig] = len(kinds)
        kinds.append(_kind(entry.name, call, module, at))
      of.append(seen[sig])
  if len(kinds) == 1:
    kinds = [kinds[0]._replace(key=None)]
  return kinds, of


def _list_of(path: Path) -> Path:
  """A Linen path with each ``base_i`` as ``base``: the list it is in."""
  return tuple(m['base'] if (m := _NUMBERED.fullmatch(str(k))) else k
               for k in path)


def _stacked_kind(node: nnx.Module, blocks: str, call: BlockFn
                  ) -> tuple[Kind, int]:
  """The one kind of a module stacked over layers, and its layer count."""
  graphdef, params, stats, other = nnx.split(node, nnx.Param, nnx.BatchStat,
                                             ...)
  flat = dict(nnx.to_flat_state(params))
  sizes = {p: np.shape(v.get_value())[:1] for p, v in flat.items()}
  if not flat or len(set(sizes.values())) != 1 or () in sizes.values():
    raise ValueError(
        f'blocks={blocks!r} is one {type(node).__name__}, so its params '
        f'must be stacked over layers (one leading layer dim, as nnx.vmap '
        f'makes them), but their leading dims are '
        f'{ {path_name(p): s for p, s in sizes.items()} }. Pass the path of a '
        'list of layers or of a module built with nnx.vmap.')
  (num,) = next(iter(sizes.values()))
  first = lambda state: [
      (p, v.replace(jax.tree.map(lambda a: a[0], v.get_value())))
      for p, v in nnx.to_flat_state(state)]
  return Kind(None, call, graphdef, (),
              {p: nnx.Param(v.get_value()[0]) for p, v in flat.items()},
              dict(first(stats)), first(other),
              {p: v.get_metadata().get('out_sharding')
               for p, v in flat.items()}), num


# -------------------------------------------------------------------- Cut


class Cut(NamedTuple):
  """How ``from_nnx`` cuts one model: what every function of the
  ``PipelineModel`` reads.

  Attributes:
    graphdef: the whole model's graphdef; ``template`` its flat state by
      path (the values and metadata a rebuilt model starts from).
    params: the paths of the model's ``nnx.Param`` s; ``stats`` of its
      ``nnx.BatchStat`` s.
    blocks: ``blocks`` as the user wrote it.
    prefixes: the model path of each layer, in model order (a stacked
      module: its one path); ``stacked``: the layers are one module's.
    kinds: the blocks' kinds; ``layer_kinds`` each layer's.
    split: which layers sit on which stage.
    embed_paths, head_paths: the non-block params of each side;
      ``embed_stats``, ``head_stats`` its ``nnx.BatchStat`` s (a ResNet's
      stem norm in ``embed``), carried like the blocks'.
    reads: ``_reads``' memo: the params each ``(function, avals)`` reads
      outside its own.
  """
  graphdef: Any
  template: dict[Path, Any]
  params: frozenset[Path]
  stats: frozenset[Path]
  blocks: Any
  prefixes: tuple[Path, ...]
  stacked: bool
  kinds: tuple[Kind, ...]
  layer_kinds: tuple[int, ...]
  split: LayerSplit
  embed_paths: frozenset[Path]
  head_paths: frozenset[Path]
  reads: dict
  embed_stats: frozenset[Path] = frozenset()
  head_stats: frozenset[Path] = frozenset()

  def layer_of(self, path: Path) -> int | None:
    """The index of the (non-stacked) layer holding ``path``, or ``None``."""
    for i, prefix in enumerate(self.prefixes):
      if path[:len(prefix)] == prefix:
        return i
    return None

  def in_blocks(self, path: Path) -> bool:
    return self.layer_of(path) is not None

  def union_path(self, layer: int, inner: Path) -> Path:
    """A layer's variable by its path in a slot's (union of) params."""
    key = self.kinds[self.layer_kinds[layer]].key
    return inner if key is None else (key,) + inner

  def kind_of(self, slot_path: Path) -> tuple[int, Path]:
    """``(kind, path inside a block)`` of a path in a slot's params."""
    if len(self.kinds) == 1:
      return 0, slot_path
    return [k.key for k in self.kinds].index(slot_path[0]), slot_path[1:]


def _check_unshared(model: nnx.Module, prefixes: Sequence[Path],
                    nodes: Sequence[Any]) -> None:
  """``ValueError`` for a block param that is another one's ``nnx.Param``."""
  owner = {id(v): p for p, v in nnx.iter_graph(model)
           if isinstance(v, nnx.Variable)}
  for prefix, node in zip(prefixes, nodes):
    for q, v in nnx.iter_graph(node):
      where = prefix + q
      if isinstance(v, nnx.Param) and owner[id(v)] != where:
        raise ValueError(
            f'param {path_name(where)!r} is the same nnx.Param as '
            f'{path_name(owner[id(v)])!r}: in a pipeline each stage holds and '
            'updates the params of its own blocks, so a block param cannot '
            'be shared with another block or with embed/head_loss. Give '
            'each block its own param, or keep the shared layer out of '
            '`blocks` (embed and head_loss may share params: tied '
            'embeddings).')


def _layer_split(num: int, num_stages: Any, counts: Sequence[int] | None,
                 blocks: Any) -> LayerSplit:
  """``num`` layers on ``num_stages`` stages, ``counts`` checked."""
  if isinstance(num_stages, bool) or not isinstance(num_stages,
                                                    (int, np.integer)):
    raise TypeError(f'num_stages={num_stages!r} must be an int.')
  if not 1 <= num_stages <= num:
    raise ValueError(
        f'num_stages={num_stages}: blocks={blocks!r} has {num} layers; use '
        f'1 <= num_stages <= {num} (schedule.num_stages), or more layers.')
  if counts is not None:
    counts = tuple(int(c) for c in counts)
    if len(counts) != num_stages or min(counts) < 1 or sum(counts) != num:
      raise ValueError(
          f'counts={counts}: need {num_stages} positive layer counts summing '
          f'to the {num} layers of {blocks!r}, e.g. jaxpar.pipeline.balance('
          f'layer_costs, {num_stages}).')
  return LayerSplit(num, int(num_stages), counts)


def _sides(model: nnx.Module, anchor: Path, head: Sequence[str] | None,
           rest: Sequence[Path]) -> tuple[set[Path], set[Path]]:
  """Non-block param paths split into (embed, head) ones: by default the
  head's are defined after ``anchor`` (the last blocks) at its level."""
  if head is not None:
    prefixes = [tuple(h.split('/')) for h in head]
    in_head = lambda p: any(p[:len(h)] == h for h in prefixes)
  else:
    def in_head(p):
      node = model
      for i, name in enumerate(anchor):
        if i >= len(p):
          return False
        if p[i] != name:
          names = _attributes(node)
          return (p[i] in names and name in names
                  and names.index(p[i]) > names.index(name))
        node = _child(node, name)
      return False
  heads = {p for p in rest if in_head(p)}
  return set(rest) - heads, heads


def read_cut(model: nnx.Module, blocks: Any, num_stages: Any,
             counts: Sequence[int] | None, head: Sequence[str] | None,
             block: Any = None) -> Cut:
  """Reads ``model``: its blocks and their kinds, their split over stages,
  the two sides."""
  if isinstance(blocks, (list, tuple)) and blocks:
    entries = [_entry(model, name) for name in blocks]
  else:
    entries = [_entry(model, blocks)]
  if isinstance(blocks, str) and entries[0].single:
    kind, num = _stacked_kind(entries[0].nodes[0], blocks,
                              _block_fns(block, entries)[0])
    kinds, layer_kinds, stacked = [kind], [0] * num, True
  else:
    kinds, layer_kinds = _kinds(model, entries, block)
    stacked, num = False, len(layer_kinds)
  prefixes = tuple(p for e in entries for p in e.paths)
  _check_unshared(model, prefixes, [n for e in entries for n in e.nodes])
  split = _layer_split(num, num_stages, counts, blocks)
  graphdef, state = nnx.split(model)
  template = dict(nnx.to_flat_state(state))
  cut = Cut(graphdef=graphdef, template=template,
            params=frozenset(p for p, v in template.items()
                             if isinstance(v, nnx.Param)),
            stats=frozenset(p for p, v in template.items()
                            if isinstance(v, nnx.BatchStat)),
            blocks=blocks, prefixes=prefixes, stacked=stacked,
            kinds=tuple(kinds), layer_kinds=tuple(layer_kinds), split=split,
            embed_paths=frozenset(), head_paths=frozenset(), reads={})
  last = prefixes[-1]   # a sequence's last item: the sequence
  anchor = last[:-1] if isinstance(last[-1], int) else last
  rest = [p for p in cut.params if not cut.in_blocks(p)]
  embed_paths, head_paths = _sides(model, anchor, head, rest)
  embed_stats, head_stats = _sides(
      model, anchor, head, [p for p in cut.stats if not cut.in_blocks(p)])
  if head is not None:
    unknown = [h for h in head if not any(
        path_name(p).startswith(h) for p in head_paths)]
    if unknown:
      raise ValueError(f'head={list(head)}: {unknown} match no non-block '
                       f'param; they are {sorted(map(path_name, rest))}.')
  return cut._replace(embed_paths=frozenset(embed_paths),
                      head_paths=frozenset(head_paths),
                      embed_stats=frozenset(embed_stats),
                      head_stats=frozenset(head_stats))


# ------------------------------------------------- model params <-> pipeline


def from_state(cut: Cut, model_params: nnx.State) -> PipelineParams:
  """``PipelineModel.from_state``: the model's params as ``PipelineParams``."""
  flat = variable_values(model_params)
  part = lambda paths: _nest({p: flat[p] for p in sorted(paths, key=path_name)})
  return PipelineParams(part(cut.embed_paths), stacked_blocks(cut, flat),
                        part(cut.head_paths))


def variable_values(state: nnx.State) -> dict[Path, Any]:
  return {p: v.get_value() if isinstance(v, nnx.Variable) else v
          for p, v in nnx.to_flat_state(state)}


def _per_layer(cut: Cut, flat: dict[Path, Any]) -> list[dict[Path, Any]]:
  """Each layer's variables of ``flat`` by path in a slot's params; with
  several kinds, zeros for the other kinds' (the union)."""
  num = cut.split.num_layers
  if cut.stacked:
    (prefix,) = cut.prefixes
    return [{p[len(prefix):]: v[i] for p, v in flat.items()
             if p[:len(prefix)] == prefix} for i in range(num)]
  per_layer = [{} for _ in range(num)]
  for p, v in flat.items():
    i = cut.layer_of(p)
    if i is not None:
      per_layer[i][cut.union_path(i, p[len(cut.prefixes[i]):])] = v
  if len(cut.kinds) > 1:
    like = {}
    for layer in per_layer:
      like.update({p: jax.ShapeDtypeStruct(np.shape(v), v.dtype)
                   for p, v in layer.items()})
    per_layer = [{p: layer[p] if p in layer else np.zeros(a.shape, a.dtype)
                  for p, a in like.items()} for layer in per_layer]
  return per_layer


def stacked_blocks(cut: Cut, flat: dict[Path, Any]) -> PyTree:
  """The block variables of ``flat`` (by model path) stacked
  ``[num_stages, slots, ...]``."""
  return _nest(cut.split.stack(_per_layer(cut, flat)))


def _real_slots(split: LayerSplit) -> tuple[tuple[int, int], ...]:
  """``(stage, slot)`` of each layer, in model order."""
  return tuple((k, j) for k, c in enumerate(split.counts) for j in range(c))


def _picked(stacked: bool, picks: tuple, leaves: Sequence[Any]) -> list:
  """The model's layer values from the stage leaves (``stages[k, j]``):
  stacked, every leaf at the ``(k, j)`` of ``picks``; else the ``(leaf,
  k, j)`` of ``picks``."""
  if stacked:
    return [jnp.stack([leaf[k, j] for k, j in picks]) for leaf in leaves]
  return [leaves[n][k, j] for n, k, j in picks]


# Global arrays: one program per signature, where eager indexing compiles
# one op per layer and leaf shape.
_picked_arrays = jax.jit(_picked, static_argnums=(0, 1))


def _layer_leaves(cut: Cut, stages: PyTree) -> dict[Path, Any]:
  """The model's block variables by path from stage leaves
  ``[num_stages, slots, ...]``."""
  stages = _flat(stages)
  leaves = list(stages.values())
  real = _real_slots(cut.split)
  if cut.stacked:
    paths, picks = [cut.prefixes[0] + p for p in stages], real
  else:
    paths, picks = [], []
    for n, p in enumerate(stages):
      kind, inner = cut.kind_of(p)
      for i, k in enumerate(cut.layer_kinds):
        if k == kind:
          paths.append(cut.prefixes[i] + inner)
          picks.append((n,) + real[i])
    picks = tuple(picks)
  arrays = all(isinstance(v, jax.Array) for v in leaves)
  return dict(zip(paths, (_picked_arrays if arrays else _picked)(
      cut.stacked, picks, leaves)))


def model_state(cut: Cut, flat: dict[Path, Any]) -> PipelineParams | None:
  """``PipelineModel.model_state`` of the model's ``nnx.BatchStat`` s
  ``flat`` (by model path): laid out like the params, ``None`` parts where
  a part has none, ``None`` for a model without any."""
  if not cut.stats:
    return None
  side = lambda paths: _nest({p: flat[p] for p in sorted(
      paths, key=path_name)}) if paths else None
  blocks = any(cut.in_blocks(p) for p in cut.stats)
  return PipelineParams(side(cut.embed_stats),
                        stacked_blocks(cut, flat) if blocks else None,
                        side(cut.head_stats))


def to_state(cut: Cut, pp: PipelineParams,
             model_state: PipelineParams | None = None) -> nnx.State:
  """``PipelineModel.to_state``: ``PipelineParams`` as the model's
  ``nnx.Param`` state (and its ``nnx.BatchStat`` s, from a ``model_state``
  laid out like ``PipelineModel.model_state``)."""
  values = {**_flat(pp.embed), **_flat(pp.head),
            **_layer_leaves(cut, pp.stages)}
  paths = cut.params
  if model_state is not None:
    embed, stages, head = model_state
    values.update({**_flat(embed or {}), **_flat(head or {})})
    if stages is not None:
      values.update(_layer_leaves(cut, stages))
    paths = paths | cut.stats
  return nnx.from_flat_state([(p, cut.template[p].replace(values[p]))
                              for p in sorted(paths, key=path_name)])


def param_names(cut: Cut) -> tuple[dict[str, int], dict[str, Any]]:
  """``({name: ndim}, {name: Flax out_sharding})`` of the params, by
  ``'/'``-joined name (block params by their path inside a block)."""
  rest = [p for p in cut.params if not cut.in_blocks(p)]
  names, sharding = {}, {}
  for kind in cut.kinds:
    names.update({path_name(p): np.ndim(v.get_value())
                  for p, v in kind.params.items()})
    sharding.update({path_name(p): s for p, s in kind.sharding.items()})
  names.update({path_name(p): np.ndim(cut.template[p].get_value())
                for p in rest})
  sharding.update({
      path_name(p): cut.template[p].get_metadata().get('out_sharding')
      for p in rest})
  return names, sharding
