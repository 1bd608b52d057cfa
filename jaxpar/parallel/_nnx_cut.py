"""How ``from_nnx`` reads a Flax NNX model: the ``Cut``.

The blocks (a sequence of identical modules or one module stacked over
layers), their split over stages, the non-block params split between
``embed`` and ``head``, the blocks' ``nnx.BatchStat`` s; and the moves
between the model's own state and the pipeline's stacked trees
(``from_state``, ``to_state``, ``stacked_blocks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.parallel._params import LayerSplit, PipelineParams
from jaxpar.parallel._params import flat as _flat
from jaxpar.parallel._params import nest as _nest

PyTree = Any
Path = tuple[Any, ...]


def path_name(path: Path) -> str:
  return '/'.join(str(k) for k in path)


def _attributes(node: Any) -> list[str]:
  """A module's attribute names in definition order."""
  return [k for k in vars(node) if not k.startswith('_')]


def _sequences(model: nnx.Module) -> list[str]:
  """Attribute paths of the module sequences in ``model``: ``blocks`` values."""
  return ['.'.join(map(str, p)) for p, node in nnx.iter_graph(model)
          if isinstance(node, (nnx.List, list, tuple)) and len(node)
          and all(isinstance(n, nnx.Module) for n in node)]


def _find_blocks(model: nnx.Module, blocks: str) -> tuple[Path, Any]:
  if not isinstance(blocks, str) or not blocks:
    raise TypeError(f"blocks must be an attribute path such as 'blocks' or "
                    f"'decoder.layers', got {blocks!r}.")
  node, path = model, ()
  for name in blocks.split('.'):
    if name not in _attributes(node):
      where = type(model).__name__ + ''.join('.' + p for p in path)
      raise ValueError(
          f'blocks={blocks!r}: {where} has no attribute {name!r}; its '
          f'attributes are {_attributes(node)}. Pass the path of the layers, '
          f'one of the module sequences of this model: {_sequences(model)}.')
    node, path = getattr(node, name), path + (name,)
  return path, node


class _Layers(NamedTuple):
  """The blocks: one graphdef, each layer's params, one layer's other state."""
  graphdef: Any
  params: list[dict[Path, jax.Array]]   # per layer, by path inside a block
  other: list[tuple[Path, Any]]          # other variables of one layer
  stacked: bool
  sharding: dict[Path, Any]              # Flax out_sharding of each param
  stats: dict[Path, Any]                 # one layer's nnx.BatchStat s


def _layers(node: Any, blocks: str) -> _Layers:
  """Reads a sequence of identical modules or one stacked module."""
  if isinstance(node, nnx.Module) and not isinstance(node, nnx.List):
    return _stacked_layers(node, blocks)
  if not isinstance(node, (nnx.List, list, tuple)) or not len(node):
    raise ValueError(
        f'blocks={blocks!r} is a {type(node).__name__}; it must name a '
        'non-empty nnx.List, list or tuple of identical NNX modules, or one '
        'module whose params are stacked over layers (nnx.vmap).')
  graphdef, params, stats, other = nnx.split(node[0], nnx.Param,
                                             nnx.BatchStat, ...)
  first = dict(nnx.to_flat_state(params))
  layers = []
  for i, block in enumerate(node):
    g, p = nnx.split(block, nnx.Param, nnx.BatchStat, ...)[:2]
    flat = dict(nnx.to_flat_state(p))
    same = {k: (np.shape(v.get_value()), v.get_value().dtype)
            for k, v in flat.items()}
    want = {k: (np.shape(v.get_value()), v.get_value().dtype)
            for k, v in first.items()}
    if g != graphdef or same != want:
      diff = sorted(set(same.items()) ^ set(want.items()))
      raise ValueError(
          f'blocks={blocks!r}: block {i} ({type(block).__name__}) differs in '
          f'structure from block 0 ({type(node[0]).__name__})'
          + (f', e.g. at {path_name(diff[0][0])!r}' if diff else '')
          + '. Pipeline stages stack identical blocks: keep the differing '
          'layers out of `blocks` (in embed or head_loss), or make them '
          'the same.')
    layers.append({k: v.get_value() for k, v in flat.items()})
  return _Layers(graphdef, layers, list(nnx.to_flat_state(other)), False,
                 {p: v.get_metadata().get('out_sharding')
                  for p, v in first.items()}, dict(nnx.to_flat_state(stats)))


