"""What the planner needs to know of a model: ``ModelSpec``, counts per layer.

A ``ModelSpec`` is a GPT-shaped transformer described by numbers alone --
param elements per layer, embed and head (each cut into a part split over
``tensor`` and a replicated part), activation elements per token stashed
for the backward under each remat policy, and forward FLOPs per token -- so
the planner ranks layouts of models it never builds (a Llama-style 8B on 64
GPUs) as well as of the one in hand. ``ModelSpec.from_gpt`` reads jaxpar's
GPT (``jaxpar.models.gpt``, split by ``gpt.TENSOR_RULES``).

Per block of width ``d``, ``H`` heads, sequence ``S`` (elements; ``/t``:
split over ``tensor``)::

  params   split 12 d^2 + 7 d (q, k, v, out, fc_in, fc_out + their biases)
           replicated 6 d (two layer norms, the out and fc_out biases)
  stash    'dots' (matmul outputs: q, k, v, attention, fc_in, out, fc_out;
           the scores in float32 only)    (6 d + f + H S) / t per token
           'dots_no_batch' (no scores)    (5 d + f) / t
           'nothing' (the stage input)    0 (+ d / t per token per stage)
           'everything' (f = 4 d)         (13.5 d + 5 f + 2 H S + 2 H + 4) / t
                                          + 4 d
  kept     (I -> W)                       (13 d + H S) / t + 8 d + 2

The stash is stored split over ``tensor`` (the executor splits what the
tensor-parallel layers replicate, as Megatron's sequence parallelism
does): ``replicated`` there is what stays whole on every tensor rank. The
counts are ``StageVJP``'s traced stash for the GPT at ``t`` = 1 and 2
(the ``'dots'`` stashes over widths 64-256 at ``mlp_ratio`` 2 and 4;
``'everything'`` fitted over widths 32-64, 4-8 heads, sequences 16-32 at
``mlp_ratio`` 4: the MLP's share of its ``37.5 d`` is a guess).
  FLOPs    forward 24 d^2 / t + 4 S d / t per token (matmuls, causal mask
           not exploited); backward twice that.

Example:
  >>> from jaxpar.models import gpt
  >>> from jaxpar.planner import ModelSpec
  >>> spec = ModelSpec.from_gpt(gpt.GPTConfig(d_model=32, num_layers=4,
  ...                                         vocab_size=64))
  >>> spec.num_params                  # = the GPT's params
  55552
  >>> spec.tensor_sizes(8)             # heads (4) and widths divide by these
  (1, 2, 4)
"""

from __future__ import annotations

import math
from typing import NamedTuple

from jaxpar.models import gpt

# The remat policies whose stash the planner models (``ModelSpec.stash``).
STASH_POLICIES = ('dots', 'dots_no_batch', 'nothing', 'everything')


class Split(NamedTuple):
  """Elements of a part: ``split`` over ``tensor``, ``replicated`` not."""
  split: float
  replicated: float

  def per_device(self, tensor: int) -> float:
    """Elements one device holds on a ``tensor``-wide axis."""
    return self.split / tensor + self.replicated


