"""``PipelineModel``: a user's own Flax NNX model cut into pipeline parts.

``from_nnx`` reads a model that keeps its layers as a sequence of identical
NNX modules (``nnx.List``, list, tuple) or as one module whose params are
stacked over layers (``nnx.vmap``/``nnx.scan`` style), and gives what
``jaxpar.parallel.trainer`` takes::

  embed   attributes defined before ``blocks``   embed(m, inputs) -> x
  stages  blocks stacked [num_stages, slots]     each block as written
  head    attributes defined after ``blocks``    head_loss(m, y, targets)

``embed`` and ``head_loss`` are written against the model itself: jaxpar
merges the part's params into a copy of the model and calls them. A stage
runs its ``slots`` blocks, the user's own module code, in one ``lax.scan``.
Layers are balanced over stages (the first ``L % S`` stages get one more);
the missing slots are identity: their params are zeros and the stage passes
its input through (a slot whose params are all zero is skipped), and the
``stage_mask`` freezes them, so the maths is that of the ``L``-layer model.

Variables other than ``nnx.Param`` (RNG state, constant tables) are not
trained: each function sees the model's values, a block those of the first
block. With a ``key`` (dropout) every RNG stream of the merged model is
reseeded from it: ``embed`` and ``head_loss`` with the key the trainer gives,
slot ``j`` of a stage with ``fold_in(key, j)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar import tensor_parallel as tp
from jaxpar.parallel._params import LayerSplit, PipelineParams
from jaxpar.pipeline import executor

PyTree = Any
Path = tuple[Any, ...]


def _name(path: Path) -> str:
  return '/'.join(str(k) for k in path)


def _nest(flat: dict[Path, Any]) -> dict:
  """``{('a', 'b'): x}`` -> ``{'a': {'b': x}}``."""
  out: dict = {}
  for path, value in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = value
  return out


def _flat(tree: dict, prefix: Path = ()) -> dict[Path, Any]:
  """Inverse of ``_nest``."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, prefix + (k,)))
    else:
      out[prefix + (k,)] = v
  return out


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
  other: list[tuple[Path, Any]]          # non-Param variables of one layer
  stacked: bool
  sharding: dict[Path, Any]              # Flax out_sharding of each param


def _layers(node: Any, blocks: str) -> _Layers:
  """Reads a sequence of identical modules or one stacked module."""
  if isinstance(node, nnx.Module) and not isinstance(node, nnx.List):
    return _stacked_layers(node, blocks)
  if not isinstance(node, (nnx.List, list, tuple)) or not len(node):
    raise ValueError(
        f'blocks={blocks!r} is a {type(node).__name__}; it must name a '
        'non-empty nnx.List, list or tuple of identical NNX modules, or one '
        'module whose params are stacked over layers (nnx.vmap).')
  graphdef, params, other = nnx.split(node[0], nnx.Param, ...)
  first = dict(nnx.to_flat_state(params))
  layers = []
  for i, block in enumerate(node):
    g, p = nnx.split(block, nnx.Param, ...)[:2]
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
          + (f', e.g. at {_name(diff[0][0])!r}' if diff else '')
          + '. Pipeline stages stack identical blocks: keep the differing '
          'layers out of `blocks` (in embed or head_loss), or make them '
          'the same.')
    layers.append({k: v.get_value() for k, v in flat.items()})
  return _Layers(graphdef, layers, list(nnx.to_flat_state(other)), False,
                 {p: v.get_metadata().get('out_sharding')
                  for p, v in first.items()})


