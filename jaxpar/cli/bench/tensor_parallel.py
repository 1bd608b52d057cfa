"""Section ``tensor_parallel_vs_gspmd``: Megatron MLP block vs jit + GSPMD.

The block is ``y = x + mlp(layer_norm(x))`` with a GELU MLP ``d -> 4d -> d``
on all devices as one ``tensor`` axis. jaxpar's version runs
``tensor_parallel.parallel_mlp`` inside ``jax.shard_map`` (explicit psum, or
with sequence parallelism all-gather + reduce-scatter); the baseline is the
dense block under plain ``jax.jit`` on the same devices, with the same
``NamedSharding`` annotations on params and activations and XLA's GSPMD
partitioner choosing the collectives. Rows time the forward pass and the
forward + backward (``value_and_grad`` w.r.t. params and input), and list the
collectives each compiled program runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import hlo
from jaxpar import tensor_parallel as tp
from jaxpar.cli.bench._timing import median_seconds
from jaxpar.models import mlp


def _params(d: int, f: int) -> dict:
  k1, k2 = jax.random.split(jax.random.key(0))
  return {'ln': {'scale': jnp.ones(d), 'bias': jnp.zeros(d)},
          'fc_in': {'kernel': jax.random.normal(k1, (d, f)) / d**0.5,
                    'bias': jnp.zeros(f)},
          'fc_out': {'kernel': jax.random.normal(k2, (f, d)) / f**0.5,
                     'bias': jnp.zeros(d)}}


def _tp_block(params, x, *, sequence_parallel):
  return x + tp.parallel_mlp(params, tp.layer_norm(params['ln'], x),
                             sequence_parallel=sequence_parallel)


def _dense_block(params, x):
  h = tp.layer_norm(params['ln'], x)
  h = jax.nn.gelu(h @ params['fc_in']['kernel'] + params['fc_in']['bias'])
  return x + h @ params['fc_out']['kernel'] + params['fc_out']['bias']


def _train(block, *, sum_over_tensor: bool = False):
  """Forward + backward: loss and grads w.r.t. params and the input.

  ``sum_over_tensor``: the block returns sequence shards, whose local losses
  are summed over the axis.
  """
  def loss(p, x):
    local = jnp.sum(block(p, x) ** 2)
    return jax.lax.psum(local, 'tensor') if sum_over_tensor else local
  return jax.value_and_grad(loss, (0, 1))


def run(*, quick: bool) -> dict[str, list[dict]]:
  n = jax.device_count()
  mesh = jaxpar.make_mesh(tensor=n)
  # GSPMD propagates shardings only through Auto axes: same devices and names.
  auto_mesh = mesh.update(axis_types=(AxisType.Auto,) * len(mesh.axis_names))
  sizes = [(256, 256)] if quick else [(256, 512), (1024, 2048)]
  rows = []
  for d, tokens in sizes:
    params = _params(d, 4 * d)
    specs = tp.param_specs(params, rules=mlp.TENSOR_RULES)
    x = jax.random.normal(jax.random.key(1), (tokens, d))
    for sequence_parallel in (False, True):
      x_spec = P('tensor', None) if sequence_parallel else P()
      tp_fwd = jax.shard_map(
          functools.partial(_tp_block, sequence_parallel=sequence_parallel),
          mesh=mesh, in_specs=(specs, x_spec), out_specs=x_spec)
      tp_args = (tp.shard_params(params, mesh=mesh, rules=mlp.TENSOR_RULES),
                 jax.device_put(x, NamedSharding(mesh, x_spec)))
      shard = lambda s: NamedSharding(auto_mesh, s)
      gspmd_args = (jax.device_put(params, jax.tree.map(shard, specs)),
                    jax.device_put(x, shard(x_spec)))
      for mode in ('forward', 'forward+backward'):
        if mode == 'forward':
          tp_fn = jax.jit(tp_fwd)
          gspmd_fn = jax.jit(_dense_block, out_shardings=shard(x_spec))
        else:
          tp_specs = (P(), (specs, x_spec))
          tp_fn = jax.jit(jax.shard_map(
              _train(functools.partial(_tp_block,
                                       sequence_parallel=sequence_parallel),
                     sum_over_tensor=sequence_parallel),
              mesh=mesh, in_specs=(specs, x_spec), out_specs=tp_specs))
          gspmd_fn = jax.jit(_train(_dense_block), out_shardings=(
              shard(P()), (jax.tree.map(shard, specs), shard(x_spec))))
        # Same numbers before timing them.
        np.testing.assert_allclose(
            np.asarray(jax.tree.leaves(tp_fn(*tp_args))[0]),
            np.asarray(jax.tree.leaves(gspmd_fn(*gspmd_args))[0]),
            rtol=1e-4, atol=1e-4)
        tp_s = median_seconds(tp_fn, *tp_args)
        gspmd_s = median_seconds(gspmd_fn, *gspmd_args)
        tp_counts = hlo.collective_counts(tp_fn.lower(*tp_args).compile())
        gspmd_counts = hlo.collective_counts(
            gspmd_fn.lower(*gspmd_args).compile())
        short = {'all-reduce': 'AR', 'all-gather': 'AG',
                 'reduce-scatter': 'RS', 'collective-permute': 'CP',
                 'all-to-all': 'A2A'}
        fmt = lambda c: ' '.join(f'{v}{short[k]}' for k, v in c.items() if v)
        rows.append({
            'tensor': n, 'd_model': d, 'd_ff': 4 * d, 'tokens': tokens,
            'sequence_parallel': sequence_parallel, 'mode': mode,
            'jaxpar_tp_ms': 1e3 * tp_s, 'gspmd_ms': 1e3 * gspmd_s,
            'ratio': tp_s / gspmd_s, 'tp_collectives': fmt(tp_counts) or '-',
            'gspmd_collectives': fmt(gspmd_counts) or '-'})
  return {'tensor_parallel_vs_gspmd': rows}
