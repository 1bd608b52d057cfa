"""A two-layer MLP in Flax NNX, and its tensor rules."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# How the params of ``MLP`` (``nnx.state(mlp, nnx.Param)``) split over the
# ``tensor`` axis for ``jaxpar.tensor_parallel.parallel_mlp``: regexes over
# the /-joined param paths -> the PartitionSpec entries of the trailing dims.
# fc_in by columns (kernel [in, out/N], bias [out/N]), fc_out by rows (kernel
# [in/N, out]; its bias is replicated).
TENSOR_RULES = {
    r'fc_in/(kernel|bias)': ('tensor',),
    r'fc_out/kernel': ('tensor', None),
}


class MLP(nnx.Module):
  """``fc_out(gelu(fc_in(x)))``, ``[..., features] -> [..., features]``.

  Dense on one device; its params (``nnx.state(mlp, nnx.Param)``) run
  tensor-parallel unchanged through ``jaxpar.tensor_parallel.parallel_mlp``,
  split by ``TENSOR_RULES`` (``fc_in`` column-, ``fc_out`` row-parallel),
  and it is the MLP of every ``jaxpar.models.gpt`` block.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxpar.models import MLP
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