def _stacked_layers(node: nnx.Module, blocks: str) -> _Layers:
  """The layers of one module whose params are stacked over layers."""
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
  sharding = {p: v.get_metadata().get('out_sharding')
              for p, v in flat.items()}
  first = lambda state: [
      (p, v.replace(jax.tree.map(lambda a: a[0], v.get_value())))
      for p, v in nnx.to_flat_state(state)]
  return _Layers(graphdef, [
      {p: v.get_value()[i] for p, v in flat.items()} for i in range(num)],
      first(other), True, sharding, dict(first(stats)))


def _sides(model: nnx.Module, path: Path, head: Sequence[str] | None,
           rest: Sequence[Path]) -> tuple[set[Path], set[Path]]:
  """Non-block param paths split into (embed, head) ones."""
  if head is not None:
    prefixes = [tuple(h.split('/')) for h in head]
    in_head = lambda p: any(p[:len(h)] == h for h in prefixes)
  else:
    def in_head(p):
      node = model
      for i, name in enumerate(path):
        if p[i] != name:
          names = _attributes(node)
          return names.index(p[i]) > names.index(name)
        node = getattr(node, name)
      return False
  heads = {p for p in rest if in_head(p)}
  return set(rest) - heads, heads


class Cut(NamedTuple):
  """How ``from_nnx`` cuts one model: what every function of the
  ``PipelineModel`` reads.

  Attributes:
    graphdef: the whole model's graphdef; ``template`` its flat state by
      path (the values and metadata a rebuilt model starts from).
    params: the paths of the model's ``nnx.Param`` s; ``stats`` of its
      ``nnx.BatchStat`` s (all in the blocks).
    path: the blocks' attribute path; ``blocks`` as the user wrote it.
    layers: the blocks (``_Layers``); ``block_template`` one block's params
      as ``nnx.Param`` s.
    split: which layers sit on which stage.
    embed_paths, head_paths: the non-block params of each side.
    reads: ``_reads``' memo: the params each ``(function, avals)`` reads
      outside its own.
  """
  graphdef: Any
  template: dict[Path, Any]
  params: frozenset[Path]
  stats: frozenset[Path]
  path: Path
  blocks: str
  layers: _Layers
  block_template: dict[Path, nnx.Param]
  split: LayerSplit
  embed_paths: frozenset[Path]
  head_paths: frozenset[Path]
  reads: dict


def _check_unshared(model: nnx.Module, path: Path, node: Any) -> None:
  """``ValueError`` for a block param that is another one's ``nnx.Param``."""
  if not isinstance(node, (nnx.List, list, tuple)):
    return
  owner = {id(v): p for p, v in nnx.iter_graph(model)
           if isinstance(v, nnx.Variable)}
  for i, block in enumerate(node):
    for q, v in nnx.iter_graph(block):
      where = path + (i,) + q
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
                 blocks: str) -> LayerSplit:
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


def read_cut(model: nnx.Module, blocks: str, num_stages: Any,
             counts: Sequence[int] | None, head: Sequence[str] | None) -> Cut:
  """Reads ``model``: its blocks, their split over stages, the two sides."""
  path, node = _find_blocks(model, blocks)
  layers = _layers(node, blocks)
  _check_unshared(model, path, node)
  split = _layer_split(len(layers.params), num_stages, counts, blocks)
  graphdef, state = nnx.split(model)
  template = dict(nnx.to_flat_state(state))
  params = frozenset(p for p, v in template.items()
                     if isinstance(v, nnx.Param))
  stats = frozenset(p for p, v in template.items()
                    if isinstance(v, nnx.BatchStat))
  outside = sorted(path_name(p) for p in stats if p[:len(path)] != path)
  if outside:
    raise ValueError(
        f'nnx.BatchStat {outside[:4]} outside blocks={blocks!r}: from_nnx '
        'carries the statistics of the blocks through the pipeline '
        '(PipelineModel.model_state), not those of embed or head_loss. '
        'Move the normalisation into the blocks, or use a norm without '
        'running statistics there (nnx.LayerNorm, nnx.RMSNorm).')
  rest = [p for p in params if p[:len(path)] != path]
  embed_paths, head_paths = _sides(model, path, head, rest)
  if head is not None:
    unknown = [h for h in head if not any(
        path_name(p).startswith(h) for p in head_paths)]
    if unknown:
      raise ValueError(f'head={list(head)}: {unknown} match no non-block '
                       f'param; they are {sorted(map(path_name, rest))}.')
  return Cut(
      graphdef=graphdef, template=template, params=params, stats=stats,
      path=path,
      blocks=blocks, layers=layers,
      block_template={p: nnx.Param(v) for p, v in layers.params[0].items()},
      split=split, embed_paths=frozenset(embed_paths),
      head_paths=frozenset(head_paths), reads={})


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


