"""Section ``tensor_rules_vs_megatron``: collectives of a block split by rules.

A user's transformer block as written with Flax NNX (pre-norm attention with
its own reshape by the full head count, a SwiGLU MLP, ``nnx.Linear``
everywhere) goes through ``jaxpar.parallel.from_nnx(..., tensor_rules=...)``:
its kernels are split over ``tensor`` by regexes and XLA partitions the
block as written (``jax.sharding.auto_axes``). The baseline is jaxpar's
hand-written Megatron GPT block (``jaxpar.models.gpt.stage_fn`` inside
``jax.shard_map``), the minimal-communication path: one all-reduce after
attention and one after the MLP in the forward. Rows count the collectives
of one block's compiled forward and of its forward + input backward (the
pipeline's ``F`` and ``I``), and check the rule-split block against the same
block on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import hlo
from jaxpar import tensor_parallel as tp
from jaxpar.models import gpt

RULES = {r'attn/w[qkv]/kernel': (None, 'tensor'),
         r'attn/wo/kernel': ('tensor', None),
         r'mlp/w_(gate|up)/kernel': (None, 'tensor'),
         r'mlp/w_down/kernel': ('tensor', None)}


class _Attention(nnx.Module):

  def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
    self.heads = heads
    linear = lambda: nnx.Linear(d, d, use_bias=False, rngs=rngs)
    self.wq, self.wk, self.wv, self.wo = linear(), linear(), linear(), linear()

  def __call__(self, x):
    b, s, d = x.shape
    split = lambda t: t.reshape(b, s, self.heads, d // self.heads)
    out = jax.nn.dot_product_attention(split(self.wq(x)), split(self.wk(x)),
                                       split(self.wv(x)), is_causal=True)
    return self.wo(out.reshape(b, s, d))


class _MLP(nnx.Module):

  def __init__(self, d: int, rngs: nnx.Rngs):
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
    self.w_gate, self.w_up, self.w_down = (linear(d, 4 * d), linear(d, 4 * d),
                                           linear(4 * d, d))

  def __call__(self, x):
    return self.w_down(jax.nn.silu(self.w_gate(x)) * self.w_up(x))


class _Block(nnx.Module):

  def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
    self.attn_norm, self.mlp_norm = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(
        d, rngs=rngs)
    self.attn, self.mlp = _Attention(d, heads, rngs), _MLP(d, rngs)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class _Model(nnx.Module):

  def __init__(self, vocab: int, d: int, heads: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.blocks = nnx.List([_Block(d, heads, rngs)])
    self.head = nnx.Linear(d, vocab, rngs=rngs)


def _counts(compiled) -> str:
  short = {'all-reduce': 'AR', 'all-gather': 'AG', 'reduce-scatter': 'RS',
           'collective-permute': 'CP', 'all-to-all': 'A2A'}
  counts = hlo.collective_counts(compiled)
  return ' '.join(f'{v}{short[k]}' for k, v in counts.items() if v) or '-'


def _modes(stage_fn):
  """The block's forward, and its forward + input backward."""
  return {'forward': stage_fn,
          'forward+input backward': lambda p, x: jax.grad(
              lambda x: jnp.sum(stage_fn(p, x) ** 2))(x)}


def run(*, quick: bool) -> dict[str, list[dict]]:
  n = 2
  mesh = jaxpar.make_mesh(tensor=n, devices=jax.devices()[:n])
  d, heads, tokens = (32, 4, 16) if quick else (256, 8, 128)
  x = jax.random.normal(jax.random.key(0), (2, tokens, d))
  model = _Model(64, d, heads, nnx.Rngs(0))
  pm = jaxpar.parallel.from_nnx(
      model, blocks='blocks', num_stages=1, embed=lambda m, ids: m.embed(ids),
      head_loss=lambda m, y, t: jnp.mean((m.head(y) - t) ** 2),
      tensor_rules=RULES)
  stage = jax.tree.map(lambda a: a[0], pm.params.stages)
  specs = pm.tensor_specs(pm.params._replace(stages=stage), n).stages
  placed = jax.device_put(stage, jax.tree.map(
      lambda s: NamedSharding(mesh, s), specs,
      is_leaf=lambda s: isinstance(s, P)))
  config = gpt.GPTConfig(vocab_size=64, seq_len=tokens, d_model=d,
                         num_heads=heads, num_layers=1)
  pp, _ = gpt.split_for_pipeline(
      gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0))), num_stages=1)
  megatron = jax.tree.map(lambda a: a[0], pp.stages)
  megatron_specs = tp.param_specs(megatron, rules=gpt.TENSOR_RULES)
  rows = []
  for (mode, rules_fn), megatron_fn in zip(
      _modes(pm.functions[1]).items(), _modes(gpt.stage_fn).values()):
    split = jax.jit(jax.sharding.auto_axes(rules_fn, axes='tensor',
                                           out_sharding=P()))
    with jax.set_mesh(mesh):
      compiled = split.lower(placed, x).compile()
      got = split(placed, x)
    np.testing.assert_allclose(got, jax.jit(rules_fn)(stage, x),
                               rtol=1e-4, atol=1e-4)   # == one device
    by_hand = jax.jit(jax.shard_map(megatron_fn, mesh=mesh,
                                    in_specs=(megatron_specs, P()),
                                    out_specs=P()))
    rows.append({
        'tensor': n, 'd_model': d, 'heads': heads, 'tokens': tokens,
        'mode': mode, 'from_nnx_rules': _counts(compiled),
        'megatron_layers': _counts(by_hand.lower(
            tp.shard_params(megatron, mesh=mesh, rules=gpt.TENSOR_RULES),
            x).compile())})
  return {'tensor_rules_vs_megatron': rows}
