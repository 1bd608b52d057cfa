"""The pipeline executor: any ``Schedule``'s tick table as one SPMD program.

``pipeline_value_and_grad`` computes the loss and
gradients of a pipelined model, ``pipeline_apply`` its forward pass. Both
are one ``jax.shard_map`` over the pipeline axis around one ``lax.scan``
over the ticks of the schedule's ``TickTable`` (``_tick_scan``, whose
docstring describes a tick; ``docs/executor.md`` draws one). Each rank holds
``num_stash_slots`` stashes (activations, never parameters),
``num_weight_slots`` weight stashes and ``num_mailbox_slots + 1``
activations: ``O(p)`` for 1F1B whatever the number of microbatches ``m``.

``pipeline_value_and_grad_local`` / ``pipeline_apply_local`` are the same executor as a
function that runs *inside* a caller's ``shard_map``, so ``stage_fn`` may use
collectives over other mesh axes (tensor parallelism) and the batch may be
sharded over a data axis.

Options of the training steps: ``key`` (randomness such as dropout: one key
per stage and global microbatch, the same in its forward and backward),
``has_aux`` (``loss_fn`` returns ``(loss, aux)``), ``compute_dtype``
(e.g. bfloat16 compute on float32 params), ``stage_state`` (model state
that is not a parameter, e.g. BatchNorm's running statistics, passed from
each microbatch to the next as on one device) and ``input_grads=False``
(no input cotangent).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import vma
from jaxpar.pipeline.executor import _tick_scan
from jaxpar.pipeline.executor._checks import (
    check_axis, check_bool, check_fill, check_float, check_fn, check_leading,
    check_loss_fn, check_offset, check_schedule, check_stage_fn,
    check_state_order, check_table)
from jaxpar.pipeline.executor._microbatches import microbatched, with_key
from jaxpar.pipeline.executor._placement import ranks_to_stages, stages_to_ranks
from jaxpar.pipeline.executor._stage_vjp import stash_policy
from jaxpar.pipeline.executor._tick_state import LossFn, StageFn
from jaxpar.pipeline.executor._vma import full
from jaxpar.pipeline.schedules import Schedule, TickTable, tick_table
from jaxpar.train_state import cast_params, check_compute_dtype, check_key

PyTree = Any


class PipelineGrads(NamedTuple):
  """Gradients of the mean batch loss from ``pipeline_value_and_grad``.

  Attributes:
    stages: like ``stage_params``, stacked ``[num_stages, ...]`` in model order.
    head: like ``loss_params``: the gradient of the head, the parameters
      ``loss_fn`` takes after the last stage.
    inputs: like ``inputs``, ``[batch, ...]``: for a layer in front of the
      pipeline, chain it with that layer's VJP (``None`` when the step runs
      that layer itself, as ``embed_fn``, or with ``input_grads=False``).
    embed: like ``embed_params`` of ``pipeline_value_and_grad_local``'s ``embed_fn``
      (``None`` without one).
  """
  stages: PyTree
  head: PyTree
  inputs: jax.Array | None
  embed: PyTree = None


# ---------------------------------------------------------------- public


def pipeline_value_and_grad_local(
    stage_fn: StageFn, loss_fn: LossFn, local_params: PyTree,
    loss_params: PyTree, inputs: jax.Array, targets: PyTree, *,
    table: TickTable, axis: str = 'stage',
    bubble_fill: float = 0.0, key: jax.Array | None = None,
    microbatch_offset: Any = 0, has_aux: bool = False,
    compute_dtype: Any = None, embed_fn: Callable[..., jax.Array] | None = None,
    embed_params: PyTree = None, embed_key: jax.Array | None = None,
    remat_policy: Any = None, stage_state: PyTree = None,
    input_grads: bool = True
) -> tuple[Any, PipelineGrads] | tuple[Any, PipelineGrads, PyTree]:
  """One rank's share of ``pipeline_value_and_grad``; call it inside ``jax.shard_map``.

  For composing pipeline parallelism with other axes: the caller's
  ``shard_map`` spans ``axis`` and maybe others; ``stage_fn`` may use
  collectives over the other axes (all devices of a group sit on the same
  pipeline rank and run the same blocks). ``stage_fn`` and ``loss_fn`` run
  as on one device over ``axis`` (``jaxpar.vma.lift``); over a batch axis
  of the caller's, lift them too: ``vma.lift(fn, axes=('data',))``.

  Args:
    stage_fn: ``stage_fn(one_stage_params, x) -> y``, ``y`` like ``x``;
      ``stage_fn(one_stage_params, x, key)`` when ``key`` is given; with
      ``stage_state`` it takes the stage's state last and returns ``(y,
      new_state)``: ``stage_fn(one_stage_params, x, [key,] state)``.
    loss_fn: ``loss_fn(loss_params, y, target) -> scalar``, the mean loss of
      one microbatch, run after the last stage (``(scalar, aux)`` with
      ``has_aux``; a trailing ``key`` argument when ``key`` is given).
    local_params: this rank's stages, leading axis ``v`` in the order of
      ``stages_to_ranks`` (``stages_to_ranks(params, schedule)[rank]``).
    loss_params: the loss parameters (replicated over ``axis``).
    inputs: ``[batch, ...]`` (this shard's batch, the same on every rank of
      ``axis``), split into ``m`` microbatches.
    targets: pytree of ``[batch, ...]`` leaves.
    table: ``tick_table(schedule)``.
    axis: the pipeline axis, of size ``schedule.num_ranks``.
    bubble_fill: value of unwritten buffer slots and of whatever idle ranks
      send; ``float('nan')`` checks that bubbles never reach the results.
    key: the step's PRNG key, or ``None``. Stage ``k`` on microbatch ``i``
      gets ``fold_in(fold_in(key, microbatch_offset + i), k)``, the loss
      ``k = num_stages``: its forward, backward and recompute see one key.
    microbatch_offset: global index of this shard's first microbatch (with a
      batch sharded over a data axis: ``axis_index(data) * m``), so that the
      keys follow the batch rows, not the mesh.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` (float leaves) is
      averaged over the microbatches like the loss.
    compute_dtype: e.g. ``jnp.bfloat16``: the stages and the loss run on
      params cast to it (inside the stage, so the stash never holds a cast
      copy of them) and on inputs cast to it; activations, stashes and
      messages are in it. Loss, aux and gradients stay in their dtypes
      (float32). ``None``: the dtypes given.
    embed_fn: ``embed_fn(embed_params, raw) -> x``, a layer in front of the
      stages (an embedding) run per microbatch inside stage 0: its ``F``
      embeds the microbatch's rows of ``inputs`` (raw, e.g. integer token
      ids), its ``W`` adds the layer's VJP to ``PipelineGrads.embed``. No
      batch-sized activation or cotangent is held; ``PipelineGrads.inputs``
      is then ``None``. ``None``: ``inputs`` is stage 0's input.
    embed_params: ``embed_fn``'s params (replicated over ``axis``).
    embed_key: with ``embed_fn``, microbatch ``i``'s embedding runs as
      ``embed_fn(embed_params, raw, fold_in(embed_key, microbatch_offset +
      i))``; ``None``: without a key.
    remat_policy: what the forward stashes for the backward
      (``jaxpar.pipeline.stash_policy``): ``'dots'`` (default:
      matrix products kept, elementwise work recomputed), ``'everything'``,
      ``'dots_no_batch'``, ``'nothing'`` or a ``jax.checkpoint_policies``
      policy.
    stage_state: model state that is not a parameter (BatchNorm running
      statistics, counters), like ``local_params`` this rank's ``[v, ...]``
      in the order of ``stages_to_ranks``; ``None``: stateless stages. Each
      stage runs its microbatches in order (every built-in schedule does;
      another is a ``ValueError``) and passes its state from each
      microbatch's ``F`` to the next, as one device running the microbatches
      in turn does; a microbatch's backward sees the state of its forward.
      The state is not differentiated; ``new_state`` must keep its
      structure, shapes and dtypes.
    input_grads: ``False`` skips the input cotangent (``PipelineGrads.
      inputs`` is ``None``): no batch-sized buffer and no collective for it.

  Returns:
    ``(loss, PipelineGrads(stages, head, inputs, embed))`` (``((loss, aux),
    ...)`` with ``has_aux``), and with ``stage_state`` the state after the
    last microbatch as a third result, ``[v, ...]`` like ``stage_state``:
    the mean loss over this shard's batch and its
    gradients; ``stages`` (and the state) is this rank's ``[v, ...]``
    (varying over ``axis``), the rest is reduced over ``axis``. Nothing is reduced over
    other axes: with a batch sharded ``n`` ways over a data axis, ``pmean``
    the loss and the parameter gradients over it and divide ``inputs`` (this
    shard's cotangent) by ``n``; the state is this shard's (its statistics
    are of this shard's microbatches: combine it over the data axis as the
    model's rule says). With one rank (``num_ranks == 1``) there
    are no ticks: the microbatches run in turn (``lax.scan`` of
    ``value_and_grad``), as data parallelism runs them.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> stage_fn = lambda w, x: jnp.tanh(x @ w)
    >>> loss_fn = lambda scale, y, t: jnp.mean((scale * y - t) ** 2)
    >>> low = jaxpar.pipeline.tick_table(jaxpar.pipeline.one_f_one_b(4, 8))
    >>> def body(w, scale, x, t):   # one rank's view
    ...   loss, g = jaxpar.pipeline.pipeline_value_and_grad_local(
    ...       stage_fn, loss_fn, w[0], scale, x, t, table=low)
    ...   return loss, g.stages[None]
    >>> step = jax.jit(jax.shard_map(
    ...     body, mesh=jaxpar.make_mesh(stage=4, data=2), axis_names={'stage'},
    ...     in_specs=(P('stage'), P(), P(), P()), out_specs=(P(), P('stage'))))
    >>> w = np.full((4, 1, 16, 16), 1 / 16, np.float32)   # [p, v, ...]
    >>> loss, dw = step(w, 2.0, np.ones((32, 16)), np.zeros((32, 16)))
    >>> dw.shape
    (4, 1, 16, 16)
  """
  table = check_table(table)
  check_fn(stage_fn, 'stage_fn')
  check_fn(loss_fn, 'loss_fn')
  if not table.training:
    raise ValueError(f'table, the tick table of schedule '
                     f'{table.schedule.name!r}, has no backward actions '
                     '(forward_only=True); use pipeline_apply_local, or pass '
                     'tick_table(schedule).')
  schedule = table.schedule
  check_axis(axis, schedule)
  embedding = embed_fn is not None
  if embedding:
    check_fn(embed_fn, 'embed_fn')
    check_key(embed_key)
  checked = [(local_params, 'local_params'), (loss_params, 'loss_params'),
             (embed_params, 'embed_params') if embedding else (inputs,
                                                               'inputs')]
  for tree, name in checked:
    check_float(tree, name)
  check_leading(local_params, schedule.num_stages // schedule.num_ranks,
                'local_params', 'num_stages // num_ranks')
  if stage_state is not None:
    check_leading(stage_state, schedule.num_stages // schedule.num_ranks,
                  'stage_state', 'num_stages // num_ranks')
    check_state_order(table)
  check_bool(input_grads, 'input_grads')
  check_key(key)
  check_offset(microbatch_offset)
  stash_policy(remat_policy)
  dtype = check_compute_dtype(compute_dtype)
  # The user's functions as on one device over `axis` (jaxpar.vma); a caller
  # that also splits the batch lifts them over its axis (parallel.trainer).
  stage_fn, loss_fn = (vma.lift(stage_fn, axes=(axis,)),
                       vma.lift(loss_fn, axes=(axis,)))
  if dtype is not None:
    stage_fn, loss_fn = cast_params(stage_fn, dtype), cast_params(
        loss_fn, dtype)
    if embedding:
      embed_fn = cast_params(lambda *a, fn=embed_fn: fn(*a).astype(dtype),
                             dtype)
    else:
      inputs_dtype = jnp.result_type(inputs)
      inputs = jnp.asarray(inputs, dtype)
  xs, ts = microbatched(inputs, targets, schedule.num_microbatches)
  x = xs[0]
  if embedding:
    x = jax.eval_shape(embed_fn, embed_params, xs[0], *with_key(embed_key))
    check_float(x, 'embed_fn(embed_params, inputs)')
    # A value, not its aval: under a shard_map manual over some axes only,
    # eval_shape rejects avals that carry manual-axis types.
    x = full(x, 0)
  check_stage_fn(stage_fn, local_params, x, key, stage_state)
  check_loss_fn(loss_fn, loss_params, x, jax.tree.map(lambda t: t[0], ts),
                key, has_aux)
  res = _tick_scan.run(
      stage_fn, loss_fn, table, local_params, loss_params, xs, ts,
      axis=axis, bubble_fill=check_fill(bubble_fill),
      key=key, offset=microbatch_offset, has_aux=has_aux, embed_fn=embed_fn,
      embed_params=embed_params, embed_key=embed_key, remat_policy=remat_policy,
      stage_state=stage_state, input_grads=input_grads)
  dx = res.inputs
  if dx is not None:
    dx = dx.reshape(np.shape(inputs))
    if dtype is not None:
      dx = dx.astype(inputs_dtype)
  out = ((res.value if has_aux else res.value[0]),
         PipelineGrads(res.stages, res.head, dx, res.embed))
  return out if stage_state is None else out + (res.state,)


def pipeline_apply_local(
    stage_fn: StageFn, local_params: PyTree, inputs: jax.Array, *,
    table: TickTable, axis: str = 'stage',
    bubble_fill: float = 0.0) -> jax.Array:
  """One rank's share of ``pipeline_apply``; call it inside ``jax.shard_map``.

  Args are those of ``pipeline_value_and_grad_local``; ``table`` must be
  forward-only (``tick_table(schedule, forward_only=True)``).

  Returns:
    ``[batch, ...]``, the last stage's outputs, reduced over ``axis``.
  """
  table = check_table(table)
  check_fn(stage_fn, 'stage_fn')
  if table.training:
    raise ValueError(f'table, the tick table of schedule '
                     f'{table.schedule.name!r}, has backward actions; pass '
                     'tick_table(schedule, forward_only=True) to '
                     'pipeline_apply_local.')
  schedule = table.schedule
  check_axis(axis, schedule)
  check_leading(local_params, schedule.num_stages // schedule.num_ranks,
                'local_params', 'num_stages // num_ranks')
  stage_fn = vma.lift(stage_fn, axes=(axis,))
  xs, _ = microbatched(inputs, (), schedule.num_microbatches)
  check_stage_fn(stage_fn, local_params, jax.typeof(xs[0]))
  out = _tick_scan.run(stage_fn, None, table, local_params, (), xs, (),
                       axis=axis,
                       bubble_fill=check_fill(bubble_fill))
  return out.reshape(np.shape(inputs))


def pipeline_value_and_grad(
    stage_fn: StageFn, loss_fn: LossFn, *, schedule: Schedule, mesh: Mesh,
    axis: str = 'stage', bubble_fill: float = 0.0,
    has_aux: bool = False, compute_dtype: Any = None, remat_policy: Any = None,
    input_grads: bool = True) -> Callable[..., tuple]:
  """A jitted pipelined step: the loss and gradients of the batch mean.

  Like ``jax.value_and_grad`` of the sequential model (no optimizer: plug
  the gradients into optax, or use ``jaxpar.parallel.trainer``).

  The batch is split into ``m = schedule.num_microbatches`` equal
  microbatches that flow through ``S = schedule.num_stages`` logical stages
  placed on the ``p`` ranks of ``mesh.shape[axis]`` as the schedule says.
  The result equals ``jax.value_and_grad`` of the sequential model::

    loss = mean_i loss_fn(loss_params, stage_{S-1}(... stage_0(x_i)), t_i)

  With a ``key`` (dropout), stage ``k`` runs as ``stage_fn(params_k, x,
  k_ik)`` with ``k_ik = fold_in(fold_in(key, i), k)`` and the loss gets
  ``k_iS``: the same masks in the forward, the backward and a recompute, and
  the same result for every schedule of ``S`` stages.

  Model state that is not a parameter (BatchNorm running statistics) is
  passed as ``step(..., stage_state=state)``: each stage then runs as
  ``stage_fn(params_k, x, [k_ik,] state_k) -> (y, new_state_k)`` on
  microbatches ``0, 1, ..., m - 1`` in turn, as one device does (see
  ``pipeline_value_and_grad_local``).

  Memory per rank: the parameters, the batch and its gradient, plus
  ``tick_table(schedule).num_stash_slots`` stashes (VJP residuals without the
  parameters; the stage input with ``remat_policy='nothing'``) and ``num_mailbox_slots``
  activations, independent of ``m`` for 1F1B, interleaved and zero-bubble.
  When the placement is not one stage per rank in order (interleaved, V),
  the model-order stage parameters and gradients are permuted to and from
  the rank placement every step, which gathers them on every device; for
  large models keep them placed (``stages_to_ranks``) and call
  ``pipeline_value_and_grad_local`` in your own ``shard_map``.

  Args:
    stage_fn: ``stage_fn(one_stage_params, x) -> y`` with ``y`` of ``x``'s
      shape and dtype; ``x`` is one microbatch ``[batch/m, ...]``. Called
      as ``stage_fn(one_stage_params, x, key)`` when the step gets a key.
    loss_fn: ``loss_fn(loss_params, y, target) -> scalar``, the mean loss
      over one microbatch, applied to the last stage's output (``-> (scalar,
      aux)`` with ``has_aux``; a trailing ``key`` when the step gets one).
    schedule: a training ``Schedule`` (GPipe, 1F1B, interleaved, zero-bubble,
      or from CSV).
    mesh: a mesh with axis ``axis`` of size ``schedule.num_ranks``.
    axis: the pipeline axis name.
    remat_policy: the stash (``jaxpar.pipeline.stash_policy``):
      ``'dots'`` by default, ``'everything'``, ``'dots_no_batch'``,
      ``'nothing'`` or a ``jax.checkpoint_policies`` policy.
    bubble_fill: value of unwritten buffer slots and of what idle ranks send;
      ``float('nan')`` checks that bubbles never reach the results.
    has_aux: ``loss_fn`` returns ``(loss, aux)``, aux a pytree of floats
      averaged over microbatches like the loss.
    compute_dtype: e.g. ``jnp.bfloat16``: stages and loss compute on params
      and inputs cast to it, so activations, stashes and messages are in it;
      the loss, aux and all gradients keep their dtypes (float32).
    input_grads: ``False``: ``grads.inputs`` is ``None`` and is not
      computed (no batch-sized buffer, no collective for it); for callers
      with nothing in front of the pipeline to differentiate.

  Returns:
    ``step(stage_params, loss_params, inputs, targets, key=None,
    stage_state=None) -> (loss, PipelineGrads(stages, head, inputs))``
    (``((loss, aux), grads)`` with ``has_aux``; ``(loss, grads,
    new_state)`` with a ``stage_state``), jitted. ``stage_params`` is a
    pytree stacked ``[num_stages, ...]`` in model order, and so are
    ``stage_state`` and ``new_state``; ``inputs`` is ``[batch, ...]`` and
    ``targets`` a pytree of ``[batch, ...]`` leaves; ``key`` a PRNG key for
    the functions (``jax.random.key(seed)``; fold in the step number to
    draw new masks each step). Shapes are checked when ``step`` is traced,
    before compiling.

  Raises:
    TypeError / ValueError: for a non-callable function, a schedule that does
      not fit the mesh or does not train, a ``compute_dtype`` that is not a
      float dtype; when called, for a leading axis other than
      ``num_stages``, a batch not divisible by ``m``, targets of another
      batch size, a ``stage_fn`` that changes the shape, a ``loss_fn`` whose
      output is not a float scalar (or ``(scalar, floats)`` with
      ``has_aux``), or a ``key`` that is not one PRNG key.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxpar
    >>> stage_fn = lambda p, x: jnp.tanh(x @ p['w'] + p['b'])
    >>> loss_fn = lambda scale, y, t: jnp.mean((scale * y - t) ** 2)
    >>> step = jaxpar.pipeline.pipeline_value_and_grad(
    ...     stage_fn, loss_fn, mesh=jaxpar.make_mesh(stage=4, data=2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(4, 8))
    >>> params = {'w': np.full((4, 16, 16), 1 / 16, np.float32),
    ...           'b': np.zeros((4, 16), np.float32)}    # 4 stages
    >>> loss, grads = step(params, 2.0, np.ones((32, 16)), np.zeros((32, 16)))
    >>> grads.stages['w'].shape, grads.inputs.shape
    ((4, 16, 16), (32, 16))

    Dropout (a key), an auxiliary metric and bfloat16 compute:

    >>> def dropout_fn(p, x, key):
    ...   keep = jax.random.bernoulli(key, 0.9, x.shape)
    ...   return jnp.where(keep, stage_fn(p, x) / 0.9, 0)
    >>> def loss_and_mean(scale, y, t, key):
    ...   return loss_fn(scale, y, t), {'mean_y': jnp.mean(y).astype(float)}
    >>> step = jaxpar.pipeline.pipeline_value_and_grad(
    ...     dropout_fn, loss_and_mean, mesh=jaxpar.make_mesh(stage=4, data=2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(4, 8), has_aux=True,
    ...     compute_dtype=jnp.bfloat16)
    >>> (loss, aux), grads = step(params, 2.0, np.ones((32, 16)),
    ...                           np.zeros((32, 16)), key=jax.random.key(0))
    >>> loss.dtype, sorted(aux), grads.stages['w'].dtype
    (dtype('float32'), ['mean_y'], dtype('float32'))

    A stage with state (a running mean of its inputs, as BatchNorm keeps):

    >>> def norm_fn(p, x, mean):
    ...   y = stage_fn(p, x - jnp.mean(x, 0))
    ...   return y, 0.9 * mean + 0.1 * jnp.mean(x, 0)
    >>> step = jaxpar.pipeline.pipeline_value_and_grad(
    ...     norm_fn, loss_fn, mesh=jaxpar.make_mesh(stage=4, data=2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(4, 8), input_grads=False)
    >>> loss, grads, mean = step(params, 2.0, np.ones((32, 16)),
    ...                          np.zeros((32, 16)),
    ...                          stage_state=np.zeros((4, 16)))
    >>> mean.shape, grads.inputs is None
    ((4, 16), True)
  """
  check_fn(stage_fn, 'stage_fn')
  check_fn(loss_fn, 'loss_fn')
  check_schedule(schedule, mesh, axis)
  table = tick_table(schedule)
  bubble_fill = check_fill(bubble_fill)
  check_compute_dtype(compute_dtype)
  stash_policy(remat_policy)
  check_bool(input_grads, 'input_grads')
  first, stacked = (lambda tree: jax.tree.map(lambda a: a[0], tree),
                    lambda tree: jax.tree.map(lambda a: a[None], tree))

  def local(params, loss_params, inputs, targets, key, state):
    out, grads, *new_state = pipeline_value_and_grad_local(
        stage_fn, loss_fn, first(params), loss_params,
        inputs, targets, table=table, axis=axis,
        bubble_fill=bubble_fill, key=key, has_aux=has_aux,
        compute_dtype=compute_dtype, remat_policy=remat_policy,
        stage_state=first(state), input_grads=input_grads)
    return (out, grads._replace(stages=stacked(grads.stages)),
            stacked(new_state[0] if new_state else None))

  by_stage = NamedSharding(mesh, P(axis))
  to_ranks = lambda tree: jax.reshard(stages_to_ranks(
      tree, schedule, out_sharding=by_stage), by_stage)
  # Manual over every mesh axis (replicated over the others): XLA:CPU 0.10
  # aborts on a bfloat16 all-reduce in a partly manual shard_map.
  sharded = jax.shard_map(
      local, mesh=mesh, in_specs=(P(axis), P(), P(), P(), P(), P(axis)),
      out_specs=(P(), PipelineGrads(P(axis), P(), P()), P(axis)))

  @jax.jit
  def step(stage_params, loss_params, inputs, targets, key=None,
           stage_state=None):
    check_leading(stage_params, schedule.num_stages, 'stage_params',
                  'schedule.num_stages')
    if stage_state is not None:
      check_leading(stage_state, schedule.num_stages, 'stage_state',
                    'schedule.num_stages')
    check_key(key)
    # Replicated on every device (a no-op unless the caller sharded them).
    loss_params, inputs, targets, key = jax.reshard(
        (loss_params, inputs, targets, key), NamedSharding(mesh, P()))
    out, grads, new_state = sharded(
        to_ranks(stage_params), loss_params, inputs, targets, key,
        None if stage_state is None else to_ranks(stage_state))
    out = out, grads._replace(stages=ranks_to_stages(
        grads.stages, schedule, out_sharding=by_stage))
    if stage_state is None:
      return out
    return out + (ranks_to_stages(new_state, schedule,
                                  out_sharding=by_stage),)
  return step


@functools.partial(jax.jit, static_argnames=(
    'stage_fn', 'schedule', 'mesh', 'axis', 'bubble_fill'))
def _apply(stage_fn, stage_params, inputs, *, schedule, mesh, axis,
           bubble_fill):
  bubble_fill = float(bubble_fill)  # passed as a str: nan == nan for the cache
  check_schedule(schedule, mesh, axis)
  table = tick_table(schedule, forward_only=True)
  check_leading(stage_params, schedule.num_stages, 'stage_params',
                'schedule.num_stages')
  local = lambda params, x: pipeline_apply_local(
      stage_fn, jax.tree.map(lambda a: a[0], params), x, table=table,
      axis=axis, bubble_fill=bubble_fill)
  params = stages_to_ranks(stage_params, schedule,
                           out_sharding=NamedSharding(mesh, P(axis)))
  inputs = jax.reshard(inputs, NamedSharding(mesh, P()))
  return jax.shard_map(local, mesh=mesh, in_specs=(P(axis), P()),
                       out_specs=P(), axis_names={axis})(params, inputs)


def pipeline_apply(stage_fn: StageFn, stage_params: PyTree | None = None,
                   inputs: jax.Array | None = None, *, schedule: Schedule,
                   mesh: Mesh, axis: str = 'stage', bubble_fill: float = 0.0):
  """The pipelined forward pass (inference): all stages on every microbatch.

  Runs the ``F`` actions of ``schedule`` (any schedule; its backward actions
  are dropped) and computes ``stage_{S-1}(... stage_0(x))`` for the whole
  batch. Compiled once per ``(stage_fn, schedule, mesh, axis)`` and shapes.

  Args:
    stage_fn: ``stage_fn(one_stage_params, x) -> y``, ``y`` like ``x``.
    stage_params: pytree stacked ``[num_stages, ...]`` in model order; give it
      with ``inputs`` to run at once (the first call form).
    inputs: ``[batch, ...]`` with ``batch`` divisible by
      ``schedule.num_microbatches``.
    schedule: a ``Schedule`` whose ``num_ranks`` is ``mesh.shape[axis]``.
    mesh: the device mesh.
    axis: the pipeline axis name.
    bubble_fill: value of unwritten buffer slots and of what idle ranks send.

  Returns:
    Without ``stage_params`` and ``inputs``: ``apply(stage_params, inputs) ->
    [batch, ...]``, like every other step; with them, that result directly.
    Outputs are replicated over ``axis``.

  Example:
    >>> import jax.numpy as jnp, numpy as np, jaxpar
    >>> apply = jaxpar.pipeline.pipeline_apply(
    ...     lambda w, x: jnp.tanh(x @ w), mesh=jaxpar.make_mesh(stage=4, data=2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(4, 8))
    >>> apply(np.ones((4, 16, 16), np.float32), np.ones((32, 16), np.float32)).shape
    (32, 16)
  """
  check_fn(stage_fn, 'stage_fn')
  fill = str(check_fill(bubble_fill))  # a str: nan == nan for the jit cache
  check_schedule(schedule, mesh, axis)
  tick_table(schedule, forward_only=True)   # its errors now, not when called

  def apply(stage_params: PyTree, inputs: jax.Array) -> jax.Array:
    return _apply(stage_fn, stage_params, inputs, schedule=schedule,
                  mesh=mesh, axis=axis, bubble_fill=fill)
  if stage_params is None and inputs is None:
    return apply
  if stage_params is None or inputs is None:
    raise TypeError('pipeline_apply takes stage_params and inputs together '
                    '(to run now) or neither (to get apply(stage_params, '
                    'inputs)).')
  return apply(stage_params, inputs)