def _stacked_layers(node: nnx.Module, blocks: str) -> _Layers:
  """The layers of one module whose params are stacked over layers."""
  graphdef, params, other = nnx.split(node, nnx.Param, ...)
  flat = dict(nnx.to_flat_state(params))
  sizes = {p: np.shape(v.get_value())[:1] for p, v in flat.items()}
  if not flat or len(set(sizes.values())) != 1 or () in sizes.values():
    raise ValueError(
        f'blocks={blocks!r} is one {type(node).__name__}, so its params '
        f'must be stacked over layers (one leading layer dim, as nnx.vmap '
        f'makes them), but their leading dims are '
        f'{ {_name(p): s for p, s in sizes.items()} }. Pass the path of a '
        'list of layers or of a module built with nnx.vmap.')
  (num,) = next(iter(sizes.values()))
  sharding = {p: v.get_metadata().get('out_sharding')
              for p, v in flat.items()}
  return _Layers(graphdef, [
      {p: v.get_value()[i] for p, v in flat.items()} for i in range(num)],
      [(p, v.replace(jax.tree.map(lambda a: a[0], v.get_value())))
       for p, v in nnx.to_flat_state(other)], True, sharding)


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


def _tensor_rules(rules: Mapping[str, Any] | None, names: dict[str, int],
                  metadata: dict[str, Any], axis: str) -> dict[str, tuple]:
  """``{param name: spec of its trailing dims}`` for the split params
  (``tensor_parallel.match_rules``), every rule matching some param.

  ``names``: '/'-joined param names (block params by their path inside a
  block) -> ndim; ``metadata``: name -> the Param's Flax ``out_sharding``,
  used when ``rules`` is ``None``.
  """
  matches = tp.match_rules(names, rules, metadata=metadata, axis=axis)
  if rules is not None:
    used = {match.rule for match in matches.values()}
    unused = [r for r in rules if r not in used]
    if unused:
      raise ValueError(
          f'tensor_rules {unused} match no param. Block params match by '
          f"their path inside a block, the others by the model's own path; "
          f'the params are {sorted(names)}.')
  return {name: match.spec for name, match in matches.items()}


class PipelineModel(NamedTuple):
  """A Flax NNX model as ``jaxpar.parallel.trainer`` takes it.

  Attributes:
    params: ``PipelineParams(embed, stages, head)`` of the model's current
      params: nested dicts by attribute path; ``stages`` leaves
      ``[num_stages, slots, ...]`` by path inside a block.
    functions: ``(embed_fn, stage_fn, head_loss_fn)``, the three functions
      of ``jaxpar.parallel.trainer`` (each takes an optional last
      ``key``).
    stage_mask: bool ``[num_stages, slots]``: real (``True``) or identity
      slots.
    from_state: ``from_state(state) -> PipelineParams`` of an
      ``nnx.state(model, nnx.Param)`` (e.g. restored from a checkpoint saved
      with ``to_state``).
    to_state: its inverse, ``to_state(params) -> nnx.State`` of the model's
      ``nnx.Param`` s, for ``nnx.update`` and checkpoints of the model itself.
    tensor_specs: ``tensor_specs(params, size=1) -> PipelineParams`` of
      ``PartitionSpec`` over the ``'tensor'`` axis for params shaped like
      ``params`` (extra leading dims are not split), checking that the split
      dims divide by ``size``; ``None`` when no param is split.
  """
  params: PipelineParams
  functions: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]
  stage_mask: np.ndarray
  from_state: Callable[[nnx.State], PipelineParams]
  to_state: Callable[[PipelineParams], nnx.State]
  tensor_specs: Callable[..., PipelineParams] | None = None

  def update(self, model: nnx.Module, params: PipelineParams) -> None:
    """Writes ``params`` (e.g. ``trainer.params(state)``) into ``model``."""
    nnx.update(model, self.to_state(params))


class _Cut(NamedTuple):
  """How ``from_nnx`` cuts one model: what every function of the
  ``PipelineModel`` reads.

  Attributes:
    graphdef: the whole model's graphdef; ``template`` its flat state by
      path (the values and metadata a rebuilt model starts from).
    params: the paths of the model's ``nnx.Param`` s.
    path: the blocks' attribute path; ``blocks`` as the user wrote it.
    layers: the blocks (``_Layers``); ``block_template`` one block's params
      as ``nnx.Param`` s.
    split: which layers sit on which stage.
    embed_paths, head_paths: the non-block params of each side.
    checked: the ``(function, avals)`` whose reads ``_check_reads`` passed.
  """
  graphdef: Any
  template: dict[Path, Any]
  params: frozenset[Path]
  path: Path
  blocks: str
  layers: _Layers
  block_template: dict[Path, nnx.Param]
  split: LayerSplit
  embed_paths: frozenset[Path]
  head_paths: frozenset[Path]
  checked: set


