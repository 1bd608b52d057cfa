"""The executor's public steps: a ``Schedule``'s tick table as one SPMD program.

``pipeline_value_and_grad`` builds a jitted step that computes the loss and
the gradients of a pipelined model, ``pipeline_apply`` its forward pass.
Each is one ``jax.shard_map`` over the pipeline axis around one
``lax.scan`` over the ticks of the schedule's ``TickTable`` (``_tick_scan``,
whose docstring describes a tick; ``docs/executor.md`` draws one). The
``_local`` forms are the same executor as functions that run inside a
caller's ``shard_map`` (the 3D trainer's), so that ``stage_fn`` may use
collectives over other mesh axes and the batch may be split over a data
axis. Each public function checks its keyword options once into a
``StepOptions`` and hands that on; a training step always returns a
``PipelineResult``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import vma
from jaxpar._validate import check_keywords
from jaxpar.pipeline.executor import _tick_scan
from jaxpar.pipeline.executor._checks import (
    check_fill, check_float, check_fn, check_leading, check_loss_fn,
    check_new_state, check_schedule, check_stage_axis, check_stage_fn,
    check_state_order, check_table)
from jaxpar.pipeline.executor._microbatches import (
    LossFn, StageFn, extras, microbatched)
from jaxpar.pipeline.executor._options import Embedding, StepOptions
from jaxpar.pipeline.executor._placement import ranks_to_stages, stages_to_ranks
from jaxpar.pipeline.executor._results import (
    PipelineGrads, PipelineResult, PipelineState)
from jaxpar.pipeline.executor._vma import full, is_float
from jaxpar.pipeline.schedules import Schedule, TickTable, tick_table
from jaxpar.train_state import cast_params
from jaxpar.train_state.internal import check_key

PyTree = Any


# ---------------------------------------------------------------- training


def pipeline_value_and_grad_local(
    stage_fn: StageFn, loss_fn: LossFn, local_params: PyTree,
    loss_params: PyTree, inputs: PyTree, targets: PyTree, *,
    table: TickTable, stage_axis: str = 'stage', bubble_fill: float = 0.0,
    key: jax.Array | None = None, microbatch_offset: Any = 0,
    has_aux: bool = False, compute_dtype: Any = None,
    remat_policy: Any = 'dots', input_grads: bool = True,
    w_recompute: bool = False,
    embed_fn: Callable[..., jax.Array] | None = None,
    embed_params: PyTree = None, embed_key: jax.Array | None = None,
    stage_state: PyTree = None, embed_state: PyTree = None,
    head_state: PyTree = None) -> PipelineResult:
  """Computes one rank's share of a pipelined step, inside ``jax.shard_map``.

  This is ``pipeline_value_and_grad`` for a caller that owns the
  ``shard_map``, whose mesh may have more axes than ``stage_axis``:
  ``stage_fn`` may use collectives over them (tensor parallelism) and the
  batch may be split over one (data parallelism; ``pmean`` the loss and
  gradients over it yourself: nothing is reduced over other axes). Each
  rank passes its own stages in rank order and gets their gradients in that
  order; the rest is reduced over ``stage_axis``. The functions run as on
  one device over ``stage_axis`` (``jaxpar.vma.lift``); lift them over your
  other axes too.

  Args:
    stage_fn: ``stage_fn(params, x) -> y``, ``y`` like ``x``; called with
      ``key=k`` when ``key`` is given, and with ``state=s``, returning
      ``(y, new_state)``, when ``stage_state`` is.
    loss_fn: ``loss_fn(loss_params, y, target) -> loss``, one microbatch's
      mean loss (``(loss, aux)`` with ``has_aux``; ``key=k`` with a key).
    local_params: this rank's stages, ``[v, ...]`` in rank order
      (``stages_to_ranks(params, schedule)[rank]``).
    loss_params: ``loss_fn``'s parameters, the same on every rank.
    inputs: ``[batch, ...]``, or any pytree of such leaves (split leaf by
      leaf into microbatches), the same on every rank of ``stage_axis``.
    targets: a pytree of ``[batch, ...]`` leaves.
    table: ``tick_table(schedule)``.
    stage_axis: the pipeline's mesh axis, of size ``schedule.num_ranks``.
    bubble_fill: the value of unwritten buffers and of what idle ranks send
      (``float('nan')`` shows that bubbles never reach the results).
    key: the step's PRNG key, or ``None``. Stage ``k`` on microbatch ``i``
      gets ``fold_in(fold_in(key, microbatch_offset + i), k)``, the loss
      ``k = num_stages``, the same in the forward and the backward.
    microbatch_offset: the global index of this shard's first microbatch,
      e.g. ``axis_index('data') * m``: the keys follow the batch's rows.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` (floats) is
      averaged over the microbatches like the loss.
    compute_dtype: e.g. ``jnp.bfloat16``: the functions run on parameters
      and inputs cast to it; the loss, aux and gradients keep their dtypes.
    remat_policy: what a stage's forward keeps for its backward
      (``stash_policy``): ``'dots'``, ``'everything'`` (or ``None``),
      ``'dots_no_batch'``, ``'nothing'`` or a ``jax.checkpoint_policies``
      policy.
    input_grads: ``False`` skips the cotangent of ``inputs``.
    w_recompute: a ``W`` block recomputes the cotangents its ``I`` would
      keep for it (zero-bubble and V schedules hold less between them; ``W``
      runs one more matrix product per weight).
    embed_fn: ``embed_fn(embed_params, raw) -> x`` (``key=k`` with an
      ``embed_key``), a layer in front of the stages run per microbatch on
      stage 0's rank; ``inputs`` are then its raw rows (e.g. token ids).
    embed_params: ``embed_fn``'s parameters, the same on every rank.
    embed_key: microbatch ``i`` embeds with ``fold_in(embed_key,
      microbatch_offset + i)``.
    stage_state: model state that is not a parameter (BatchNorm's
      statistics), ``[v, ...]`` like ``local_params``, passed from each
      microbatch's forward to the next in microbatch order, as on one
      device; not differentiated.
    embed_state: ``embed_fn``'s model state (a BatchNorm in the stem), the
      same on every rank: ``embed_fn(embed_params, raw, state=s) -> (x,
      new_state)``, passed on like ``stage_state`` by stage 0's forwards;
      the backward recomputes the embedding with the state its forward saw.
    head_state: ``loss_fn``'s model state: ``loss_fn(loss_params, y,
      target, state=s) -> (loss, new_state)`` (``((loss, aux),
      new_state)`` with ``has_aux``), passed on by the last stage's
      forwards.

  Returns:
    ``PipelineResult(loss, aux, grads, state)``: the mean loss over this
    shard's batch, ``aux`` (``None`` without ``has_aux``), the gradients
    (``grads.stages`` in rank order) and the model state after the last
    microbatch (a ``PipelineState``; ``None`` without any given).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> stage_fn = lambda w, x: jnp.tanh(x @ w)
    >>> loss_fn = lambda scale, y, t: jnp.mean((scale * y - t) ** 2)
    >>> table = jaxpar.pipeline.tick_table(jaxpar.pipeline.one_f_one_b(4, 8))
    >>> def body(w, scale, x, t):   # one rank's view
    ...   out = jaxpar.pipeline.pipeline_value_and_grad_local(
    ...       stage_fn, loss_fn, w[0], scale, x, t, table=table)
    ...   return out.loss, out.grads.stages[None]
    >>> step = jax.jit(jax.shard_map(
    ...     body, mesh=jaxpar.make_mesh(stage=4, data=2), axis_names={'stage'},
    ...     in_specs=(P('stage'), P(), P(), P()), out_specs=(P(), P('stage'))))
    >>> w = np.full((4, 1, 16, 16), 1 / 16, np.float32)   # [p, v, ...]
    >>> loss, dw = step(w, 2.0, np.ones((32, 16)), np.zeros((32, 16)))
    >>> dw.shape
    (4, 1, 16, 16)
  """
  options = StepOptions(
      stage_axis=stage_axis, bubble_fill=bubble_fill, key=key,
      microbatch_offset=microbatch_offset, has_aux=has_aux,
      compute_dtype=compute_dtype, remat_policy=remat_policy,
      input_grads=input_grads, w_recompute=w_recompute).checked()
  if embed_fn is None and embed_state is not None:
    raise ValueError('embed_state is the model state of embed_fn; pass '
                     'embed_fn (or no embed_state).')
  embedding = (None if embed_fn is None else
               Embedding(embed_fn, embed_params, embed_key, embed_state))
  return _local_step(stage_fn, loss_fn, local_params, loss_params, inputs,
                     targets, table=table, options=options,
                     embedding=embedding, stage_state=stage_state,
                     head_state=head_state)


def _local_step(stage_fn: StageFn, loss_fn: LossFn, local_params: PyTree,
                loss_params: PyTree, inputs: PyTree, targets: PyTree, *,
                table: TickTable, options: StepOptions,
                embedding: Embedding | None, stage_state: PyTree,
                head_state: PyTree = None) -> PipelineResult:
  """``pipeline_value_and_grad_local`` once its options are checked."""
  table = check_table(table)
  if not table.training:
    raise ValueError(f'table, the tick table of schedule '
                     f'{table.schedule.name!r}, has no backward actions '
                     '(forward_only=True); use pipeline_apply_local, or pass '
                     'tick_table(schedule).')
  schedule = table.schedule
  check_stage_axis(options.stage_axis, schedule)
  _check_functions(stage_fn, loss_fn, embedding, options.key, stage_state,
                   head_state)
  _check_trees(table, local_params, loss_params, embedding, stage_state,
               head_state)
  stage_fn, loss_fn, embedding = _as_on_one_device(stage_fn, loss_fn,
                                                   embedding, options)
  given = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), inputs)
  if options.compute_dtype is not None and embedding is None:
    inputs = jax.tree.map(lambda a, t: jnp.asarray(
        a, options.compute_dtype) if is_float(t) else a, inputs, given)
  xs, ts = microbatched(inputs, targets, schedule.num_microbatches)
  x = jax.tree.map(lambda a: a[0], xs)
  if embedding is not None:
    # A value, not its aval: under a shard_map manual over some axes only,
    # eval_shape rejects avals that carry manual-axis types.
    x = jax.eval_shape(
        lambda params, raw, k, s: embedding.fn(params, raw, **extras(k, s)),
        embedding.params, x, embedding.key, embedding.state)
    if embedding.state is not None:
      x = check_new_state(x, embedding.state,
                          'embed_fn(embed_params, raw, state=s)',
                          'embed_state')
    x = full(x, 0)
  check_stage_fn(stage_fn, local_params, x, options.key, stage_state)
  check_loss_fn(loss_fn, loss_params, x, jax.tree.map(lambda t: t[0], ts),
                options.key, options.has_aux, head_state)
  res = _tick_scan.run(stage_fn, loss_fn, table, local_params, loss_params,
                       xs, ts, options=options, embedding=embedding,
                       stage_state=stage_state, head_state=head_state)
  dx = None if res.inputs is None else jax.tree.map(
      _batch_cotangent, res.inputs, given)
  loss, aux = res.value
  state = PipelineState(*res.state[:3])
  return PipelineResult(loss, aux if options.has_aux else None,
                        PipelineGrads(res.stages, res.head, dx, res.embed),
                        None if all(part is None for part in state)
                        else state)


def _batch_cotangent(rows: jax.Array, given: jax.ShapeDtypeStruct):
  """An input leaf's cotangent ``[m, mb, ...]`` as ``grads.inputs`` holds
  it: shaped and typed like the leaf, ``float0`` zeros for an integer one
  (what ``jax.vjp`` of a layer in front of the pipeline takes)."""
  if not is_float(given):
    return np.zeros(given.shape, jax.dtypes.float0)
  return rows.reshape(given.shape).astype(given.dtype)


def _check_functions(stage_fn: Any, loss_fn: Any,
                     embedding: Embedding | None, key: Any,
                     stage_state: PyTree, head_state: PyTree) -> None:
  """``TypeError`` unless each function is callable and takes by keyword
  the extras this step passes it (``key=``, ``state=``)."""
  check_fn(stage_fn, 'stage_fn')
  check_fn(loss_fn, 'loss_fn')
  keyed = () if key is None else ('key',)
  stateful = lambda state: () if state is None else ('state',)
  check_keywords(stage_fn, 'stage_fn', 'params, x',
                 keyed + stateful(stage_state))
  check_keywords(loss_fn, 'loss_fn', 'loss_params, y, target',
                 keyed + stateful(head_state))
  if embedding is not None:
    check_fn(embedding.fn, 'embed_fn')
    check_key(embedding.key)
    check_keywords(embedding.fn, 'embed_fn', 'embed_params, raw',
                   (() if embedding.key is None else ('key',))
                   + stateful(embedding.state))


def _check_trees(table: TickTable, local_params: PyTree,
                 loss_params: PyTree, embedding: Embedding | None,
                 stage_state: PyTree, head_state: PyTree) -> None:
  """The parameters are floats; the stage trees hold this rank's ``v``
  stages; with a state, each stage runs its microbatches in order. (The
  inputs may hold integers: their cotangents are zeros.)"""
  schedule = table.schedule
  v = schedule.num_stages // schedule.num_ranks
  check_float(local_params, 'local_params')
  check_float(loss_params, 'loss_params')
  if embedding is not None:
    check_float(embedding.params, 'embed_params')
  check_leading(local_params, v, 'local_params', 'num_stages // num_ranks')
  if stage_state is not None:
    check_leading(stage_state, v, 'stage_state', 'num_stages // num_ranks')
  if any(state is not None for state in (
      stage_state, head_state, embedding and embedding.state)):
    check_state_order(table)


def _as_on_one_device(stage_fn: StageFn, loss_fn: LossFn,
                      embedding: Embedding | None, options: StepOptions):
  """The functions as on one device over the stage axis (``jaxpar.vma``;
  a caller that also splits the batch lifts them over its axis), computing
  in ``options.compute_dtype``."""
  axes = (options.stage_axis,)
  stage_fn, loss_fn = (vma.lift(stage_fn, axes=axes),
                       vma.lift(loss_fn, axes=axes))
  dtype = options.compute_dtype
  if dtype is not None:
    stage_fn, loss_fn = (cast_params(stage_fn, dtype),
                         cast_params(loss_fn, dtype))
    if embedding is not None:
      embed, stateful = embedding.fn, embedding.state is not None
      def cast(*a, **kw):   # x (not a new state) in the compute dtype
        out = embed(*a, **kw)
        x = out[0] if stateful else out
        x = jax.tree.map(lambda a: a.astype(dtype) if is_float(a) else a, x)
        return (x, out[1]) if stateful else x
      embedding = embedding._replace(fn=cast_params(cast, dtype))
  return stage_fn, loss_fn, embedding


def pipeline_value_and_grad(
    stage_fn: StageFn, loss_fn: LossFn, *, schedule: Schedule, mesh: Mesh,
    stage_axis: str = 'stage', bubble_fill: float = 0.0,
    has_aux: bool = False, compute_dtype: Any = None,
    remat_policy: Any = 'dots', input_grads: bool = True,
    w_recompute: bool = False) -> Callable[..., PipelineResult]:
  """Builds a jitted pipelined training step: the mean loss and its gradients.

  The step splits the batch into ``m = schedule.num_microbatches``
  microbatches, runs them through the ``S = schedule.num_stages`` stages on
  the ranks of ``mesh``'s ``stage_axis`` as the schedule says, and returns
  what ``jax.value_and_grad`` of the sequential model gives::

    loss = mean_i loss_fn(loss_params, stage_{S-1}(... stage_0(x_i)), t_i)

  There is no optimizer: pass the gradients to optax, or use
  ``jaxpar.parallel.trainer``. Besides its parameters and the batch, a rank
  holds ``tick_table(schedule).num_stash_slots`` stashes and
  ``num_mailbox_slots`` activations, whatever ``m`` is for 1F1B,
  interleaved and zero-bubble schedules. Stages that are not one per rank in
  order (interleaved, V) move between model order and rank order in every
  step; for a large model keep them in rank order and call
  ``pipeline_value_and_grad_local``.

  Args:
    stage_fn: ``stage_fn(params, x) -> y``: one stage on one microbatch
      ``[batch / m, ...]``, ``y`` of ``x``'s shape and dtype (``x`` may be
      a pytree, e.g. ``(h, encoder_output)``: ``y`` of its structure,
      shapes and dtypes; what a stage only reads it passes on unchanged). Called with
      ``key=k`` when the step gets a key, and with ``state=s``, returning
      ``(y, new_state)``, when it gets a ``stage_state``.
    loss_fn: ``loss_fn(loss_params, y, target) -> loss``, one microbatch's
      mean loss (``(loss, aux)`` with ``has_aux``; ``key=k`` with a key).
    schedule: a training ``Schedule`` (GPipe, 1F1B, interleaved,
      zero-bubble, searched or read from CSV).
    mesh: a mesh whose ``stage_axis`` has ``schedule.num_ranks`` devices.
    stage_axis: the pipeline's mesh axis.
    bubble_fill: the value of unwritten buffers and of what idle ranks send.
    has_aux: ``loss_fn`` returns ``(loss, aux)``, ``aux`` floats averaged
      over the microbatches like the loss.
    compute_dtype: e.g. ``jnp.bfloat16``: the functions run on parameters
      and inputs cast to it; the loss, aux and gradients keep their dtypes.
    remat_policy: what a stage's forward keeps for its backward
      (``stash_policy``): ``'dots'``, ``'everything'`` (or ``None``),
      ``'dots_no_batch'``, ``'nothing'`` or a ``jax.checkpoint_policies``
      policy.
    input_grads: ``False``: ``grads.inputs`` is ``None``, not computed.
    w_recompute: a ``W`` block recomputes the cotangents its ``I`` would
      keep for it (zero-bubble and V schedules hold less between them; ``W``
      runs one more matrix product per weight).

  Returns:
    ``step(stage_params, loss_params, inputs, targets, key=None,
    stage_state=None) -> PipelineResult(loss, aux, grads, state)``, jitted.
    ``stage_params``, ``stage_state`` and ``state`` are stacked
    ``[num_stages, ...]`` in model order; ``inputs`` is ``[batch, ...]``
    (or a pytree of such leaves, the activations' structure), ``targets`` a
    pytree of ``[batch, ...]`` leaves, ``key`` a PRNG key.
    Shapes and signatures are checked when ``step`` is traced.

  Raises:
    TypeError / ValueError: a function that is not callable, a schedule
      that does not fit the mesh or does not train, a bad option; when the
      step is traced, bad shapes, or a function that does not take the
      ``key=`` or ``state=`` the step passes.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxpar
    >>> stage_fn = lambda p, x: jnp.tanh(x @ p['w'] + p['b'])
    >>> loss_fn = lambda scale, y, t: jnp.mean((scale * y - t) ** 2)
    >>> step = jaxpar.pipeline.pipeline_value_and_grad(
    ...     stage_fn, loss_fn, mesh=jaxpar.make_mesh(stage=4, data=2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(4, 8))
    >>> params = {'w': np.full((4, 16, 16), 1 / 16, np.float32),
    ...           'b': np.zeros((4, 16), np.float32)}    # 4 stages
    >>> out = step(params, 2.0, np.ones((32, 16)), np.zeros((32, 16)))
    >>> out.grads.stages['w'].shape, out.grads.inputs.shape, out.aux
    ((4, 16, 16), (32, 16), None)

    A key and model state come by keyword (dropout, a running mean):

    >>> def noisy_fn(p, x, *, key, state):
    ...   y = jnp.where(jax.random.bernoulli(key, 0.9, x.shape),
    ...                 stage_fn(p, x) / 0.9, 0)
    ...   return y, 0.9 * state + 0.1 * jnp.mean(x, 0)
    >>> step = jaxpar.pipeline.pipeline_value_and_grad(
    ...     noisy_fn, lambda scale, y, t, *, key: loss_fn(scale, y, t),
    ...     mesh=jaxpar.make_mesh(stage=4, data=2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(4, 8))
    >>> out = step(params, 2.0, np.ones((32, 16)), np.zeros((32, 16)),
    ...            key=jax.random.key(0), stage_state=np.zeros((4, 16)))
    >>> out.state.stages.shape, out.loss.dtype
    ((4, 16), dtype('float32'))
  """
  check_fn(stage_fn, 'stage_fn')
  check_fn(loss_fn, 'loss_fn')
  options = StepOptions(
      stage_axis=stage_axis, bubble_fill=bubble_fill, has_aux=has_aux,
      compute_dtype=compute_dtype, remat_policy=remat_policy,
      input_grads=input_grads, w_recompute=w_recompute).checked()
  check_schedule(schedule, mesh, stage_axis)
  table = tick_table(schedule)
  first = lambda tree: jax.tree.map(lambda a: a[0], tree)
  stacked = lambda tree: jax.tree.map(lambda a: a[None], tree)

  def local(params, loss_params, inputs, targets, key, state):
    out = _local_step(stage_fn, loss_fn, first(params), loss_params, inputs,
                      targets, table=table, options=options._replace(key=key),
                      embedding=None, stage_state=first(state))
    return out._replace(grads=out.grads._replace(
        stages=stacked(out.grads.stages)),
                        state=PipelineState(stacked(
                            out.state and out.state.stages)))

  by_rank = NamedSharding(mesh, P(stage_axis))
  to_ranks = lambda tree: jax.reshard(stages_to_ranks(
      tree, schedule, out_sharding=by_rank), by_rank)
  to_stages = lambda tree: ranks_to_stages(tree, schedule,
                                           out_sharding=by_rank)
  # Manual over every mesh axis (replicated over the others): XLA:CPU 0.10
  # aborts on a bfloat16 all-reduce in a partly manual shard_map.
  sharded = jax.shard_map(
      local, mesh=mesh,
      in_specs=(P(stage_axis), P(), P(), P(), P(), P(stage_axis)),
      out_specs=PipelineResult(P(), P(), PipelineGrads(P(stage_axis), P(),
                                                       P()),
                               PipelineState(P(stage_axis))))

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
    out = sharded(to_ranks(stage_params), loss_params, inputs, targets, key,
                  None if stage_state is None else to_ranks(stage_state))
    return out._replace(
        grads=out.grads._replace(stages=to_stages(out.grads.stages)),
        state=None if stage_state is None else PipelineState(
            to_stages(out.state.stages)))
  return step


# ---------------------------------------------------------------- forward


def pipeline_apply_local(
    stage_fn: StageFn, local_params: PyTree, inputs: PyTree, *,
    table: TickTable, stage_axis: str = 'stage',
    bubble_fill: float = 0.0) -> jax.Array:
  """Runs one rank's share of ``pipeline_apply``; call it in ``jax.shard_map``.

  Args:
    stage_fn: ``stage_fn(params, x) -> y``, ``y`` like ``x``.
    local_params: this rank's stages, ``[v, ...]`` in rank order.
    inputs: ``[batch, ...]`` (or a pytree of such leaves), the same on
      every rank of ``stage_axis``.
    table: ``tick_table(schedule, forward_only=True)``.
    stage_axis: the pipeline's mesh axis, of size ``schedule.num_ranks``.
    bubble_fill: the value of unwritten buffer slots and of what idle ranks
      send.

  Returns:
    ``[batch, ...]``, the last stage's outputs, the same on every rank.
  """
  table = check_table(table)
  check_fn(stage_fn, 'stage_fn')
  if table.training:
    raise ValueError(f'table, the tick table of schedule '
                     f'{table.schedule.name!r}, has backward actions; pass '
                     'tick_table(schedule, forward_only=True) to '
                     'pipeline_apply_local.')
  options = StepOptions(stage_axis=stage_axis,
                        bubble_fill=bubble_fill).checked()
  schedule = table.schedule
  check_stage_axis(stage_axis, schedule)
  check_leading(local_params, schedule.num_stages // schedule.num_ranks,
                'local_params', 'num_stages // num_ranks')
  stage_fn = vma.lift(stage_fn, axes=(stage_axis,))
  xs, _ = microbatched(inputs, (), schedule.num_microbatches)
  check_stage_fn(stage_fn, local_params,
                 jax.tree.map(lambda a: jax.typeof(a[0]), xs))
  out = _tick_scan.run(stage_fn, None, table, local_params, (), xs, (),
                       options=options)
  return jax.tree.map(lambda o, a: o.reshape(np.shape(a)), out, inputs)


@functools.partial(jax.jit, static_argnames=(
    'stage_fn', 'schedule', 'mesh', 'stage_axis', 'bubble_fill'))
def _apply(stage_fn, stage_params, inputs, *, schedule, mesh, stage_axis,
           bubble_fill):
  bubble_fill = float(bubble_fill)  # passed as a str: nan == nan for the cache
  check_schedule(schedule, mesh, stage_axis)
  table = tick_table(schedule, forward_only=True)
  check_leading(stage_params, schedule.num_stages, 'stage_params',
                'schedule.num_stages')
  local = lambda params, x: pipeline_apply_local(
      stage_fn, jax.tree.map(lambda a: a[0], params), x, table=table,
      stage_axis=stage_axis, bubble_fill=bubble_fill)
  params = stages_to_ranks(stage_params, schedule,
                           out_sharding=NamedSharding(mesh, P(stage_axis)))
  inputs = jax.reshard(inputs, NamedSharding(mesh, P()))
  return jax.shard_map(local, mesh=mesh, in_specs=(P(stage_axis), P()),
                       out_specs=P(), axis_names={stage_axis})(params, inputs)


def pipeline_apply(stage_fn: StageFn, stage_params: PyTree | None = None,
                   inputs: jax.Array | None = None, *, schedule: Schedule,
                   mesh: Mesh, stage_axis: str = 'stage',
                   bubble_fill: float = 0.0):
  """Runs a pipelined forward pass (inference): every stage on the batch.

  It runs the ``F`` actions of ``schedule`` (any schedule; its backward
  actions are dropped) and returns ``stage_{S-1}(... stage_0(x))`` for the
  whole batch. The program is compiled once per ``stage_fn``, schedule,
  mesh, axis and input shapes.

  Args:
    stage_fn: ``stage_fn(params, x) -> y``, ``y`` like ``x``.
    stage_params: the stages' parameters, stacked ``[num_stages, ...]`` in
      model order; give it with ``inputs`` to run now.
    inputs: ``[batch, ...]``, ``batch`` divisible by
      ``schedule.num_microbatches``.
    schedule: a ``Schedule`` whose ``num_ranks`` is the size of
      ``stage_axis``.
    mesh: the device mesh.
    stage_axis: the pipeline's mesh axis.
    bubble_fill: the value of unwritten buffer slots and of what idle ranks
      send.

  Returns:
    With ``stage_params`` and ``inputs``: the outputs ``[batch, ...]``, the
    same on every rank. Without them: ``apply(stage_params, inputs)``, which
    returns those outputs.

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
  check_schedule(schedule, mesh, stage_axis)
  tick_table(schedule, forward_only=True)   # its errors now, not when called

  def apply(stage_params: PyTree, inputs: jax.Array) -> jax.Array:
    return _apply(stage_fn, stage_params, inputs, schedule=schedule,
                  mesh=mesh, stage_axis=stage_axis, bubble_fill=fill)
  if stage_params is None and inputs is None:
    return apply
  if stage_params is None or inputs is None:
    raise TypeError('pipeline_apply takes stage_params and inputs together '
                    '(to run now) or neither (to get apply(stage_params, '
                    'inputs)).')
  return apply(stage_params, inputs)
