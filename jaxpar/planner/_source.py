"""The model a plan trains: its ``ModelSpec``, params and functions per layout.

``Source`` wraps what ``plan`` was given -- jaxpar's ``GPT`` (or its
``GPTConfig``), a Flax NNX model to cut with ``parallel.from_nnx``, a
``parallel.PipelineModel`` already cut (its stage count only), or a bare
``ModelSpec`` (a plan on paper: no trainer) -- and builds, for any number
of logical stages, the params and the three functions ``parallel.trainer``
takes (or the ``PipelineModel`` ``parallel.model_trainer`` takes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

from jaxpar import parallel
from jaxpar.mesh import make_mesh
from jaxpar.models import gpt
from jaxpar.planner._layout import Layout
from jaxpar.planner._model import ModelSpec, Split


class Source(NamedTuple):
  """A model as ``plan`` keeps it.

  Attributes:
    spec: what the planner reads.
    model: the user's model (``GPT``, NNX module) or ``None`` on paper.
    pipeline: ``pipeline(num_stages) -> (PipelineParams, functions,
      stage_mask, tensor_rules)`` or ``None`` on paper.
    num_stages: the logical stages every layout must have (a
      ``PipelineModel`` is cut already), or ``None``.
  """
  spec: ModelSpec
  model: Any
  pipeline: Callable[[int], tuple] | None
  num_stages: int | None = None


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


def _nnx_pipeline(model: nnx.Module, blocks: str, embed: Callable,
                  head_loss: Callable) -> Callable[[int], tuple]:
  def pipeline(num_stages: int) -> tuple:
    pm = parallel.from_nnx(model, blocks=blocks, num_stages=num_stages,
                           embed=embed, head_loss=head_loss)
    return pm.params, pm, pm.stage_mask, None
  return pipeline


def _elements(tree: Any) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def _pipeline_spec(pm: parallel.PipelineModel, name: str,
                   inputs: Any) -> ModelSpec:
  """A ``ModelSpec`` of a cut model read from its params and one
  microbatch: widths from the embedding's output, params per part (no
  tensor split), a GPT-like stash per token of its width."""
  layers = int(pm.stage_mask.sum())
  x = jax.eval_shape(lambda p, i: pm.functions[0](p, i), pm.params.embed,
                     inputs[:1])
  seq, d = int(np.prod(x.shape[1:-1])), int(x.shape[-1])
  per_layer = _elements(pm.params.stages) / pm.stage_mask.size
  as_gpt = ModelSpec.from_gpt(gpt.GPTConfig(d_model=d, num_heads=1,
                                            seq_len=seq, num_layers=layers))
  return as_gpt._replace(
      name=name, layer=Split(0, per_layer),
      embed=Split(0, _elements(pm.params.embed)),
      head=Split(0, _elements(pm.params.head)),
      flops=Split(0, 2 * per_layer + 4 * seq * d),
      head_flops=Split(0, 2 * _elements(pm.params.head)),
      divisors=(1,), vocab_size=1)


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
           head_loss: Callable | None, inputs: Any) -> Source:
  """The ``Source`` of what ``plan`` was given (see the module doc).

  Raises:
    TypeError: a model of another kind, or an NNX model without ``embed``
      and ``head_loss``.
  """
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
    pm = parallel.from_nnx(model, blocks=blocks, num_stages=1, embed=embed,
                           head_loss=head_loss)
    return Source(_pipeline_spec(pm, type(model).__name__, inputs), model,
                  _nnx_pipeline(model, blocks, embed, head_loss))
  if isinstance(model, parallel.PipelineModel):
    return Source(_pipeline_spec(model, 'PipelineModel', inputs), model,
                  _cut_pipeline(model), model.stage_mask.shape[0])
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
                remat_policy=layout.remat_policy, **options)
  if isinstance(functions, parallel.PipelineModel):
    return parallel.model_trainer(functions, optimizer, **common)
  return parallel.trainer(*functions, optimizer, stage_mask=mask,
                          tensor_rules=rules, **common)