def _reseeded(module: nnx.Module, key: jax.Array | None) -> nnx.Module:
  """``module`` with each of its RNG streams reseeded from ``key``."""
  if key is not None:
    tags = {s.tag for _, s in nnx.iter_graph(module)
            if isinstance(s, nnx.RngStream)}
    nnx.reseed(module, **{t: key for t in tags})
  return module


def from_nnx(model: nnx.Module, *, blocks: str, num_stages: int,
             embed: Callable[[nnx.Module, Any], jax.Array],
             head_loss: Callable[[nnx.Module, jax.Array, Any], Any],
             counts: Sequence[int] | None = None,
             head: Sequence[str] | None = None,
             tensor_rules: Mapping[str, Any] | None = None) -> PipelineModel:
  """Cuts ``model`` into a ``PipelineModel`` for ``jaxpar.parallel``.

  Args:
    model: a Flax NNX module; it is not changed (``PipelineModel.update``
      writes trained params back).
    blocks: attribute path (``'blocks'``, ``'decoder.layers'``) of the
      layers: a sequence of identical modules or one module with params
      stacked over layers. Each layer maps ``x -> y`` of the same shape.
    num_stages: logical pipeline stages, ``schedule.num_stages`` (``v * p``
      for interleaved and V-shaped schedules); ``1 <= num_stages <= L``.
    embed: ``embed(m, inputs) -> x [b, ...]``: the model before the layers.
    head_loss: ``head_loss(m, y, targets) -> loss`` (or ``(loss, aux)``,
      with ``has_aux=True`` in the train step): the mean loss of a batch.
    counts: layers per stage (positive, summing to ``L``), e.g. from
      ``jaxpar.pipeline.balance``; default balanced.
    head: ``'/'``-joined paths of the non-block params ``head_loss`` uses
      (``['final_norm', 'lm_head']``); default those of the attributes
      defined after ``blocks`` (at each level of its path); the others go to
      ``embed``. A function that reads the other part's params raises a
      ``ValueError`` naming them when it is traced.
    tensor_rules: ``{regex: spec}`` splitting params over the ``'tensor'``
      axis: the first regex that fully matches a param's ``'/'``-joined path
      (block params: their path inside a block, ``'attn/wq/kernel'``; the
      others: the model's own, ``'head/kernel'``) gives the spec of its
      trailing dims, e.g. ``(None, 'tensor')``. ``None``: the model's own
      Flax annotations (``nnx.with_partitioning``, ``sharding=``), their
      ``'tensor'`` entries. The layers stay as written: XLA partitions them.

  Returns:
    ``PipelineModel(params, functions, stage_mask, from_state, to_state,
    tensor_specs)``.

  Raises:
    TypeError: ``blocks`` is not a string, ``num_stages`` not an int.
    ValueError: an unknown ``blocks`` path, blocks of different structure,
      ``num_stages`` or ``counts`` that do not fit the layer count, a
      tensor rule that matches no param or has more entries than its dims.

  Example:
    >>> import numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> class Block(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.norm = nnx.RMSNorm(8, rngs=rngs)
    ...     self.mlp = nnx.Linear(8, 8, rngs=rngs)
    ...   def __call__(self, x):
    ...     return x + self.mlp(self.norm(x))
    >>> class Net(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.embed = nnx.Embed(16, 8, rngs=rngs)
    ...     self.layers = nnx.List([Block(rngs) for _ in range(3)])
    ...     self.out = nnx.Linear(8, 16, rngs=rngs)
    >>> net = Net(nnx.Rngs(0))
    >>> pm = jaxpar.parallel.from_nnx(
    ...     net, blocks='layers', num_stages=2,
    ...     embed=lambda m, ids: m.embed(ids),
    ...     head_loss=lambda m, y, t: optax.losses.
    ...         softmax_cross_entropy_with_integer_labels(m.out(y), t).mean())
    >>> pm.params.stages['mlp']['kernel'].shape     # [stages, slots, 8, 8]
    (2, 2, 8, 8)
    >>> pm.stage_mask.tolist()                       # 3 layers on 2 stages
    [[True, True], [True, False]]
    >>> trainer = jaxpar.parallel.trainer(
    ...     pm, optax.sgd(0.1), schedule=jaxpar.pipeline.one_f_one_b(2, 2),
    ...     mesh=jaxpar.make_mesh(data=4, stage=2))
    >>> ids = np.zeros((8, 4), np.int32)
    >>> state, stats = trainer.step(trainer.init(pm.params), (ids, ids))
    >>> pm.update(net, trainer.params(state))        # trained params -> net
    >>> int(state.step), net.layers[2].mlp.kernel.shape
    (1, (8, 8))
  """
  _check_functions(model, embed, head_loss)
  cut = _cut(model, blocks, num_stages, counts, head)
  rules = _tensor_rules(tensor_rules, *_param_names(cut), 'tensor')
  return PipelineModel(
      _from_state(cut, nnx.state(model, nnx.Param)),
      (functools.partial(_embed_fn, cut, embed),
       functools.partial(_stage_fn, cut),
       functools.partial(_head_loss_fn, cut, head_loss)),
      cut.split.mask, functools.partial(_from_state, cut),
      functools.partial(_to_state, cut),
      functools.partial(_tensor_specs, rules) if rules else None)


