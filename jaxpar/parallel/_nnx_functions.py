"""The three pipeline functions of a cut NNX model: ``embed_fn``,
``stage_fn``, ``head_loss_fn``, and ``tied`` (the ``embed`` params the head
reads too).

``embed`` and ``head_loss`` run on a copy of the whole model with their
part's params (the others zero; ``_check_reads`` refuses a function that
reads them, tied embed params aside); a stage runs its blocks, the user's
own module called by the kind's ``block(b, x)`` on the carried activation
(any pytree), in one ``lax.scan``, threading their ``nnx.BatchStat`` s;
with several kinds a ``lax.switch`` runs the slot's own. Under tensor rules
a stage first checks, once per signature, that XLA needs no
``collective-permute`` to partition a block (``_split_blocks``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar import tensor_parallel as tp
from jaxpar.data_parallel.internal import reseeded
from jaxpar.parallel._nnx_cut import Cut, path_name
from jaxpar.parallel._params import PipelineParams
from jaxpar.parallel._params import flat as _flat
from jaxpar.parallel._params import nest as _nest
from jaxpar.pipeline.executor.internal import is_jaxpr_var, jaxpr_needed
from jaxpar.tensor_parallel.internal import resharding_permutes
from jaxpar.vma import vary, varying_axes

PyTree = Any
Path = tuple[Any, ...]


def _whole_model(cut: Cut, values: dict[Path, Any]) -> nnx.Module:
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


def _aval(a: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(a), a.dtype)


def _reads(cut: Cut, fn: Callable[..., Any], values: dict[Path, Any],
           args: tuple) -> list[Path]:
  """The params outside ``values`` that ``fn``'s result depends on (traced
  on shapes, once per signature)."""
  own = sorted(values, key=path_name)
  others = sorted(cut.params - set(own), key=path_name)
  avals = ([_aval(values[p]) for p in own],
           [_aval(cut.template[p].get_value()) for p in others],
           jax.tree.map(_aval, args))
  signature = (fn, str(avals))
  if signature not in cut.reads:
    jaxpr = jax.make_jaxpr(lambda o, t, a: fn(_whole_model(
        cut, {**dict(zip(own, o)), **dict(zip(others, t))}), *a))(
            *avals).jaxpr
    used = {v for k in jaxpr_needed(jaxpr, jaxpr.outvars)
            for v in jaxpr.eqns[k].invars if is_jaxpr_var(v)}
    used |= {v for v in jaxpr.outvars if is_jaxpr_var(v)}
    cut.reads[signature] = [p for p, v in zip(
        others, jaxpr.invars[len(own):len(own) + len(others)]) if v in used]
  return cut.reads[signature]


def _check_reads(cut: Cut, fn: Callable[..., Any], name: str,
                 values: dict[Path, Any], args: tuple) -> None:
  """Raises if ``fn``'s result depends on params outside ``values``."""
  read = [path_name(p) for p in _reads(cut, fn, values, args)]
  if not read:
    return
  if name == 'embed':
    fix = (f'A param that both embed and head_loss read lives in embed: '
           f'pass head=[...] to from_nnx without {read[:4]} (head_loss may '
           'read embed params: tied weights are one param).')
  else:
    fix = ('head_loss may read the embed params (tied weights; the trainer '
           'gives it those it reads), never block params: pass head=[...] '
           'to from_nnx naming the non-block params head_loss uses.')
  raise ValueError(
      f'{name} reads {read[:4]}, but from_nnx gave {name} only '
      f'{sorted(map(path_name, values))[:8]}: block params run in the '
      f'pipeline stages (blocks={cut.blocks!r}) and the others are split '
      f'between embed and head_loss (default: attributes defined after '
      f'the blocks go to head_loss). {fix}')


