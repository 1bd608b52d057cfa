"""A decoder-only GPT in Flax NNX, and its tensor- and pipeline-parallel form.

The dense model is plain Flax NNX (``nnx.Embed``, ``nnx.MultiHeadAttention``,
``nnx.LayerNorm``, ``nnx.Linear``): the single-device reference. Its params
(``nnx.split(model, nnx.Param)``, as a pure dict) run unchanged through the
tensor-parallel functions of ``jaxpar.tensor_parallel``, which take Flax's
param names, split over ``tensor`` by ``TENSOR_RULES``;
``split_for_pipeline`` cuts them into the three parts the 3D train step
(``jaxpar.parallel``) needs::

  embed  {'embed', 'pos'}         token + position embedding, before the pipeline
  stages blocks stacked [S, L_s, ...]   pipeline stage k = its L_s block slots
  head   {'ln_f', 'lm_head'}      final norm + LM head, in the pipeline's loss_fn

Uneven layer counts (``L`` layers on ``S`` stages) are balanced -- the first
``L % S`` stages get one layer more -- and the missing slots are *identity*
blocks (all-zero params: ``x + 0 + 0 == x`` exactly). ``LayerSplit.mask``
marks the real slots; the train step zeroes the gradients of the others, so
they stay identity and the maths is that of the ``L``-layer model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpar import tensor_parallel as tp
from jaxpar.models.mlp import MLP
from jaxpar.parallel import LayerParams, LayerSplit, PipelineParams

PyTree = Any

# How jaxpar's GPT splits over the ``tensor`` axis (``jaxpar.tensor_parallel``
# rules: a regex matching the whole /-joined param path -> the PartitionSpec
# entries of the param's trailing dims). They fit the dense ``gpt_params``
# (``blocks/0/attn/query/kernel``), one block, and each part of
# ``split_for_pipeline`` (embed; stages, leaves [S, slots, ...]; head):
# attention by heads (query/key/value kernels [d, H/N, k], biases [H/N, k];
# out kernel [H/N, k, d]), the MLP by columns then rows, the embedding and
# the LM head by vocabulary. Norms, ``pos`` and row biases are replicated.
TENSOR_RULES = {
    r'(blocks/\d+/)?attn/(query|key|value)/(kernel|bias)': ('tensor', None),
    r'(blocks/\d+/)?attn/out/kernel': ('tensor', None, None),
    r'(blocks/\d+/)?mlp/fc_in/(kernel|bias)': ('tensor',),
    r'(blocks/\d+/)?mlp/fc_out/kernel': ('tensor', None),
    r'embed/embedding': ('tensor', None),
    r'lm_head/(kernel|bias)': ('tensor',),
}


class GPTConfig(NamedTuple):
  """Sizes of a GPT. ``d_model`` divisible by ``num_heads``.

  ``dropout``: rate of the parallel functions' dropout (``functions``): on
  the embedding output and on each block's attention and MLP outputs before
  their residual add. The dense ``GPT`` is the deterministic
  (evaluation-mode) model.
  """
  vocab_size: int = 32
  seq_len: int = 16
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 4
  mlp_ratio: int = 4
  dropout: float = 0.0


def _causal_attention(query, key, value, mask=None, **unused_kwargs):
  """``nnx.MultiHeadAttention``'s ``attention_fn``: the causal core.

  The core of the tensor-parallel attention too
  (``tensor_parallel.dot_product_attention``: ``jax.nn.dot_product_attention``,
  exact einsums in float64), so the dense and parallel models run the same
  maths. Causality is built in (``is_causal``); no dropout on the attention
  probabilities (the parallel functions drop residual branches).
  """
  if mask is not None:
    raise ValueError('the GPT block is causal by construction; call it '
                     'without mask=.')
  del unused_kwargs   # nnx's dropout arguments: not used
  return tp.dot_product_attention(query, key, value, causal=True)


class Block(nnx.Module):
  """Pre-norm block: ``h = x + attn(ln1(x)); y = h + mlp(ln2(h))`` (causal)."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs,
               param_dtype: Any = jnp.float32):
    d, kw = config.d_model, dict(param_dtype=param_dtype, rngs=rngs)
    self.ln1 = nnx.LayerNorm(d, **kw)
    self.attn = nnx.MultiHeadAttention(num_heads=config.num_heads,
                                       in_features=d, decode=False,
                                       attention_fn=_causal_attention, **kw)
    self.ln2 = nnx.LayerNorm(d, **kw)
    self.mlp = MLP(d, config.mlp_ratio * d, **kw)

  def __call__(self, x):
    h = x + self.attn(self.ln1(x))
    return h + self.mlp(self.ln2(h))


