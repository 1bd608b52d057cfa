"""Pipeline executor: memory, compile time and CPU overhead against ``m``.

Sections:

* ``pipeline_memory``: compiled ``temp_size_in_bytes`` (the scratch memory
  of one device; arguments and outputs are reported apart) of a training step
  with a fixed microbatch size as the number of microbatches ``m`` grows:
  ``pipeline_step`` with 1F1B, interleaved 1F1B and ZB-H1 (flat in ``m``)
  against GPipe-by-autodiff, ``jax.value_and_grad`` through a ``lax.scan``
  over the pipeline iterations as MaxText and Praxis do (grows with ``m``).
* ``compile_time``: seconds to lower and compile the same steps.
* ``cpu_overhead``: median step time of ``pipeline_step`` on simulated CPU
  devices against the plain single-device ``jax.value_and_grad`` step of the
  same model and batch, measured in one process (ratio of medians).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.mesh import axis_size
from jaxpar.pipeline.executor import LossFn, StageFn


def gpipe_autodiff_step(stage_fn: StageFn, loss_fn: LossFn, *,
                        num_microbatches: int, mesh: Mesh,
                        axis: str = 'stage') -> Callable:
  """GPipe by autodiff: ``jax.value_and_grad`` through a forward ``lax.scan``.

  The MaxText/Praxis way: one stage per rank; iteration ``t`` of
  ``m + p - 1`` runs microbatch ``t - r`` on rank ``r`` and rotates the
  activations one rank on. Reverse-mode AD keeps the residuals of every
  iteration, so activation memory grows as ``O(m + p)``. A baseline for the
  benchmark and tests, not jaxpar API.

  Returns:
    jitted ``step(stage_params, loss_params, inputs, targets) -> (loss,
    (dstage_params, dloss_params, dinputs))`` with ``stage_params`` stacked
    ``[p, ...]``, the same maths as ``pipeline_step``.
  """
  p, m = axis_size(mesh, axis), num_microbatches

  def local_loss(params, loss_params, xs, ts):
    params = jax.tree.map(lambda a: a[0], params)
    rank = jax.lax.axis_index(axis)

    def iteration(carry, t):
      state, loss = carry
      x = jnp.where(rank == 0, xs[jnp.minimum(t, m - 1)], state)
      y = stage_fn(params, x)
      done = t - (p - 1)  # the microbatch leaving the last rank
      step_loss = loss_fn(loss_params, y, ts[jnp.clip(done, 0, m - 1)])
      loss = loss + jnp.where((rank == p - 1) & (done >= 0), step_loss, 0)
      state = jax.lax.ppermute(y, axis, [(r, (r + 1) % p) for r in range(p)])
      return (state, loss), None

    init = jax.lax.pcast((jnp.zeros_like(xs[0]), jnp.zeros((), xs.dtype)),
                         axis, to='varying')
    (_, loss), _ = jax.lax.scan(iteration, init, jnp.arange(m + p - 1))
    return jax.lax.psum(loss, axis) / m

  sharded = jax.shard_map(local_loss, mesh=mesh,
                          in_specs=(P(axis), P(), P(), P()), out_specs=P(),
                          axis_names={axis})

  @jax.jit
  def step(stage_params, loss_params, inputs, targets):
    split = lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:])
    loss, (ds, dl, dx) = jax.value_and_grad(sharded, argnums=(0, 1, 2))(
        stage_params, loss_params, split(inputs), split(targets))
    return loss, (ds, dl, dx.reshape(inputs.shape))
  return step