def tied(cut: Cut, embed: Callable[..., Any],
         head_loss: Callable[..., Any], params: PipelineParams,
         inputs: Any, targets: Any) -> tuple[Path, ...]:
  """``PipelineModel.tied``: the embed params ``head_loss`` reads."""
  x = jax.eval_shape(functools.partial(embed_fn, cut, embed),
                     jax.tree.map(_aval, params.embed), _args(inputs))
  values = _flat(params.head)
  read = _reads(cut, head_loss, values, (x, _args(targets)))
  tied = tuple(p for p in read if p in cut.embed_paths)
  _check_reads(cut, head_loss, 'head_loss',
               {**values, **{p: cut.template[p].get_value() for p in tied}},
               (x, _args(targets)))
  return tied


def _args(tree: Any) -> Any:
  """Arrays (or shapes) as shapes."""
  return jax.tree.map(_aval, tree)


def _part_fn(cut: Cut, fn: Callable[..., Any], name: str, own: PyTree,
             args: tuple, key: jax.Array | None, state: PyTree) -> Any:
  """``fn`` of the whole model with ``own`` params (the others zero); with
  a ``state`` (the part's ``nnx.BatchStat`` s by model path), ``(out, new
  state)``."""
  values = _flat(own)
  _check_reads(cut, fn, name, values, args)
  stats = {} if state is None else _flat(state)
  model = reseeded(_whole_model(cut, {**values, **stats}), key)
  out = fn(model, *args)
  new = dict(nnx.to_flat_state(nnx.state(model, nnx.BatchStat)))
  _check_updates(cut, name, new)
  if state is None:
    return out
  return out, _nest({p: new[p].get_value().astype(jnp.result_type(v))
                     for p, v in stats.items()})


def _check_updates(cut: Cut, name: str, new: dict[Path, Any]) -> None:
  """``ValueError`` if ``name`` (``'embed'`` or ``'head_loss'``) updated
  ``nnx.BatchStat`` s (``new``: the model's after the call, by path) that
  are not on its side: their new values would be lost."""
  sides = {'embed': cut.embed_stats, 'head_loss': cut.head_stats}
  theirs = sorted(path_name(p) for p, v in new.items()
                  if p not in sides[name]
                  and v.get_value() is not cut.template[p].get_value())
  if not theirs:
    return
  raise ValueError(
      f'{name} updates the nnx.BatchStat s {theirs[:4]}, but from_nnx '
      f'gave {name} {sorted(map(path_name, sides[name]))[:4] or "none"}: '
      'a part carries the statistics of the modules on its side (blocks: '
      'in the stages; the others: attributes defined after the blocks go '
      'to head_loss, the rest to embed). Pass head=[...] to from_nnx '
      'naming the modules head_loss runs (or list a norm the blocks run '
      'in blocks=[...]).')


def embed_fn(cut: Cut, embed: Callable[..., jax.Array], embed_params: PyTree,
             inputs: Any, *, key: jax.Array | None = None,
             state: PyTree = None) -> Any:
  """``embed(m, inputs)`` of the model with ``embed_params``; with its
  ``nnx.BatchStat`` s (``PipelineModel.model_state.embed``) as ``state``,
  ``(x, new state)``."""
  return _part_fn(cut, embed, 'embed', embed_params, (inputs,), key, state)


def head_loss_fn(cut: Cut, head_loss: Callable[..., Any],
                 head_params: PyTree, y: jax.Array, targets: Any, *,
                 key: jax.Array | None = None, state: PyTree = None) -> Any:
  """``head_loss(m, y, targets)`` of the model with ``head_params``; with
  its ``nnx.BatchStat`` s (``PipelineModel.model_state.head``) as
  ``state``, ``(loss, new state)``."""
  return _part_fn(cut, head_loss, 'head_loss', head_params, (y, targets),
                  key, state)


def _run(cut: Cut, kind: int, values: dict[Path, Any],
         stats: dict[Path, Any], x: Any, key: jax.Array | None
         ) -> tuple[Any, dict[Path, Any]]:
  """A block of ``kind``, the user's module, on its params ``values`` (and
  ``nnx.BatchStat`` s ``stats``), by path inside a block: ``(y, new
  stats)``."""
  k = cut.kinds[kind]
  module = nnx.merge(k.graphdef, nnx.from_flat_state(
      [(k.inner + p, k.params[p].replace(values[p])) for p in values]
      + [(k.inner + p, k.stats[p].replace(stats[p])) for p in stats]
      + [(p, v.replace(v.get_value())) for p, v in k.other]))
  y = k.call(reseeded(module, key), x)
  return y, {p[len(k.inner):]: v.get_value() for p, v in nnx.to_flat_state(
      nnx.state(module, nnx.BatchStat))}