class GPT(nnx.Module):
  """Decoder-only transformer: ``ids [B, S] -> logits [B, S, V]``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxpar.models import gpt
    >>> model = gpt.GPT(gpt.GPTConfig(), rngs=nnx.Rngs(0))
    >>> ids = jnp.zeros((2, 16), jnp.int32)                  # [B, S]
    >>> model(ids).shape                                      # [B, S, V]
    (2, 16, 32)
  """

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs,
               param_dtype: Any = jnp.float32):
    if config.d_model % config.num_heads:
      raise ValueError(f'd_model={config.d_model} is not divisible by '
                       f'num_heads={config.num_heads}.')
    self.config = config
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.embed = nnx.Embed(config.vocab_size, config.d_model, **kw)
    self.pos = nnx.Param(0.02 * jax.random.normal(
        rngs.params(), (config.seq_len, config.d_model), param_dtype))
    self.blocks = nnx.List([Block(config, **kw)
                            for _ in range(config.num_layers)])
    self.ln_f = nnx.LayerNorm(config.d_model, **kw)
    self.lm_head = nnx.Linear(config.d_model, config.vocab_size, **kw)

  def __call__(self, ids):
    x = self.embed(ids) + self.pos[...][:ids.shape[-1]]
    for block in self.blocks:
      x = block(x)
    return self.lm_head(self.ln_f(x))


def gpt_params(model: GPT) -> dict:
  """The model's parameters as a pure dict of arrays (``blocks`` keyed 0..L-1).

  Example:
    >>> from flax import nnx
    >>> from jaxpar.models import gpt
    >>> params = gpt.gpt_params(gpt.GPT(gpt.GPTConfig(), rngs=nnx.Rngs(0)))
    >>> sorted(params), sorted(params['blocks'])
    (['blocks', 'embed', 'lm_head', 'ln_f', 'pos'], [0, 1, 2, 3])
  """
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@functools.lru_cache(maxsize=None)
def _abstract_model(config: GPTConfig, dtype: np.dtype):
  return nnx.split(nnx.eval_shape(
      lambda: GPT(config, rngs=nnx.Rngs(0), param_dtype=dtype)))


def gpt_apply(params: dict, ids: jax.Array, *, config: GPTConfig) -> jax.Array:
  """Dense forward ``ids [B, S] -> logits [B, S, V]`` from ``gpt_params``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxpar.models import gpt
    >>> model = gpt.GPT(gpt.GPTConfig(), rngs=nnx.Rngs(0))
    >>> ids = jnp.arange(16)[None] % 32
    >>> logits = gpt.gpt_apply(gpt.gpt_params(model), ids,
    ...                        config=gpt.GPTConfig())
    >>> bool(jnp.array_equal(logits, model(ids)))
    True
  """
  graphdef, state = _abstract_model(config, params['pos'].dtype)
  state = jax.tree.map(lambda x: x, state)   # a fresh State to fill in
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)(ids)


def gpt_loss(params: dict, batch: tuple[jax.Array, jax.Array], *,
             config: GPTConfig) -> jax.Array:
  """Mean next-token cross-entropy of the dense model: the reference.

  Args:
    params: ``gpt_params(model)``.
    batch: ``(ids, targets)``, both int ``[B, S]``.
    config: the model's ``GPTConfig``.

  Returns:
    scalar, ``optax.losses.softmax_cross_entropy_with_integer_labels``
    averaged over batch and positions.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxpar.models import gpt
    >>> config = gpt.GPTConfig()
    >>> params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0)))
    >>> ids = jnp.arange(32).reshape(2, 16)
    >>> loss = gpt.gpt_loss(params, (ids, (ids + 1) % 32), config=config)
    >>> loss.shape, bool(loss > 0)
    ((), True)
  """
  ids, targets = batch
  return optax.losses.softmax_cross_entropy_with_integer_labels(
      gpt_apply(params, ids, config=config), targets).mean()