# ------------------------------------------------------------------ the cut


def _check_functions(model: Any, embed: Any, head_loss: Any) -> None:
  if not isinstance(model, nnx.Module):
    raise TypeError(f'model must be a flax.nnx.Module, got '
                    f'{type(model).__name__}.')
  for name, fn in (('embed', embed), ('head_loss', head_loss)):
    if not callable(fn):
      raise TypeError(f'{name} must be a function of the model, e.g. '
                      f'{name}=lambda m, ...: ..., got {fn!r}.')


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


def _cut(model: nnx.Module, blocks: str, num_stages: Any,
         counts: Sequence[int] | None, head: Sequence[str] | None) -> _Cut:
  """Reads ``model``: its blocks, their split over stages, the two sides."""
  path, node = _find_blocks(model, blocks)
  layers = _layers(node, blocks)
  split = _layer_split(len(layers.params), num_stages, counts, blocks)
  graphdef, state = nnx.split(model)
  template = dict(nnx.to_flat_state(state))
  params = frozenset(p for p, v in template.items()
                     if isinstance(v, nnx.Param))
  rest = [p for p in params if p[:len(path)] != path]
  embed_paths, head_paths = _sides(model, path, head, rest)
  if head is not None:
    unknown = [h for h in head if not any(
        _name(p).startswith(h) for p in head_paths)]
    if unknown:
      raise ValueError(f'head={list(head)}: {unknown} match no non-block '
                       f'param; they are {sorted(map(_name, rest))}.')
  return _Cut(
      graphdef=graphdef, template=template, params=params, path=path,
      blocks=blocks, layers=layers,
      block_template={p: nnx.Param(v) for p, v in layers.params[0].items()},
      split=split, embed_paths=frozenset(embed_paths),
      head_paths=frozenset(head_paths), checked=set())


# ------------------------------------------------- model params <-> pipeline


def _from_state(cut: _Cut, model_params: nnx.State) -> PipelineParams:
  """``PipelineModel.from_state``: the model's params as ``PipelineParams``."""
  flat = {p: v.get_value() if isinstance(v, nnx.Variable) else v
          for p, v in nnx.to_flat_state(model_params)}
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
  stacked = cut.split.stack(per_layer)
  part = lambda paths: _nest({p: flat[p] for p in sorted(paths, key=_name)})
  return PipelineParams(part(cut.embed_paths), _nest(stacked),
                        part(cut.head_paths))


