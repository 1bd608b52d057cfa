"""Tensor (Megatron) parallelism: layers sharded over the ``tensor`` mesh axis.

Three parts, one module each:

* ``layers``, ``attention``, ``vocab``: pure functions that run *inside*
  ``jax.shard_map`` on the local shards of their parameters, with the
  minimum communication (one all-reduce per MLP or attention forward; with
  sequence parallelism an all-gather + a reduce-scatter instead) and exact
  gradients through ``shard_map``'s ``check_vma`` types;
* tensor rules: dense parameter pytrees -> ``PartitionSpec`` trees, by
  regexes over ``/``-joined param paths (``rules=``, e.g.
  ``jaxpar.models.gpt.TENSOR_RULES``) or, by default, the params' Flax
  sharding metadata (``nnx.with_partitioning``); placed on a mesh and back
  (``param_specs``, ``shard_params``, ``unshard_params``; ``match_rules``
  is the matcher);
* ``modules``: the layers as Flax NNX modules, their params marked with
  Flax sharding metadata.

Example:
  >>> import jax, jax.numpy as jnp, jaxpar
  >>> from flax import nnx
  >>> from jax.sharding import PartitionSpec as P
  >>> tp = jaxpar.tensor_parallel
  >>> dense = jaxpar.models.MLP(16, 64, rngs=nnx.Rngs(0))
  >>> params = nnx.to_pure_dict(nnx.state(dense, nnx.Param))
  >>> rules = jaxpar.models.mlp.TENSOR_RULES     # fc_in columns, fc_out rows
  >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
  >>> mlp = jax.shard_map(tp.parallel_mlp, mesh=mesh,
  ...                     in_specs=(tp.param_specs(params, rules=rules), P()),
  ...                     out_specs=P())
  >>> x = jnp.ones((2, 16))
  >>> y = jax.jit(mlp)(tp.shard_params(params, mesh=mesh, rules=rules), x)
  >>> bool(jnp.allclose(y, dense(x), atol=1e-6))      # == the dense MLP
  True
"""

from jaxpar.tensor_parallel._attention import (
    dot_product_attention as dot_product_attention)
from jaxpar.tensor_parallel._attention import (
    parallel_self_attention as parallel_self_attention)
from jaxpar.tensor_parallel._attention import (
    transformer_block as transformer_block)
from jaxpar.tensor_parallel._layers import (
    column_parallel_linear as column_parallel_linear)
from jaxpar.tensor_parallel._layers import dropout as dropout
from jaxpar.tensor_parallel._layers import layer_norm as layer_norm
from jaxpar.tensor_parallel._layers import parallel_mlp as parallel_mlp
from jaxpar.tensor_parallel._layers import (
    row_parallel_linear as row_parallel_linear)
from jaxpar.tensor_parallel._rules import RuleMatch as RuleMatch
from jaxpar.tensor_parallel._rules import match_rules as match_rules
from jaxpar.tensor_parallel._rules import param_specs as param_specs
from jaxpar.tensor_parallel._rules import shard_params as shard_params
from jaxpar.tensor_parallel._rules import unshard_params as unshard_params
from jaxpar.tensor_parallel._modules import (
    ColumnParallelLinear as ColumnParallelLinear)
from jaxpar.tensor_parallel._modules import ParallelMLP as ParallelMLP
from jaxpar.tensor_parallel._modules import (
    ParallelSelfAttention as ParallelSelfAttention)
from jaxpar.tensor_parallel._modules import (
    RowParallelLinear as RowParallelLinear)
from jaxpar.tensor_parallel._vocab import (
    vocab_parallel_cross_entropy as vocab_parallel_cross_entropy)
from jaxpar.tensor_parallel._vocab import (
    vocab_parallel_embed as vocab_parallel_embed)

__all__ = [
    'ColumnParallelLinear', 'ParallelMLP', 'ParallelSelfAttention',
    'RowParallelLinear', 'RuleMatch',
    'column_parallel_linear', 'dot_product_attention', 'dropout',
    'layer_norm', 'match_rules', 'param_specs', 'parallel_mlp',
    'parallel_self_attention',
    'row_parallel_linear', 'shard_params', 'transformer_block',
    'unshard_params', 'vocab_parallel_cross_entropy', 'vocab_parallel_embed',
]