# ---------------------------------------------------------------------------
# The parallel form: pure functions over the local shards, run inside a
# shard_map whose 'tensor' axis splits heads, MLP features and vocabulary.


def split_for_pipeline(params: dict, *, num_stages: int,
                       counts: Sequence[int] | None = None):
  """Dense ``gpt_params`` -> (``PipelineParams(embed, stages, head)``, split).

  ``split``: the ``jaxpar.parallel.LayerSplit`` of the layers over stages.

  ``counts`` (optional): layers per stage in model order, positive, summing
  to the number of layers, e.g. ``jaxpar.pipeline.balance(layer_costs,
  num_stages, first=embed_cost, last=head_cost)``; default balanced.

  ``stages`` leaves are ``[num_stages, slots, ...]``: block ``i`` of the
  dense model is slot ``j`` of stage ``k`` in model order; identity slots are
  zeros. ``merge_from_pipeline`` inverts it.

  Raises:
    TypeError: ``num_stages`` is not an int (NumPy ints are; ``True`` is not).
    ValueError: ``num_stages < 1`` or more stages than layers.

  Example:
    >>> from flax import nnx
    >>> from jaxpar.models import gpt
    >>> model = gpt.GPT(gpt.GPTConfig(num_layers=6), rngs=nnx.Rngs(0))
    >>> pp, split = gpt.split_for_pipeline(gpt.gpt_params(model),
    ...                                    num_stages=4)
    >>> split.counts, split.slots            # 6 layers on 4 stages
    ((2, 2, 1, 1), 2)
    >>> pp.stages['ln1']['scale'].shape      # [stages, slots, d]
    (4, 2, 64)
  """
  blocks = [params['blocks'][i] for i in sorted(params['blocks'])]
  if isinstance(num_stages, bool) or not isinstance(num_stages,
                                                    (int, np.integer)):
    raise TypeError(f'num_stages={num_stages!r} must be an int, got a '
                    f'{type(num_stages).__name__}.')
  if not 1 <= num_stages <= len(blocks):
    raise ValueError(
        f'num_stages={num_stages!r}: the GPT has {len(blocks)} layers; use '
        f'1 <= num_stages <= {len(blocks)} (every stage needs a layer), or '
        f'more layers.')
  if counts is not None:
    counts = tuple(int(c) for c in counts)
    if (len(counts) != num_stages or min(counts) < 1
        or sum(counts) != len(blocks)):
      raise ValueError(
          f'counts={counts}: need {num_stages} positive layer counts summing '
          f'to the {len(blocks)} layers, e.g. jaxpar.pipeline.balance('
          f'layer_costs, {num_stages}).')
  split = LayerSplit(len(blocks), int(num_stages), counts)
  stages = split.stack(blocks)
  embed = {'embed': params['embed'], 'pos': params['pos']}
  head = {'ln_f': params['ln_f'], 'lm_head': params['lm_head']}
  return PipelineParams(embed, stages, head), split


def merge_from_pipeline(pipeline_params, split: LayerSplit) -> dict:
  """Inverse of ``split_for_pipeline``: back to dense ``gpt_params``.

  Also takes the per-layer view the 3D trainer's optimizer sees
  (``LayerParams(embed, layers, head)``, e.g. Adam's ``mu`` in its state).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxpar.models import gpt
    >>> params = gpt.gpt_params(gpt.GPT(gpt.GPTConfig(), rngs=nnx.Rngs(0)))
    >>> back = gpt.merge_from_pipeline(*gpt.split_for_pipeline(
    ...     params, num_stages=3))
    >>> jax.tree.all(jax.tree.map(jnp.array_equal, back, params))
    True
  """
  if isinstance(pipeline_params, LayerParams):
    embed, layers, head = pipeline_params
    return {'blocks': dict(enumerate(layers)), **embed, **head}
  embed, stages, head = pipeline_params
  real = tuple((k, j) for k, count in enumerate(split.counts)
               for j in range(count))
  arrays = all(isinstance(x, jax.Array) for x in jax.tree.leaves(stages))
  blocks = (_blocks_of if arrays else _blocks)(stages, real)
  return {'blocks': dict(enumerate(blocks)), **embed, **head}