def _real_slots(split: LayerSplit) -> tuple[tuple[int, int], ...]:
  """``(stage, slot)`` of each layer, in model order."""
  return tuple((k, j) for k, c in enumerate(split.counts) for j in range(c))


def _layer_paths(cut: _Cut, stage_paths: Sequence[Path]) -> list[Path]:
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


def _to_state(cut: _Cut, pp: PipelineParams) -> nnx.State:
  """``PipelineModel.to_state``: ``PipelineParams`` as the model's
  ``nnx.Param`` state."""
  values = {**_flat(pp.embed), **_flat(pp.head)}
  stages = _flat(pp.stages)
  leaves = list(stages.values())
  arrays = all(isinstance(v, jax.Array) for v in leaves)
  values.update(zip(
      _layer_paths(cut, list(stages)),
      (_layer_arrays if arrays else _layer_values)(
          cut.layers.stacked, _real_slots(cut.split), leaves)))
  return nnx.from_flat_state([(p, cut.template[p].replace(values[p]))
                              for p in sorted(cut.params, key=_name)])


# ------------------------------------------------------ the three functions


def _whole_model(cut: _Cut, values: dict[Path, Any]) -> nnx.Module:
  """The model with ``values`` for its params; zeros for the others."""
  def one(p, v):
    if p in values:
      return v.replace(values[p])
    if p in cut.params:
      return v.replace(jnp.zeros(np.shape(v.get_value()),
                                 v.get_value().dtype))
    return v.replace(v.get_value())
  return nnx.merge(cut.graphdef, nnx.from_flat_state(
      [(p, one(p, v)) for p, v in cut.template.items()]))


def _check_reads(cut: _Cut, fn: Callable[..., Any], name: str,
                 values: dict[Path, Any], args: tuple) -> None:
  """Raises if ``fn``'s result depends on params outside ``values``."""
  own = sorted(values, key=_name)
  others = sorted(cut.params - set(own), key=_name)
  aval = lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype)
  avals = ([aval(values[p]) for p in own],
           [aval(cut.template[p].get_value()) for p in others],
           jax.tree.map(aval, args))
  signature = (name, str(avals))
  if signature in cut.checked:
    return
  closed = jax.make_jaxpr(lambda o, t, a: fn(_whole_model(
      cut, {**dict(zip(own, o)), **dict(zip(others, t))}), *a))(*avals)
  jaxpr = closed.jaxpr
  used = {v for k in executor.jaxpr_needed(jaxpr, jaxpr.outvars)
          for v in jaxpr.eqns[k].invars if executor.is_jaxpr_var(v)}
  used |= {v for v in jaxpr.outvars if executor.is_jaxpr_var(v)}
  read = [_name(p) for p, v in zip(
      others, jaxpr.invars[len(own):len(own) + len(others)]) if v in used]
  if read:
    other = 'embed' if name == 'head_loss' else 'head'
    raise ValueError(
        f'{name} reads {read[:4]}, but from_nnx gave {name} only '
        f'{sorted(map(_name, own))[:8]}: block params run in the '
        f'pipeline stages (blocks={cut.blocks!r}) and the others are split '
        f'between embed and head_loss (default: attributes defined after '
        f'the blocks go to head_loss; these are in the {other} part). Pass '
        f'head=[...] to from_nnx naming the params head_loss uses. Weights '
        'shared by embed and head_loss (tied embeddings) are not supported: '
        'untie them.')
  cut.checked.add(signature)


def _part_fn(cut: _Cut, fn: Callable[..., Any], name: str, own: PyTree,
             args: tuple, key: jax.Array | None) -> Any:
  """``fn`` of the whole model with ``own`` params (the others zero)."""
  values = _flat(own)
  _check_reads(cut, fn, name, values, args)
  return fn(_reseeded(_whole_model(cut, values), key), *args)


