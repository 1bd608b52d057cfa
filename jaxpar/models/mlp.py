"""A two-layer MLP in Flax NNX with the layer names tensor parallelism expects."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
  """``fc_out(gelu(fc_in(x)))``, ``[..., features] -> [..., features]``.

  Dense on one device; its params (``nnx.state(mlp, nnx.Param)``) run
  tensor-parallel unchanged through ``jaxpar.tensor_parallel.parallel_mlp``
  (``fc_in`` column-, ``fc_out`` row-parallel), and it is the MLP of every
  ``jaxpar.models.gpt`` block.

  Example:
    >>> mlp = MLP(8, 32, rngs=nnx.Rngs(0))
    >>> mlp(jnp.ones((2, 8))).shape
    (2, 8)
  """

  def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs,
               param_dtype: Any = jnp.float32):
    self.fc_in = nnx.Linear(features, hidden, param_dtype=param_dtype,
                            rngs=rngs)
    self.fc_out = nnx.Linear(hidden, features, param_dtype=param_dtype,
                             rngs=rngs)

  def __call__(self, x):
    return self.fc_out(jax.nn.gelu(self.fc_in(x)))