def _blocks(stages: Any, real: tuple[tuple[int, int], ...]) -> list:
  """Block ``i`` of the dense model: slot ``real[i] = (k, j)`` of ``stages``."""
  return [jax.tree.map(lambda x: x[k, j], stages) for k, j in real]


# Global arrays: one program per signature (eager indexing compiles an op
# per leaf shape and slot); numpy stays numpy.
_blocks_of = jax.jit(_blocks, static_argnums=1)


def functions(config: GPTConfig, *, tensor_axis: str = 'tensor'):
  """``(embed_fn, stage_fn, head_loss_fn)`` with ``config.dropout`` bound.

  The three functions ``jaxpar.parallel.trainer`` takes, their params split
  over ``tensor`` by ``TENSOR_RULES`` (the trainer's ``tensor_rules=``); with
  a ``key`` there, dropout is on. ``head_loss_fn`` is
  ``head_loss_and_accuracy_fn`` for ``has_aux=True``.

  Example:
    >>> import jax, numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> from jaxpar.models import gpt
    >>> config = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16,
    ...                        num_heads=2, num_layers=2, dropout=0.1)
    >>> params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0)))
    >>> pp, split = gpt.split_for_pipeline(params, num_stages=2)
    >>> trainer = jaxpar.parallel.trainer(
    ...     *gpt.functions(config), optax.adam(1e-3),
    ...     schedule=jaxpar.pipeline.one_f_one_b(2, 2),
    ...     mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
    ...     tensor_rules=gpt.TENSOR_RULES, stage_mask=split.mask,
    ...     key=jax.random.key(0))
    >>> ids = np.zeros((4, 8), np.int32)
    >>> state, stats = trainer.step(trainer.init(pp), (ids, ids))
    >>> stats.loss.dtype
    dtype('float32')
  """
  bind = lambda fn: functools.partial(fn, tensor_axis=tensor_axis,
                                      dropout=config.dropout)
  return (bind(embed_fn), bind(stage_fn),
          functools.partial(head_loss_fn, tensor_axis=tensor_axis))


def embed_fn(params: dict, ids: jax.Array, *, key: jax.Array | None = None,
             tensor_axis: str = 'tensor', dropout: float = 0.0) -> jax.Array:
  """Token (vocab-parallel) + position embedding: ``ids [B, S] -> [B, S, d]``.

  Inside ``shard_map``; ``params['embed']['embedding']`` is the ``[V/N, d]``
  shard. One all-reduce over ``tensor_axis``. With ``key``: dropout at rate
  ``dropout`` on the sum (``tensor_parallel.dropout``).
  """
  x = tp.vocab_parallel_embed(ids, params['embed']['embedding'],
                              tensor_axis=tensor_axis)
  return tp.dropout(x + params['pos'][:ids.shape[-1]], dropout, key,
                    tensor_axis=tensor_axis)