def _one_kind(cut: Cut, key: jax.Array | None, x: Any, slot_params: PyTree,
              slot_state: PyTree) -> tuple[Any, PyTree]:
  """A slot of a model with one kind of block (identity slots: all-zero
  params, pass ``x``)."""
  y, new_state = _run(cut, 0, _flat(slot_params), _flat(slot_state), x, key)
  new_state = _nest(new_state)
  if not cut.split.mask.all():
    real = _nonzero(slot_params)
    y = jax.tree.map(lambda n, o: jnp.where(real, n, o), y, x)
    new_state = jax.tree.map(lambda n, o: jnp.where(real, n, o), new_state,
                             slot_state)
  return y, new_state


def _nonzero(tree: PyTree) -> jax.Array:
  return functools.reduce(jnp.logical_or, [
      jnp.any(a != 0) for a in jax.tree.leaves(tree)], jnp.bool_(False))


def _kinds(cut: Cut, key: jax.Array | None, x: Any, slot_params: PyTree,
           slot_state: PyTree) -> tuple[Any, PyTree]:
  """A slot of a model with several kinds of block: its params are the
  union ``{kind: params}``; the kind whose params are not all zero runs
  (``lax.switch``), none (an identity slot) passes ``x``."""
  params, state = slot_params, slot_state

  def branch(i):
    key_i = cut.kinds[i].key
    def run(operands):
      x, params, state = operands
      y, new = _run(cut, i, _flat(params[key_i]),
                    _flat(state.get(key_i, {})), x, key)
      return y, {**state, **({key_i: _nest(new)} if new else {})}
    return run
  branches = [branch(i) for i in range(len(cut.kinds))]
  flags = [_nonzero(params[k.key]) for k in cut.kinds]
  if not cut.split.mask.all():   # identity slots
    branches.append(lambda operands: (operands[0], operands[2]))
    flags.append(jnp.bool_(True))
  return jax.lax.switch(jnp.argmax(jnp.stack(flags)), branches,
                        (x, params, state))


def _slot(cut: Cut, key: jax.Array | None, x: Any,
          slot: tuple[PyTree, jax.Array, PyTree]) -> tuple[Any, PyTree]:
  """The stage scan's body: slot ``j``'s block on ``x``."""
  slot_params, j, slot_state = slot
  key = None if key is None else jax.random.fold_in(key, j)
  run = _one_kind if len(cut.kinds) == 1 else _kinds
  return run(cut, key, x, slot_params, slot_state)


def _split_blocks(cut: Cut, rules: dict[str, tp.RuleMatch],
                  stage_params: PyTree, x: Any, state: PyTree) -> None:
  """``ValueError`` naming the block params whose tensor split XLA can
  only undo with a ``collective-permute`` (a column-split fused projection
  that the block ``jnp.split`` s: gate|up, k|v), when the stages run
  pipelined over several ranks with ``tensor`` Auto (``from_nnx``'s
  layout): XLA:CPU runs a ``collective-permute`` over every device, but in
  a tick only one stage's devices run a block, so the step would wait in
  XLA's rendezvous and abort the process. Compiles a block of each kind
  and its VJP, partitioned as the step partitions them, once per signature
  (and, to name the params, once per split param when it finds one)."""
  mesh = jax.sharding.get_abstract_mesh()
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  auto = {a: n for a, n in sizes.items()
          if types[a] == jax.sharding.AxisType.Auto and n > 1}
  manual = [n for a, n in sizes.items()
            if types[a] == jax.sharding.AxisType.Manual and n > 1]
  ranks = sizes.get('stage', max(manual, default=1))
  if not auto or ranks < 2 or not any(
      cut.kind_of(p)[1] and path_name(cut.kind_of(p)[1]) in rules
      for p in _flat(stage_params)):
    return
  aval = lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], jax.typeof(a).dtype)
  args = (jax.tree.map(aval, stage_params), jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(np.shape(a), jax.typeof(a).dtype), x),
          jax.tree.map(aval, state))
  memo = ('permutes', str(args), str(auto))
  if memo not in cut.reads:
    cut.reads[memo] = _permuting(cut, rules, args, auto)
  if cut.reads[memo]:
    names = cut.reads[memo]
    split = {n: (rules[n].rule, rules[n].spec) for n in names}
    raise ValueError(
        f'tensor rules split block params {split} (name: (rule, spec)) over '
        f'{auto} so that XLA must move pieces of a split dim between '
        'devices with a collective-permute: typically a fused projection '
        'column-split and then cut in pieces (jnp.split of gate|up or k|v; '
        'splitting only the projection after it permutes its cotangent). '
        'XLA:CPU runs a collective-permute over every device, but in a '
        "pipeline tick only one stage's devices run a block: the step would "
        'hang and abort. Make the fused param two params with a rule each '
        '(gate, up), or leave it and the params after it unsplit.')


