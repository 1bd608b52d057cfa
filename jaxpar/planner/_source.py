"""The model a plan trains: its ``ModelSpec``, params and functions per layout.

``Source`` wraps what ``plan`` was given -- jaxpar's ``GPT`` (or its
``GPTConfig``), a Flax NNX model to cut with ``parallel.from_nnx``, a
``parallel.PipelineModel`` already cut (its stage count only), or a bare
``ModelSpec`` (a plan on paper: no trainer) -- and builds, for any number
of logical stages, the params and the three functions ``parallel.trainer``
takes (or the ``PipelineModel`` ``parallel.model_trainer`` takes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar import parallel
from jaxpar.mesh import make_mesh
from jaxpar.models import gpt
from jaxpar.planner._layout import Layout
from jaxpar.pipeline import StageVJP
from jaxpar.planner._model import STASH_POLICIES, ModelSpec, Split


class Source(NamedTuple):
  """A model as ``plan`` keeps it.

  Attributes:
    spec: what the planner reads.
    model: the user's model (``GPT``, NNX module) or ``None`` on paper.
    pipeline: ``pipeline(num_stages) -> (PipelineParams, functions,
      stage_mask, tensor_rules)`` or ``None`` on paper.
    num_stages: the logical stages every layout must have (a
      ``PipelineModel`` is cut already), or ``None``.
    batch_statistics: whether the model's blocks keep batch statistics
      (``nnx.BatchStat`` s: an unsynced BatchNorm normalises what one
      device runs at once, so splitting the batch changes its maths).
  """
  spec: ModelSpec
  model: Any
  pipeline: Callable[[int], tuple] | None
  num_stages: int | None = None
  batch_statistics: bool = False


def _gpt_pipeline(model: gpt.GPT | gpt.GPTConfig) -> Callable[[int], tuple]:
  """From a ``GPTConfig`` the model (seed 0) is built on first use."""
  built = [model]

  def pipeline(num_stages: int) -> tuple:
    if isinstance(built[0], gpt.GPTConfig):
      built[0] = gpt.GPT(built[0], rngs=nnx.Rngs(0))
    pp, split = gpt.split_for_pipeline(gpt.gpt_params(built[0]),
                                       num_stages=num_stages)
    return pp, gpt.functions(built[0].config), split.mask, gpt.TENSOR_RULES
  return pipeline


def _nnx_pipeline(model: nnx.Module, cut: dict) -> Callable[[int], tuple]:
  def pipeline(num_stages: int) -> tuple:
    pm = parallel.from_nnx(model, num_stages=num_stages, **cut)
    return pm.params, pm, pm.stage_mask, None
  return pipeline


def _parts(pm: parallel.PipelineModel) -> tuple[dict, tuple[int, ...]]:
  """``({part: Split of its elements}, sizes of the split dims)`` of a cut
  model's params: a leaf whose ``tensor_specs`` entry splits a dim counts
  as split (a ``stages`` leaf per slot), the rest as replicated."""
  specs = (pm.tensor_specs(pm.params) if pm.tensor_specs is not None
           else jax.tree.map(lambda _: P(), pm.params))
  parts, divisors = {}, set()
  for part in ('embed', 'stages', 'head'):
    split = replicated = 0.0
    leaves = jax.tree.leaves(getattr(pm.params, part))
    spec_leaves = jax.tree.leaves(getattr(specs, part),
                                  is_leaf=lambda x: isinstance(x, P))
    for leaf, spec in zip(leaves, spec_leaves):
      dims = [np.shape(leaf)[i] for i, e in enumerate(spec) if e is not None]
      divisors.update(dims)
      if dims:
        split += np.size(leaf)
      else:
        replicated += np.size(leaf)
    parts[part] = Split(split, replicated)
  return parts, tuple(sorted(divisors)) or (1,)


def _traced_stash(pm: parallel.PipelineModel, x: Any) -> tuple[tuple, Split]:
  """``(stash, kept)`` per token and layer of a cut model's own blocks:
  ``StageVJP`` traced on its stage (all its layers, one microbatch ``x``)
  under each of ``STASH_POLICIES`` (what the policy saves, less the stage
  input), and what ``I`` keeps for ``W`` (no arrays made). Each is cut into
  what XLA splits over ``tensor`` and what it keeps whole from one compile
  of the blocks on a ``tensor`` axis of two devices (``_tensor_shares``);
  without split params or two local devices, all whole (an upper bound)."""
  aval = lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype)
  stage = jax.tree.map(aval, pm.params.stages)
  state = (None if pm.model_state is None or pm.model_state.stages is None
           else jax.tree.map(aval, pm.model_state.stages))
  size = lambda tree: float(sum(np.prod(a.shape) for a in jax.tree.leaves(
      tree)))
  per = float(pm.stage_mask[0].size) * size(x) / x.shape[-1]  # slots * tokens
  vjps, whole, saves = [], [], []
  for policy in STASH_POLICIES:
    vjps.append(StageVJP(pm.functions[1], policy))
    y, saved = vjps[-1].trace(stage, x, None, state)
    saves.append(saved)
    whole.append(max(size(saved) - size(x), 0.0) / per)
  # what I keeps for W under 'dots' (STASH_POLICIES[0])
  whole.append(size(vjps[0].split(stage, saves[0], y, None, state)) / per)
  halves = _tensor_shares(pm, vjps, stage, x, state)
  halves = whole if halves is None else [h / per for h in halves]
  # per device at t = 1 (e1) and t = 2 (e2): split / t + replicated
  parts = [Split(2 * max(e1 - e2, 0.0), max(2 * e2 - e1, 0.0))
           for e1, e2 in zip(whole, halves)]
  return tuple(zip(STASH_POLICIES, parts[:-1])), parts[-1]


def _tensor_shares(pm: parallel.PipelineModel, vjps: list, stage: Any,
                   x: Any, state: Any) -> list[float] | None:
  """Elements per device of each policy's stash (less the stage input) and
  of ``dots``' ``kept``, as XLA lays them out with the stage's params split
  by the tensor rules over a ``tensor`` axis of two local devices (one
  compile of the blocks' ``F`` and ``I``: XLA's sharding propagation, as in
  the trainer, where ``tensor`` is an ``Auto`` axis); ``None`` without
  split params or two local devices, or where 2 does not divide a split
  dim."""
  devices = jax.local_devices()
  if pm.tensor_specs is None or len(devices) < 2:
    return None
  try:
    specs = pm.tensor_specs(pm.params, 2).stages
  except ValueError:
    return None
  if not any(any(e is not None for e in s) for s in jax.tree.leaves(
      specs, is_leaf=lambda s: isinstance(s, P))):
    return None
  mesh = jax.sharding.Mesh(np.array(devices[:2]), ('tensor',),
                           axis_types=(jax.sharding.AxisType.Auto,))
  shard = lambda s: jax.sharding.NamedSharding(mesh, P(*s[1:]))
  whole = jax.sharding.NamedSharding(mesh, P())

  def saves(params, x, st):
    out = []
    for vjp in vjps:
      y, stash = vjp.forward(params, x, None, st)[:2]
      out.append(stash)
    out.append(vjps[0].input_grad(params, out[0], y, None, st)[1])
    return out
  in_shardings = (jax.tree.map(shard, specs, is_leaf=lambda s: isinstance(
      s, P)), whole, jax.tree.map(lambda _: whole, state))
  lowered = jax.jit(saves, in_shardings=in_shardings).lower(stage, x, state)
  # only the layout is read: the backend's optimisations would cost seconds
  shardings = lowered.compile(
      {'xla_backend_optimization_level': 0}).output_shardings
  local = lambda a, s: float(np.prod(s.shard_shape(a.shape)))
  sizes = [sum(jax.tree.leaves(jax.tree.map(local, out, sh)))
           for out, sh in zip(lowered.out_info, shardings)]
  stage_input = float(np.prod(x.shape))
  return [max(n - stage_input, 0.0) for n in sizes[:-1]] + [sizes[-1]]


def _pipeline_spec(pm: parallel.PipelineModel, name: str,
                   inputs: Any) -> ModelSpec:
  """A ``ModelSpec`` of a cut model read from its params and one
  microbatch: widths from the embedding's output, params per part (split
  over ``tensor`` as its ``tensor_specs`` say), FLOPs split in the share
  of the layer's params that are, the stash and ``kept`` of its own blocks
  (``_traced_stash``)."""
  layers = int(pm.stage_mask.sum())
  x = jax.eval_shape(lambda p, i: pm.functions[0](p, i), pm.params.embed,
                     jax.tree.map(lambda a: a[:1], inputs))
  seq, d = int(np.prod(x.shape[1:-1])), int(x.shape[-1])
  parts, divisors = _parts(pm)
  layer = Split(*(n / pm.stage_mask.size for n in parts['stages']))
  flops = 2 * sum(layer) + 4 * seq * d
  share = layer.split / max(sum(layer), 1.0)
  as_gpt = ModelSpec.from_gpt(gpt.GPTConfig(d_model=d, num_heads=1,
                                            seq_len=seq, num_layers=layers))
  head = parts['head']
  stash, kept = _traced_stash(pm, x)
  return as_gpt._replace(
      name=name, layer=layer, embed=parts['embed'], head=head,
      flops=Split(share * flops, (1 - share) * flops),
      head_flops=Split(2 * head.split, 2 * head.replicated),
      divisors=divisors, vocab_size=1, stash=stash, kept=kept,
      stash_split=False, leaves=tuple(len(jax.tree.leaves(getattr(
          pm.params, part))) for part in ('stages', 'embed', 'head')))


def _cut_pipeline(pm: parallel.PipelineModel) -> Callable[[int], tuple]:
  def pipeline(num_stages: int) -> tuple:
    if num_stages != pm.stage_mask.shape[0]:
      raise ValueError(
          f'plan: the PipelineModel is cut for {pm.stage_mask.shape[0]} '
          f'logical stages, not {num_stages}; pass the NNX model itself '
          '(with blocks=, embed=, head_loss=) to plan every stage count.')
    return pm.params, pm, pm.stage_mask, None
  return pipeline


def source(model: Any, *, blocks: str, embed: Callable | None,
           head_loss: Callable | None, inputs: Any,
           tensor_rules: Mapping[str, Any] | None = None) -> Source:
  """The ``Source`` of what ``plan`` was given (see the module doc).

  Raises:
    TypeError: a model of another kind, or an NNX model without ``embed``
      and ``head_loss``, or without a batch of arrays.
    ValueError: ``tensor_rules`` for a model that is not an NNX model.
  """
  if tensor_rules is not None and (isinstance(
      model, (gpt.GPT, gpt.GPTConfig)) or not isinstance(model, nnx.Module)):
    raise ValueError(
        f'plan: tensor_rules are for a Flax NNX model cut by from_nnx; a '
        f'{type(model).__name__} has its own split (jaxpar\'s GPT: '
        'gpt.TENSOR_RULES; a PipelineModel: from_nnx(tensor_rules=...)). '
        'Leave tensor_rules out.')
  if isinstance(model, ModelSpec):
    return Source(model, None, None)
  if isinstance(model, (gpt.GPT, gpt.GPTConfig)):
    config = model if isinstance(model, gpt.GPTConfig) else model.config
    return Source(ModelSpec.from_gpt(config), model, _gpt_pipeline(model))
  if isinstance(model, nnx.Module):
    if embed is None or head_loss is None:
      raise TypeError(
          f'plan: a {type(model).__name__} is cut with parallel.from_nnx: '
          'pass blocks=, embed= and head_loss= as from_nnx takes them.')
    if inputs is None:
      raise TypeError(
          f'plan: batch is a size, but a {type(model).__name__} is read '
          'from one microbatch; pass batch=(inputs, targets) of one step.')
    cut = dict(blocks=blocks, embed=embed, head_loss=head_loss,
               tensor_rules=tensor_rules)
    pm = parallel.from_nnx(model, num_stages=1, **cut)
    return Source(_pipeline_spec(pm, type(model).__name__, inputs), model,
                  _nnx_pipeline(model, cut),
                  batch_statistics=pm.model_state is not None)
  if isinstance(model, parallel.PipelineModel):
    if inputs is None:
      raise TypeError('plan: batch is a size, but a PipelineModel is read '
                      'from one microbatch; pass batch=(inputs, targets) of '
                      'one step.')
    return Source(_pipeline_spec(model, 'PipelineModel', inputs), model,
                  _cut_pipeline(model), model.stage_mask.shape[0],
                  batch_statistics=model.model_state is not None)
  raise TypeError(
      f'plan: model must be jaxpar.models.gpt.GPT (or its GPTConfig), a '
      f'flax.nnx.Module (with blocks=, embed=, head_loss=), a '
      f'parallel.PipelineModel or a jaxpar.planner.ModelSpec; got '
      f'{type(model).__name__}.')


def build_trainer(src: Source, devices: Sequence, layout: Layout,
                  optimizer: optax.GradientTransformation, **options: Any):
  """``parallel.trainer`` (``model_trainer`` for a cut NNX model) of
  ``layout`` for ``src`` on ``devices``."""
  _, functions, mask, rules = src.pipeline(layout.num_stages)
  mesh = make_mesh(data=layout.data, stage=layout.stage,
                   tensor=layout.tensor,
                   devices=list(devices)[:layout.devices])
  common = dict(schedule=layout.schedule(), mesh=mesh,
                zero_stage=layout.zero_stage,
                remat_policy=layout.remat_policy,
                w_recompute=layout.w_recompute, **options)
  if isinstance(functions, parallel.PipelineModel):
    return parallel.model_trainer(functions, optimizer, **common)
  return parallel.trainer(*functions, optimizer, stage_mask=mask,
                          tensor_rules=rules, **common)