def stage_fn(params: dict, x: jax.Array, *, key: jax.Array | None = None,
             tensor_axis: str = 'tensor', dropout: float = 0.0) -> jax.Array:
  """One pipeline stage: its ``slots`` blocks in order, ``[B, S, d] -> same``.

  ``params`` leaves are ``[slots, ...]`` (one stage of ``split_for_pipeline``
  's ``stages``), tensor-parallel shards, applied in order by one
  ``lax.scan`` (one block's program, however many slots). Identity slots
  (zeros) return their input exactly, dropout or not. Two all-reduces over
  ``tensor_axis`` per block forward. With ``key``: residual dropout at rate
  ``dropout`` in each block, slot ``j`` drawing from ``fold_in(key, j)``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar.models import gpt
    >>> tp = jaxpar.tensor_parallel
    >>> model = gpt.GPT(gpt.GPTConfig(num_layers=2), rngs=nnx.Rngs(0))
    >>> pp, _ = gpt.split_for_pipeline(gpt.gpt_params(model), num_stages=1)
    >>> stage = jax.tree.map(lambda a: a[0], pp.stages)    # [slots, ...]
    >>> mesh = jaxpar.make_mesh(tensor=2, devices=jax.devices()[:2])
    >>> specs = tp.param_specs(stage, rules=gpt.TENSOR_RULES)
    >>> run = jax.shard_map(gpt.stage_fn, mesh=mesh, in_specs=(specs, P()),
    ...                     out_specs=P())
    >>> x = jax.random.normal(jax.random.key(0), (2, 16, 64))
    >>> y = run(tp.shard_params(stage, mesh=mesh, rules=gpt.TENSOR_RULES), x)
    >>> bool(jnp.allclose(y, model.blocks[1](model.blocks[0](x)), atol=1e-4))
    True
  """
  def block(x, slot):
    block_params, j = slot
    k = None if key is None else jax.random.fold_in(key, j)
    return tp.transformer_block(block_params, x, tensor_axis=tensor_axis,
                                causal=True, dropout=dropout, key=k), None

  slots = jax.tree.leaves(params)[0].shape[0]
  return jax.lax.scan(block, x, (params, jnp.arange(slots)))[0]


def _head(params: dict, y: jax.Array, tensor_axis: str) -> jax.Array:
  """Final norm and LM head: local logits ``[B, S, V/N]``."""
  h = tp.layer_norm(params['ln_f'], y)
  return tp.column_parallel_linear(h, params['lm_head']['kernel'],
                                   params['lm_head']['bias'],
                                   tensor_axis=tensor_axis)


def head_loss_fn(params: dict, y: jax.Array, targets: jax.Array, *,
                 key: jax.Array | None = None,
                 tensor_axis: str = 'tensor') -> jax.Array:
  """Final norm, vocab-parallel LM head and cross-entropy, mean over ``[B, S]``.

  The full logits ``[B, S, V]`` are never gathered
  (``vocab_parallel_cross_entropy``, in float32 or wider whatever the
  compute dtype). ``key`` is accepted for the pipeline's signature; the head
  has no dropout.
  """
  del key  # no dropout in the head
  logits = _head(params, y, tensor_axis)
  return tp.vocab_parallel_cross_entropy(logits, targets,
                                         tensor_axis=tensor_axis).mean()


def head_loss_and_accuracy_fn(
    params: dict, y: jax.Array, targets: jax.Array, *,
    key: jax.Array | None = None, tensor_axis: str = 'tensor'
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """``(head_loss_fn, {'accuracy': ...})`` for ``has_aux=True``.

  ``accuracy``: the fraction of positions whose target has the largest
  logit, float32, from the vocabulary shards (one ``pmax`` and one ``psum``
  of ``[B, S]`` values over ``tensor_axis``; the logits are never gathered).
  """
  del key  # no dropout in the head
  logits = _head(params, y, tensor_axis)
  loss = tp.vocab_parallel_cross_entropy(logits, targets,
                                         tensor_axis=tensor_axis).mean()
  logits = jax.lax.stop_gradient(logits)   # a metric: no gradient
  vocab = logits.shape[-1]
  local = targets - jax.lax.axis_index(tensor_axis) * vocab
  mine = (local >= 0) & (local < vocab)
  target = jnp.take_along_axis(logits, jnp.where(mine, local, 0)[..., None],
                               axis=-1)[..., 0]
  target = jax.lax.psum(jnp.where(mine, target, 0), tensor_axis)
  best = jax.lax.pmax(jnp.max(logits, axis=-1), tensor_axis)
  return loss, {'accuracy': jnp.mean((target >= best).astype(jnp.float32))}