def _embed_fn(cut: _Cut, embed: Callable[..., jax.Array], embed_params: PyTree,
              inputs: Any, key: jax.Array | None = None) -> jax.Array:
  return _part_fn(cut, embed, 'embed', embed_params, (inputs,), key)


def _head_loss_fn(cut: _Cut, head_loss: Callable[..., Any],
                  head_params: PyTree, y: jax.Array, targets: Any,
                  key: jax.Array | None = None) -> Any:
  return _part_fn(cut, head_loss, 'head_loss', head_params, (y, targets), key)


def _block(cut: _Cut, slot_params: PyTree, x: jax.Array,
           key: jax.Array | None) -> jax.Array:
  """One block, the user's module, on ``slot_params``."""
  values = _flat(slot_params)
  module = nnx.merge(cut.layers.graphdef, nnx.from_flat_state(
      [(p, cut.block_template[p].replace(values[p])) for p in values]
      + [(p, v.replace(v.get_value())) for p, v in cut.layers.other]))
  return _reseeded(module, key)(x)


def _slot(cut: _Cut, key: jax.Array | None, x: jax.Array,
          slot: tuple[PyTree, jax.Array]) -> tuple[jax.Array, None]:
  """The stage scan's body: slot ``j``'s block on ``x``."""
  slot_params, j = slot
  y = _block(cut, slot_params, x,
             None if key is None else jax.random.fold_in(key, j))
  if not cut.split.mask.all():   # identity slots (all-zero params) pass x
    real = functools.reduce(jnp.logical_or, [
        jnp.any(a != 0) for a in jax.tree.leaves(slot_params)])
    y = jnp.where(real, y, x)
  return y, None


def _stage_fn(cut: _Cut, stage_params: PyTree, x: jax.Array,
              key: jax.Array | None = None) -> jax.Array:
  """A stage: its ``slots`` blocks in one ``lax.scan``."""
  # The carry keeps its check_vma type: make x vary as the blocks' output
  # will (over the params' and the key's axes).
  x = executor.vary(x, executor.varying_axes((stage_params, key)))
  return jax.lax.scan(functools.partial(_slot, cut, key), x,
                      (stage_params, jnp.arange(cut.split.slots)))[0]


# ------------------------------------------------------------- tensor rules


def _param_names(cut: _Cut) -> tuple[dict[str, int], dict[str, Any]]:
  """``({name: ndim}, {name: Flax out_sharding})`` of the params, by
  ``'/'``-joined name (block params by their path inside a block)."""
  rest = [p for p in cut.params if p[:len(cut.path)] != cut.path]
  names = {_name(p): np.ndim(v) for p, v in cut.layers.params[0].items()}
  names.update({_name(p): np.ndim(cut.template[p].get_value())
                for p in rest})
  sharding = {_name(p): s for p, s in cut.layers.sharding.items()}
  sharding.update({
      _name(p): cut.template[p].get_metadata().get('out_sharding')
      for p in rest})
  return names, sharding


def _tensor_specs(rules: dict[str, tuple], pp: PipelineParams,
                  size: int = 1) -> PipelineParams:
  """``PipelineModel.tensor_specs``: each leaf's spec from ``rules``."""
  def one(key_path, leaf):
    name = '/'.join(str(k.key) for k in key_path)
    spec = rules.get(name, ())
    dims = range(np.ndim(leaf) - len(spec), np.ndim(leaf))
    for dim, entry in zip(dims, spec):
      if entry is not None and np.shape(leaf)[dim] % size:
        raise ValueError(
            f'param {name!r} {np.shape(leaf)}: dim {dim} of size '
            f'{np.shape(leaf)[dim]} is split over {entry!r} (spec {spec}) '
            f'but does not divide by its size {size}; choose a size that '
            f'divides it or change the rule.')
    return P(*(None,) * (np.ndim(leaf) - len(spec)), *spec)
  return PipelineParams(*(jax.tree_util.tree_map_with_path(one, part)
                          for part in pp))