class ModelSpec(NamedTuple):
  """A transformer as the planner sees it (element counts, not arrays).

  Attributes:
    name: for tables.
    num_layers, d_model, num_heads, seq_len, vocab_size: the sizes.
    layer, embed, head: param elements (``Split``) of one block, of the
      part before the blocks and of the part after them.
    stash: ``((policy, Split), ...)``, activation elements per token one
      block stashes for its backward under each remat policy
      (``stash_of``): ``split`` stored split over ``tensor``,
      ``replicated`` stored whole on every tensor rank.
    kept: elements per token one block keeps from its input-gradient half
      for its weight-gradient half (matmul and norm inputs, the cotangents
      at their outputs, the attention probabilities).
    flops: forward FLOPs per token of one block (``Split``).
    head_flops: forward FLOPs per token of the head (``Split``).
    divisors: sizes ``tensor`` must divide (heads, MLP width, vocabulary).
    param_bytes: bytes per param element (4: float32).
    act_bytes: bytes per activation element.
    stash_split: whether a pipeline stage's stash is stored split over
      ``tensor`` (jaxpar's GPT: ``tensor`` is a manual axis, and the
      executor splits what it replicates); ``False`` for a model cut by
      ``from_nnx``, whose ``tensor`` axis XLA partitions (its stash is cut
      as XLA lays it out, its stage input and messages are whole).
    leaves: param arrays (pytree leaves) of one layer, of embed and of
      head: ZeRO-3 gathers each separately (the time model counts its
      collectives).
  """
  name: str
  num_layers: int
  d_model: int
  num_heads: int
  seq_len: int
  vocab_size: int
  layer: Split
  embed: Split
  head: Split
  stash: tuple
  kept: Split
  flops: Split
  head_flops: Split
  divisors: tuple[int, ...]
  param_bytes: int = 4
  act_bytes: int = 4
  stash_split: bool = True
  leaves: tuple[int, int, int] = (16, 2, 4)

  @classmethod
  def from_gpt(cls, config: gpt.GPTConfig, *, name: str | None = None,
               param_bytes: int = 4, act_bytes: int = 4) -> 'ModelSpec':
    """The spec of ``gpt.GPT(config)`` (split by ``gpt.TENSOR_RULES``)."""
    d, h, s = config.d_model, config.num_heads, config.seq_len
    f, v = config.mlp_ratio * d, config.vocab_size
    scores = h * s if act_bytes >= 4 else 0   # not stashed wider than q, k
    stash = (('dots', Split(6 * d + f + scores, 0)),
             ('dots_no_batch', Split(5 * d + f, 0)),
             ('nothing', Split(0, 0)),
             ('everything', Split(13.5 * d + 5 * f + 2 * h * s + 2 * h + 4,
                                  4 * d)))
    return cls(
        name=name or f'GPT d={d} L={config.num_layers}',
        num_layers=config.num_layers, d_model=d, num_heads=h, seq_len=s,
        vocab_size=v,
        layer=Split(4 * d * d + 2 * d * f + 3 * d + f, 6 * d),
        embed=Split(v * d, s * d), head=Split(d * v + v, 2 * d),
        stash=stash, kept=Split(13 * d + h * s, 8 * d + 2), flops=Split(8 * d * d + 4 * d * f + 4 * s * d, 0),
        head_flops=Split(2 * d * v, 0), divisors=(h, f, v),
        param_bytes=param_bytes, act_bytes=act_bytes, leaves=(16, 2, 4))

  @classmethod
  def llama(cls, *, d_model: int, num_layers: int, num_heads: int,
            num_kv_heads: int, ffn: int, vocab_size: int, seq_len: int,
            name: str = 'Llama', param_bytes: int = 4,
            act_bytes: int = 2) -> 'ModelSpec':
    """A Llama-style decoder on paper: grouped-query attention (flash: no
    ``S x S`` scores stashed), SwiGLU MLP of width ``ffn``, RMSNorm, untied
    head; float32 params and optimizer state, bf16 activations. The stash
    is split over ``tensor`` as the GPT's is (``'everything'`` keeps four
    ``d``-wide residuals whole, as the GPT's measured ones do).

    Example:
      >>> from jaxpar.planner import ModelSpec
      >>> spec = ModelSpec.llama(d_model=4096, num_layers=32, num_heads=32,
      ...                        num_kv_heads=8, ffn=14336, vocab_size=128256,
      ...                        seq_len=8192)
      >>> round(spec.num_params / 1e9, 2)             # Llama 3 8B
      8.03
    """
    d, f, v, s = d_model, ffn, vocab_size, seq_len
    kv = 2 * d * num_kv_heads // num_heads    # k and v widths together
    stash = (('dots', Split(4 * d + kv + 2 * f, 0)),
             ('dots_no_batch', Split(4 * d + kv + 2 * f, 0)),
             ('nothing', Split(0, 0)),
             ('everything', Split(4 * d + kv + 5 * f, 4 * d)))
    return cls(
        name=name, num_layers=num_layers, d_model=d, num_heads=num_heads,
        seq_len=s, vocab_size=v, layer=Split(2 * d * d + d * kv + 3 * d * f,
                                             2 * d),
        embed=Split(v * d, 0), head=Split(d * v, d), stash=stash,
        kept=Split(2 * d + kv + 3 * f, 4 * d + 2), flops=Split(2 * (2 * d * d + d * kv + 3 * d * f) + 2 * s * d, 0),
        head_flops=Split(2 * d * v, 0), divisors=(num_kv_heads, f, v),
        param_bytes=param_bytes, act_bytes=act_bytes, leaves=(9, 1, 2))

  def stash_per_device(self, policy: str, tensor: int) -> float:
    """Elements per token one device stashes for one block under ``policy``
    on a ``tensor``-wide axis (``stash_of(policy).per_device(tensor)``: the
    executor stores what the tensor-parallel layers replicate split over
    ``tensor`` too, as Megatron's sequence parallelism does, and gathers it
    in the backward).

    Example (Llama-3-405B, ``'dots'``, bf16, ``tensor=8``: bytes per token
    and layer against Megatron's ``34 h / t`` with selective recompute and
    sequence parallelism):
      >>> from jaxpar.planner import ModelSpec
      >>> spec = ModelSpec.llama(d_model=16384, num_layers=126,
      ...                        num_heads=128, num_kv_heads=8, ffn=53248,
      ...                        vocab_size=128256, seq_len=8192)
      >>> spec.stash_per_device('dots', 8) * spec.act_bytes, 34 * 16384 // 8
      (43520.0, 69632)
    """
    return self.stash_of(policy).per_device(tensor)

  def stash_of(self, policy: str) -> Split:
    """Elements per token one block stashes under ``policy``, a name of
    ``STASH_POLICIES``."""
    stash = dict(self.stash)
    if policy not in stash:
      raise ValueError(
          f'remat_policy={policy!r}: the planner models the stash of '
          f'{STASH_POLICIES} only; plan with one of them.')
    return stash[policy]

  @property
  def num_params(self) -> int:
    """All param elements."""
    parts = (self.embed, self.head) + (self.layer,) * self.num_layers
    return int(sum(p.split + p.replicated for p in parts))

  def tensor_sizes(self, limit: int) -> tuple[int, ...]:
    """The ``tensor`` sizes up to ``limit`` that divide every divisor."""
    return tuple(t for t in range(1, limit + 1)
                 if all(x % t == 0 for x in self.divisors))

  def flops_per_token(self) -> float:
    """Training FLOPs per token of the whole model (3 x forward)."""
    fwd = self.num_layers * sum(self.flops) + sum(self.head_flops)
    return 3.0 * fwd


def slots(num_layers: int, num_stages: int) -> int:
  """Block slots per logical stage: ``ceil(L / S)`` (``LayerSplit``)."""
  return math.ceil(num_layers / num_stages)
