"""A Llama-style model as a user writes it: plain Flax NNX, nothing of jaxpar.

RMSNorm, rotary position embeddings, SwiGLU, ``nnx.Linear`` layers and its
own reshape by the head count. ``Llama`` keeps its blocks in an
``nnx.List``; ``ScannedLlama`` keeps them as one module whose params are
stacked over layers (``nnx.vmap``) and runs them with ``nnx.scan``.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class Config(NamedTuple):
  vocab: int = 32
  dim: int = 16
  heads: int = 4
  hidden: int = 32
  layers: int = 3
  dtype: Any = jnp.float32     # of the params (and so of the compute)
  annotate: bool = False       # Megatron-style 'tensor' sharding annotations


def linear(c: Config, n_in: int, n_out: int, spec: tuple, rngs: nnx.Rngs):
  """``nnx.Linear`` without bias; with ``c.annotate`` its kernel carries the
  Flax sharding annotation ``spec`` (``nnx.with_partitioning``)."""
  init = nnx.initializers.lecun_normal()
  return nnx.Linear(n_in, n_out, use_bias=False, param_dtype=c.dtype,
                    kernel_init=nnx.with_partitioning(init, spec)
                    if c.annotate else init, rngs=rngs)


def rope(x):
  """Rotary position embedding of ``x [b, s, heads, head_dim]``."""
  s, d = x.shape[1], x.shape[-1]
  freq = 1.0 / 10000 ** (jnp.arange(0, d, 2, dtype=x.dtype) / d)
  angle = jnp.arange(s, dtype=x.dtype)[:, None] * freq       # [s, d/2]
  cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
  x1, x2 = x[..., ::2], x[..., 1::2]
  return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos],
                   -1).reshape(x.shape)


class Attention(nnx.Module):

  def __init__(self, c: Config, rngs: nnx.Rngs):
    self.heads = c.heads
    column = lambda: linear(c, c.dim, c.dim, (None, 'tensor'), rngs)
    self.wq, self.wk, self.wv = column(), column(), column()
    self.wo = linear(c, c.dim, c.dim, ('tensor', None), rngs)

  def __call__(self, x):
    b, s, d = x.shape
    split = lambda t: t.reshape(b, s, self.heads, d // self.heads)
    q, k = rope(split(self.wq(x))), rope(split(self.wk(x)))
    v = split(self.wv(x))
    scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(d // self.heads)
    causal = jnp.tril(jnp.ones((s, s), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    out = jnp.einsum('bhqk,bkhd->bqhd', weights, v)
    return self.wo(out.reshape(b, s, d))


class MLP(nnx.Module):

  def __init__(self, c: Config, rngs: nnx.Rngs):
    self.w_gate = linear(c, c.dim, c.hidden, (None, 'tensor'), rngs)
    self.w_up = linear(c, c.dim, c.hidden, (None, 'tensor'), rngs)
    self.w_down = linear(c, c.hidden, c.dim, ('tensor', None), rngs)

  def __call__(self, x):
    return self.w_down(jax.nn.silu(self.w_gate(x)) * self.w_up(x))


class Block(nnx.Module):

  def __init__(self, c: Config, rngs: nnx.Rngs):
    self.attn_norm = nnx.RMSNorm(c.dim, param_dtype=c.dtype, rngs=rngs)
    self.attn = Attention(c, rngs)
    self.mlp_norm = nnx.RMSNorm(c.dim, param_dtype=c.dtype, rngs=rngs)
    self.mlp = MLP(c, rngs)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):

  def __init__(self, c: Config, rngs: nnx.Rngs):
    self.embed = nnx.Embed(c.vocab, c.dim, param_dtype=c.dtype, rngs=rngs)
    self.blocks = nnx.List([Block(c, rngs) for _ in range(c.layers)])
    self.final_norm = nnx.RMSNorm(c.dim, param_dtype=c.dtype, rngs=rngs)
    self.head = nnx.Linear(c.dim, c.vocab, use_bias=False,
                             param_dtype=c.dtype, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    for block in self.blocks:
      x = block(x)
    return self.head(self.final_norm(x))


class ScannedLlama(nnx.Module):
  """The same model with its blocks stacked over layers."""

  def __init__(self, c: Config, rngs: nnx.Rngs):
    self.embed = nnx.Embed(c.vocab, c.dim, param_dtype=c.dtype, rngs=rngs)
    make = nnx.vmap(lambda r: Block(c, r), in_axes=0, out_axes=0)
    self.blocks = make(rngs.split(c.layers))
    self.final_norm = nnx.RMSNorm(c.dim, param_dtype=c.dtype, rngs=rngs)
    self.head = nnx.Linear(c.dim, c.vocab, use_bias=False,
                             param_dtype=c.dtype, rngs=rngs)

  def __call__(self, ids):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return block(x)
    return self.head(self.final_norm(run(self.embed(ids), self.blocks)))


def xent(logits, targets):
  return optax.losses.softmax_cross_entropy_with_integer_labels(
      logits, targets).mean()


def loss(model, ids, targets):
  """The user's loss: mean next-token cross-entropy."""
  return xent(model(ids), targets)