def _permuting(cut: Cut, rules: dict[str, tp.RuleMatch], args: tuple,
               auto: dict[str, int]) -> list[str]:
  """The split block params whose split alone makes XLA insert a
  ``collective-permute`` into a block or its VJP (none: one compile with
  every split; else one more per split param)."""
  def block(params, x, state):
    params, state = _flat(params), _flat(state)
    ys = []
    for i, kind in enumerate(cut.kinds):
      own = lambda tree: {cut.kind_of(p)[1]: v for p, v in tree.items()
                          if cut.kind_of(p)[0] == i}
      y, _ = _run(cut, i, own(params), own(state), x, None)
      ys += [leaf for leaf in jax.tree.leaves(y)
             if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return ys
  def specs(only):
    def one(path, leaf):
      name = path_name(cut.kind_of(tuple(k.key for k in path))[1])
      if name not in rules or only not in (None, name):
        return None
      spec = rules[name].spec
      return P(*(None,) * (len(leaf.shape) - len(spec)), *spec)
    return (jax.tree_util.tree_map_with_path(one, args[0]),
            jax.tree.map(lambda _: None, args[1]),
            jax.tree.map(lambda _: None, args[2]))
  if not resharding_permutes(block, args, specs(None), auto):
    return []
  names = sorted({path_name(cut.kind_of(p)[1]) for p in _flat(args[0])}
                 & set(rules))
  return [name for name in names if resharding_permutes(
      block, args, specs(name), auto)] or names


def stage_fn(cut: Cut, rules: dict[str, tp.RuleMatch], stage_params: PyTree,
             x: Any, *, key: jax.Array | None = None,
             state: PyTree = None) -> Any:
  """A stage: its ``slots`` blocks in one ``lax.scan``;
  ``stage_fn(params, x[, key=k])`` or, with ``nnx.BatchStat`` s,
  ``stage_fn(params, x, state=s[, key=k]) -> (y, new_state)`` (``state``
  ``[slots, ...]``, the executor's ``stage_state`` convention)."""
  stateful = any(k.stats for k in cut.kinds)
  if stateful and state is None:
    raise ValueError(
        f'the blocks have nnx.BatchStat s '
        f'({sorted(path_name(p) for k in cut.kinds for p in k.stats)[:4]}): '
        'their stage '
        'function takes the statistics as state= and returns (y, new '
        'statistics); start the trainer with them: trainer.init('
        'pm.params, pm.model_state).')
  if not stateful:
    state = {}
  if rules:
    _split_blocks(cut, rules, stage_params, x, state)
  # The carry keeps its check_vma type: make x vary as the blocks' output
  # will (over the params', the state's and the key's axes).
  x = vary(x, varying_axes((stage_params, key, state)))
  y, new_state = jax.lax.scan(
      functools.partial(_slot, cut, key), x,
      (stage_params, jnp.arange(cut.split.slots), state))
  return (y, new_state) if stateful else y