def stacked_blocks(cut: Cut, flat: dict[Path, Any]) -> PyTree:
  """The block variables of ``flat`` (by model path) stacked
  ``[num_stages, slots, ...]``."""
  path, num = cut.path, cut.split.num_layers
  inner = lambda p: p[len(path) + (0 if cut.layers.stacked else 1):]
  if cut.layers.stacked:
    per_layer = [{inner(p): v[i] for p, v in flat.items()
                  if p[:len(path)] == path} for i in range(num)]
  else:
    per_layer = [{} for _ in range(num)]
    for p, v in flat.items():
      if p[:len(path)] == path:
        per_layer[p[len(path)]][inner(p)] = v
  return _nest(cut.split.stack(per_layer))


def _real_slots(split: LayerSplit) -> tuple[tuple[int, int], ...]:
  """``(stage, slot)`` of each layer, in model order."""
  return tuple((k, j) for k, c in enumerate(split.counts) for j in range(c))


def _layer_paths(cut: Cut, stage_paths: Sequence[Path]) -> list[Path]:
  """The model's paths of the values ``_layer_values`` gives, in order."""
  if cut.layers.stacked:
    return [cut.path + p for p in stage_paths]
  num = cut.split.num_layers
  return [cut.path + (i,) + p for p in stage_paths for i in range(num)]


def _layer_values(stacked: bool, real: tuple[tuple[int, int], ...],
                  leaves: Sequence[Any]) -> list:
  """The model's layer params from the stage leaves (``stages[k, j]``)."""
  if stacked:
    return [jnp.stack([leaf[k, j] for k, j in real]) for leaf in leaves]
  return [leaf[k, j] for leaf in leaves for k, j in real]


# Global arrays: one program per signature, where eager indexing compiles
# one op per layer and leaf shape.
_layer_arrays = jax.jit(_layer_values, static_argnums=(0, 1))


def _layer_leaves(cut: Cut, stages: PyTree) -> dict[Path, Any]:
  """The model's block variables by path from stage leaves
  ``[num_stages, slots, ...]``."""
  stages = _flat(stages)
  leaves = list(stages.values())
  arrays = all(isinstance(v, jax.Array) for v in leaves)
  return dict(zip(_layer_paths(cut, list(stages)),
                  (_layer_arrays if arrays else _layer_values)(
                      cut.layers.stacked, _real_slots(cut.split), leaves)))


def to_state(cut: Cut, pp: PipelineParams,
             model_state: PyTree = None) -> nnx.State:
  """``PipelineModel.to_state``: ``PipelineParams`` as the model's
  ``nnx.Param`` state (and its ``nnx.BatchStat`` s, from ``model_state``
  ``[num_stages, slots, ...]``)."""
  values = {**_flat(pp.embed), **_flat(pp.head),
            **_layer_leaves(cut, pp.stages)}
  paths = cut.params
  if model_state is not None:
    values.update(_layer_leaves(cut, model_state))
    paths = paths | cut.stats
  return nnx.from_flat_state([(p, cut.template[p].replace(values[p]))
                              for p in sorted(paths, key=path_name)])


def param_names(cut: Cut) -> tuple[dict[str, int], dict[str, Any]]:
  """``({name: ndim}, {name: Flax out_sharding})`` of the params, by
  ``'/'``-joined name (block params by their path inside a block)."""
  rest = [p for p in cut.params if p[:len(cut.path)] != cut.path]
  names = {path_name(p): np.ndim(v) for p, v in cut.layers.params[0].items()}
  names.update({path_name(p): np.ndim(cut.template[p].get_value())
                for p in rest})
  sharding = {path_name(p): s for p, s in cut.layers.sharding.items()}
  sharding.update({
      path_name(p): cut.template[p].get_metadata().get('out_sharding')
      for p in rest})
  return names, sharding
