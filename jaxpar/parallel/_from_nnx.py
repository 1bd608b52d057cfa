"""``PipelineModel``: a user's own Flax NNX model cut into pipeline parts.

``from_nnx`` finds the layers where the model keeps them -- a sequence of
NNX modules (``nnx.List``, list, tuple), numbered attributes ``blocks_0 ...
blocks_N`` (a Linen model wrapped by ``nnx.bridge.ToNNX`` keeps its list so),
a list of paths, or one module whose params are stacked over layers
(``nnx.vmap``/``nnx.scan`` style) -- and gives what
``jaxpar.parallel.model_trainer`` takes::

  embed   attributes defined before ``blocks``   embed(m, inputs) -> x
  stages  blocks stacked [num_stages, slots]     block(b, x) -> x, b as written
  head    attributes defined after ``blocks``    head_loss(m, y, targets)

``embed`` and ``head_loss`` are written against the model itself: jaxpar
merges the part's params into a copy of the model and calls them. A param
both read (tied embeddings: ``head_loss=lambda m, y, t:
xent(m.wte.attend(m.ln_f(y)), t)``) is one param in ``embed``: the trainer
gives ``head_loss`` its value and adds the gradients of its two uses (the
sum Megatron's embedding group all-reduces), so the optimizer, the global
norm, ZeRO and checkpoints see it once. A stage
runs its ``slots`` blocks, the user's own module code, in one ``lax.scan``.
Layers are balanced over stages (the first ``L % S`` stages get one more);
the missing slots are identity: their params are zeros and the stage passes
its input through (a slot whose params are all zero is skipped), and the
``stage_mask`` freezes them, so the maths is that of the ``L``-layer model.

**Side inputs.** The activation carried from stage to stage is whatever
``embed`` returns, any pytree (``x``, or ``{'x': h, 'mask': m}``); ``block``
says how a block runs on it and returns it with the same structure, so a
block may read values that are not the carried hidden state -- a padding
mask, positions, an encoder's output -- which travel with the microbatch to
every stage and get their exact cotangents back. **Encoder-decoder**: list
both stacks (and what runs between them, e.g. the encoder's final norm) as
``blocks``, each with its own ``block`` function; the encoder's layers fill
the first stages, the decoder's the last ones, and the encoder output rides
in the activation to every decoder stage. Pipeline stages stack one slot
structure (one SPMD program), so with several kinds of block a slot holds
the union of their params: its own kind's, the others zero (never read; a
slot runs the kind whose params are not all zero). That costs memory for
the other kinds' zeros (params and optimizer state), and keeps every stage
busy with the model's own layers in model order: the cut that balances the
stages by layer counts (``counts=``) like a decoder-only model.

**BatchNorm** (``nnx.BatchStat`` s) anywhere -- in the blocks, in a
ResNet's stem run by ``embed``, in a head -- is carried per microbatch in
microbatch order, as on one device: ``PipelineModel.model_state`` holds the
statistics laid out like the params, each function takes its part as
``state=`` and returns it updated, and ``update`` writes them back. Other
variables that are not ``nnx.Param`` (RNG state, constant tables) are not
trained: each function sees the model's values, a block those of the first
block of its kind. With a ``key`` (dropout) every RNG stream of the merged
model is reseeded from it: ``embed`` and ``head_loss`` with the key the
trainer gives, slot ``j`` of a stage with ``fold_in(key, j)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar import tensor_parallel as tp
from jaxpar.parallel._nnx_cut import (from_state, model_state,
                                      param_names, read_cut, to_state,
                                      variable_values)
from jaxpar.parallel._nnx_functions import (embed_fn, head_loss_fn, stage_fn,
                                            tied)
from jaxpar.parallel._params import PipelineParams

PyTree = Any
Path = tuple[Any, ...]


def _tensor_rules(rules: Mapping[str, Any] | None, names: dict[str, int],
                  metadata: dict[str, Any],
                  tensor_axis: str) -> dict[str, tp.RuleMatch]:
  """``{param name: RuleMatch(rule, spec of its trailing dims)}`` for the
  split params
  (``tensor_parallel.match_rules``), every rule matching some param.

  ``names``: '/'-joined param names (block params by their path inside a
  block) -> ndim; ``metadata``: name -> the Param's Flax ``out_sharding``,
  used when ``rules`` is ``None``.
  """
  matches = tp.match_rules(names, rules, metadata=metadata,
                           tensor_axis=tensor_axis)
  if rules is not None:
    used = {match.rule for match in matches.values()}
    unused = [r for r in rules if r not in used]
    if unused:
      raise ValueError(
          f'tensor_rules {unused} match no param. Block params match by '
          f"their path inside a block, the others by the model's own path; "
          f'the params are {sorted(names)}.')
  return matches


class PipelineModel(NamedTuple):
  """A Flax NNX model as ``jaxpar.parallel.model_trainer`` takes it.

  Attributes:
    params: ``PipelineParams(embed, stages, head)`` of the model's current
      params: nested dicts by attribute path; ``stages`` leaves
      ``[num_stages, slots, ...]`` by path inside a block.
    functions: ``(embed_fn, stage_fn, head_loss_fn)``, three functions as
      ``jaxpar.parallel.trainer`` takes them (each takes ``key=`` by
      keyword).
    stage_mask: bool ``[num_stages, slots]``: real (``True``) or identity
      slots.
    from_state: ``from_state(state) -> PipelineParams`` of an
      ``nnx.state(model, nnx.Param)`` (e.g. restored from a checkpoint saved
      with ``to_state``).
    to_state: its inverse, ``to_state(params, model_state=None) ->
      nnx.State`` of the model's ``nnx.Param`` s (and ``nnx.BatchStat`` s
      with a ``model_state`` laid out as ``model_state`` below), for
      ``nnx.update`` and checkpoints of the model itself.
    tensor_specs: ``tensor_specs(params, size=1) -> PipelineParams`` of
      ``PartitionSpec`` over the ``'tensor'`` axis for params shaped like
      ``params`` (extra leading dims are not split), checking that the split
      dims divide by ``size``; ``None`` when no param is split.
    tied: ``tied(params, inputs, targets) -> paths``: the ``embed`` params
      ``head_loss`` also reads (tied weights, ``m.wte.attend``), as key
      paths into ``params.embed``, found by tracing on the shapes of
      ``params`` and of one microbatch. Each is one param, stored in
      ``embed``: the trainer gives ``head_loss`` its value too and sums the
      gradients of the two uses.
    model_state: the model's ``nnx.BatchStat`` s (BatchNorm running
      statistics) laid out like ``params``: ``PipelineParams(embed,
      stages, head)``, the blocks' stacked like ``params.stages``
      (``[num_stages, slots, ...]``, identity slots zero), those ``embed``
      and ``head_loss`` run (a ResNet's stem norm) by model path, ``None``
      for a part without any; ``None`` for a model without any:
      ``trainer.init(pm.params, pm.model_state)``. Each function with
      statistics then runs on them and returns them updated
      (``stage_fn(params, x, state=s) -> (y, new_state)``, and so
      ``embed_fn`` and ``head_loss_fn``), one microbatch after the other,
      as the model run on the microbatches in turn on one device.
  """
  params: PipelineParams
  functions: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]
  stage_mask: np.ndarray
  from_state: Callable[[nnx.State], PipelineParams]
  to_state: Callable[[PipelineParams], nnx.State]
  tensor_specs: Callable[..., PipelineParams] | None = None
  tied: Callable[..., tuple[Path, ...]] | None = None
  model_state: PipelineParams | None = None

  def update(self, model: nnx.Module, params: PipelineParams,
             model_state: PyTree = None) -> None:
    """Writes ``params`` (e.g. ``trainer.params(state)``) into ``model``,
    and its ``nnx.BatchStat`` s from ``model_state`` (``state.model_state``)
    when given."""
    nnx.update(model, self.to_state(params, model_state))


def from_nnx(model: nnx.Module, *, blocks: str | Sequence[str],
             num_stages: int,
             embed: Callable[[nnx.Module, Any], Any],
             head_loss: Callable[[nnx.Module, Any, Any], Any],
             block: Callable[[Any, Any], Any] | Mapping[str, Callable] | None
             = None,
             counts: Sequence[int] | None = None,
             head: Sequence[str] | None = None,
             tensor_rules: Mapping[str, Any] | None = None) -> PipelineModel:
  """Cuts ``model`` into a ``PipelineModel`` for ``jaxpar.parallel``.

  Args:
    model: a Flax NNX module; it is not changed (``PipelineModel.update``
      writes trained params back).
    blocks: where the layers are, in model order: an attribute path
      (``'blocks'``, ``'decoder.layers'``) of a sequence of modules, of one
      module with params stacked over layers, or the ``base`` of numbered
      attributes ``base_0 ... base_N`` (``'blocks'`` for a ``ToNNX``-wrapped
      Linen model's ``blocks_0 ...``); or a list of paths, each of one layer
      or of a sequence (``['encoder.layers', 'encoder.final_norm',
      'decoder.layers']``). Layers of one structure stack as they are;
      several structures are kinds of block (see Side inputs above).
    num_stages: logical pipeline stages, ``schedule.num_stages`` (``v * p``
      for interleaved and V-shaped schedules); ``1 <= num_stages <= L``.
    embed: ``embed(m, inputs) -> x``: the model before the layers; ``x``
      any pytree of ``[b, ...]`` arrays (the carried activation). A
      BatchNorm it runs (a ResNet's stem: ``lambda m, x: jax.nn.relu(
      m.stem_bn(m.stem_conv(x)))``) keeps its statistics in
      ``model_state.embed``, carried by stage 0 per microbatch in order.
    head_loss: ``head_loss(m, y, targets) -> loss`` (or ``(loss, aux)``,
      with ``has_aux=True`` in the train step): the mean loss of a batch;
      ``y`` is the carried activation after the last block. Its BatchNorm
      (a final norm) keeps its statistics in ``model_state.head``, carried
      by the last stage.
    block: ``block(b, x) -> x``: how a block ``b`` (the model's module)
      runs on the carried activation, returning it with the same
      structure; default ``b(x)``. With side inputs, e.g. ``lambda b, a:
      {**a, 'h': b(a['h'], a['mask'])}``. A dict gives one per ``blocks``
      entry (``{'decoder.layers': lambda b, a: ...}``).
    counts: layers per stage (positive, summing to ``L``), e.g. from
      ``jaxpar.pipeline.balance``; default balanced.
    head: ``'/'``-joined paths of the non-block params ``head_loss`` uses
      (``['final_norm', 'lm_head']``); default those of the attributes
      defined after ``blocks`` (at each level of its path); the others go to
      ``embed``. ``head_loss`` may read ``embed`` params too (tied weights,
      ``m.wte.attend(y)``): each stays one param (``PipelineModel.tied``).
      ``embed`` reading ``head`` params, or either reading block params,
      raises a ``ValueError`` naming them when it is traced.
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
    TypeError: ``blocks`` is not a string (or a list of them),
      ``num_stages`` not an int, ``block`` not a function (or a dict of
      one per ``blocks`` entry).
    ValueError: an unknown ``blocks`` path (the message lists the paths
      that name several layers), blocks of one entry of different structure,
      a block param shared with another block or with ``embed``/``head``
      (the same ``nnx.Param`` object), ``num_stages`` or ``counts`` that do
      not fit the layer count, a tensor rule that matches no param or has
      more entries than its dims. When traced: ``embed`` or ``head_loss``
      updating the ``nnx.BatchStat`` s of the other side (the message names
      them and ``head=``). In a trainer's first step, with the
      stages on several ranks: tensor rules under which XLA reshards a
      block's values with a collective-permute (a fused gate|up or k|v
      projection split over ``tensor`` and then cut in two), which would
      hang XLA:CPU (the message names the rules and the fix).

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
    >>> trainer = jaxpar.parallel.model_trainer(
    ...     pm, optax.sgd(0.1), schedule=jaxpar.pipeline.one_f_one_b(2, 2),
    ...     mesh=jaxpar.make_mesh(data=4, stage=2))
    >>> ids = np.zeros((8, 4), np.int32)
    >>> state, stats = trainer.step(trainer.init(pm.params), (ids, ids))
    >>> pm.update(net, trainer.params(state))        # trained params -> net
    >>> int(state.step), net.layers[2].mlp.kernel.shape
    (1, (8, 8))

    A side input rides in the carried activation (here a padding mask
    ``[b, s]`` the blocks read; ``y`` is the activation after the last
    block):

    >>> import jax, jax.numpy as jnp
    >>> pm = jaxpar.parallel.from_nnx(
    ...     net, blocks='layers', num_stages=2,
    ...     embed=lambda m, ids: {'h': m.embed(ids), 'pad': ids != 0},
    ...     block=lambda b, a: {**a, 'h': jnp.where(a['pad'][..., None],
    ...                                             b(a['h']), a['h'])},
    ...     head_loss=lambda m, y, t: optax.losses.
    ...         softmax_cross_entropy_with_integer_labels(m.out(y['h']),
    ...                                                   t).mean())
    >>> embed_fn, stage_fn, _ = pm.functions
    >>> a = embed_fn(pm.params.embed, ids)
    >>> y = stage_fn(jax.tree.map(lambda s: s[0], pm.params.stages), a)
    >>> y['h'].shape, y['pad'].dtype
    ((8, 4, 8), dtype('bool'))
  """
  _check_functions(model, embed, head_loss)
  cut = read_cut(model, blocks, num_stages, counts, head, block)
  rules = _tensor_rules(tensor_rules, *param_names(cut), 'tensor')
  return PipelineModel(
      from_state(cut, nnx.state(model, nnx.Param)),
      (functools.partial(embed_fn, cut, embed),
       functools.partial(stage_fn, cut, rules),
       functools.partial(head_loss_fn, cut, head_loss)),
      cut.split.mask, functools.partial(from_state, cut),
      functools.partial(to_state, cut),
      functools.partial(_tensor_specs, rules, len(cut.kinds) > 1)
      if rules else None,
      functools.partial(tied, cut, embed, head_loss),
      model_state(cut, variable_values(nnx.state(model, nnx.BatchStat))))


def _check_functions(model: Any, embed: Any, head_loss: Any) -> None:
  if not isinstance(model, nnx.Module):
    raise TypeError(f'model must be a flax.nnx.Module, got '
                    f'{type(model).__name__}.')
  for name, fn in (('embed', embed), ('head_loss', head_loss)):
    if not callable(fn):
      raise TypeError(f'{name} must be a function of the model, e.g. '
                      f'{name}=lambda m, ...: ..., got {fn!r}.')


# ------------------------------------------------------------- tensor rules


def _tensor_specs(rules: dict[str, tp.RuleMatch], kinds: bool,
                  pp: PipelineParams,
                  size: int = 1) -> PipelineParams:
  """``PipelineModel.tensor_specs``: each leaf's spec from ``rules`` (a
  stage leaf of several ``kinds`` by its path after the kind's key)."""
  def one(key_path, leaf, stage=False):
    name = '/'.join(str(k.key) for k in key_path[int(stage and kinds):])
    spec = rules[name].spec if name in rules else ()
    dims = range(np.ndim(leaf) - len(spec), np.ndim(leaf))
    for dim, entry in zip(dims, spec):
      if entry is not None and np.shape(leaf)[dim] % size:
        raise ValueError(
            f'param {name!r} {np.shape(leaf)}: dim {dim} of size '
            f'{np.shape(leaf)[dim]} is split over {entry!r} (spec {spec}) '
            f'but does not divide by its size {size}; choose a size that '
            f'divides it or change the rule.')
    return P(*(None,) * (np.ndim(leaf) - len(spec)), *spec)
  return PipelineParams(
      jax.tree_util.tree_map_with_path(one, pp.embed),
      jax.tree_util.tree_map_with_path(
          functools.partial(one, stage=True), pp.stages),
      jax.tree_util.tree_map_with_path(one, pp.head))
