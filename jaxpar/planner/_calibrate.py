"""A ``Profile`` of the devices at hand, from a micro-benchmark of a few seconds.

What a step runs, timed at plan time on the devices (calibrated on the
machine, no constants fitted to another):

* **the one-rank program**: a stage of two GPT blocks of ``spec``'s shape
  (a scan over its layers, as a step's) in the executor's one-rank step
  (one ``value_and_grad`` program) on one device at 1 to 32 sequences per
  microbatch: the FLOP/s reached at each (``Profile.block_rates``; on a
  CPU small microbatches run far below large ones);
* **the pipeline's blocks**: the same stage's ``F``, ``I``, ``W`` and fused
  ``B`` (``pipeline.StageVJP``) at 1, 8 and 16 sequences, in seconds per
  second of the one-rank program (``Profile.kind_factors``): each its own
  program, and at 16 sequences, with 2 devices or more, as a 2-rank 1F1B
  and GPipe step's tick scan runs them (``_in_step``: the slot reads and
  in-place writes, the other rank running beside);
* **tensor**: the one-rank program split over two devices as ``tensor``:
  the share of the ideal speed-up its FLOPs reach against one device at 2,
  8 and 32 sequences (``Profile.tensor_shares``);
* **the ends**: the GPT's embedding, head and loss, forward and backward
  (``Profile.head_seconds``);
* **ticks**: the executor on a stage whose blocks cost nothing (a ``[8,
  8]`` layer) at two microbatch counts: on 2 ranks one tick (the fitted
  ``ppermute`` taken out), on 1 one microbatch of the plain scan;
* **links**: ``psum``, ``all_gather``, ``psum_scatter`` and ``ppermute``
  over all devices at 4 KiB, 1 MiB and 8 MiB, 8 in a row in one program;
  alpha and beta fitted to ``Profile.collective``'s ring formulas;
* **alone**: the one-rank program in process 0 alone over all running it;
* **ZeRO-3**: ``data_parallel.gathered`` on the same stage over 2 devices
  as ``data``, under ``jax.grad`` (each param array gathered, gathered
  again in the backward, its gradient reduce-scattered, one at a time):
  seconds per layer and microbatch (``Profile.zero3_layer_seconds``);
* **memory bandwidth**: an in-place add of a large buffer, and a fill of
  one the call allocates (``Profile.first_touch_bandwidth``: on a CPU a
  step's temporaries and outputs fault their pages in on every call).

Example:
  >>> import jax
  >>> from jaxpar.models import gpt
  >>> from jaxpar.planner import ModelSpec, measure_profile
  >>> spec = ModelSpec.from_gpt(gpt.GPTConfig(d_model=16, num_heads=2,
  ...                                         seq_len=8, num_layers=2))
  >>> profile = measure_profile(spec, jax.devices()[:1], repeats=1)
  >>> [tokens for tokens, _ in profile.block_rates]   # 1 to 32 sequences
  [8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
  >>> round(sum(profile.block_shares), 6)            # F, I, W
  1.0
  >>> [t for t, _ in profile.kind_factors], len(profile.head_seconds)
  ([8.0, 64.0, 128.0], 3)
  >>> profile.tensor_shares         # one device: not measured
  ()
  >>> profile.tick_overhead, profile.microbatch_overhead >= 0   # no pipeline
  (0.0, True)
  >>> profile.first_touch_bandwidth > 0    # a fresh buffer written in
  True
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import data_parallel, pipeline, tensor_parallel
from jaxpar.models import gpt
from jaxpar.pipeline import StageVJP
from jaxpar.pipeline.executor import stash_policy
from jaxpar.pipeline.executor.internal import remat_layers
from jaxpar.planner._model import ModelSpec
from jaxpar.planner._profile import POLICY_FACTORS, Profile
from jaxpar.planner._in_step import in_step_costs, per_tick
from jaxpar.planner._timing import own_device as _own_device
from jaxpar.planner._timing import placed as _global
from jaxpar.planner._timing import rounds as _rounds
from jaxpar.planner._timing import seconds as _seconds
from jaxpar.vma import varying_axes

_SIZES = (2**12, 2**20, 2**23)   # bytes of the collective buffers timed
_CHAIN = 8                       # collectives per timed program, in a row
_ROWS = (1, 2, 4, 8, 16, 32)    # sequences per microbatch of the blocks timed
_HBM_BYTES = 2**28              # the in-place add and the fill: 256 MiB
# The blocks apart and the head. At 8 sequences too: on a CPU the one-rank
# program runs 15-20% faster per FLOP there than at 16 or 32, but a
# pipeline's blocks do not (their F + I + W read 1.08x it at 8, 0.98x at
# 16), and interpolated between 1 and 16 they put the 8-sequence pipelines
# 9-22% under their measured time (``docs/planning.md``, "0.17.3").
_FACTOR_ROWS = (_ROWS[0], _ROWS[3], _ROWS[4])
_TENSOR_ROWS = _ROWS[1::2]   # the stage split over tensor


class _Blocks(NamedTuple):
  """A stage of ``slots`` GPT blocks as the executor runs it, jitted over
  ``mesh`` (axis ``tensor``): ``kinds`` the blocks as separate programs,
  as the tick scan runs them: ``F(params, x) -> (y, stash)``, ``I(params, x,
  stash, dy) -> (dx, kept)``, ``W(params, x, stash, dy, kept) -> grads``,
  ``B(params, x, stash, dy) -> (grads, dx)`` and ``R(params, x, stash,
  dy) -> grads``, a ``W`` that re-runs ``I``'s chain (``w_recompute``);
  ``head(ends, ids)`` the embedding, head and loss, forward and backward;
  ``plain(x)`` a call of the one-rank step's program on the host
  microbatch ``x`` (the executor's one-rank path: ``jax.value_and_grad``
  of the stage and a loss, one microbatch), over the devices as
  ``tensor``."""
  kinds: tuple[Callable, ...]
  head: Callable
  plain: Callable[[np.ndarray], Callable]
  params: Any
  ends: Any
  mesh: Any
  slots: int


def _fresh(w, x, w_recompute: bool = False) -> StageVJP:
  """A ``StageVJP`` of a GPT stage traced at ``x`` (replicated over
  ``tensor``, as the 3D trainer's activations are)."""
  vjp = StageVJP(gpt.stage_fn, w_recompute=w_recompute)
  vjp.trace(w, x)
  return vjp


def _forward(w, x):
  return _fresh(w, x).forward(w, x)


def _input_grad(w, x, stash, dy):
  vjp = _fresh(w, x)
  vjp.split(w, stash, dy)
  return vjp.input_grad(w, stash, dy)


def _weight_grad(w, x, stash, dy, kept):
  vjp = _fresh(w, x)
  vjp.split(w, stash, dy)
  return vjp.weight_grad(w, stash, dy, kept)


def _weight_grad_again(w, x, stash, dy):
  vjp = _fresh(w, x, w_recompute=True)
  vjp.split(w, stash, dy)
  return vjp.weight_grad(w, stash, dy, [])   # it keeps nothing


def _backward(w, x, stash, dy):
  return _fresh(w, x).backward(w, stash, dy)


def _on(mesh, fn: Callable, in_specs: tuple, *args) -> tuple[Callable, Any]:
  """``(program, out_specs)``: ``fn`` jitted in a ``shard_map`` over
  ``mesh``, each output ``P('tensor')`` where it varies over ``tensor``,
  else ``P()`` (read off a trace at ``args``): one block hands the next
  what the trainer's tick scan carries, of the same type."""
  found = []

  def probe(*a):
    out = fn(*a)
    found.append(jax.tree.map(lambda v: P('tensor') if 'tensor' in
                              varying_axes(v) else P(), out))
    return out
  jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=in_specs,
                               out_specs=P('tensor')), *args)
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                               out_specs=found[0])), found[0]


def _plain(devices: tuple, stage: Any, policy: str = 'dots'
           ) -> Callable[[np.ndarray], Callable]:
  """``plain(x)``: a call of the executor's one-rank step of ``stage``
  (host params ``[slots, ...]``) under the remat ``policy`` and a cheap
  loss on the host microbatch ``x``, on ``devices`` as ``tensor``: what a
  stage rank without a pipeline runs per microbatch
  (``pipeline_value_and_grad_local``, as the trainers call it)."""
  mesh = jax.sharding.Mesh(np.asarray(devices).reshape(1, -1),
                           ('stage', 'tensor'))
  specs = jax.tree.map(lambda spec: P('stage', *spec),
                       tensor_parallel.param_specs(stage,
                                                   rules=gpt.TENSOR_RULES),
                       is_leaf=lambda x: isinstance(x, P))
  table = pipeline.tick_table(pipeline.one_f_one_b(1, 1))

  def local(w, x):
    return pipeline.pipeline_value_and_grad_local(
        gpt.stage_fn, lambda s, y, t: jnp.mean(y * t), w, (), x, x,
        table=table, input_grads=False, remat_policy=policy).grads.stages
  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P()),
                               out_specs=specs))
  params = jax.tree.map(lambda a, s: _global(mesh, a[None], s), stage, specs)
  return lambda x: functools.partial(step, params, _global(mesh, x))


def _head_program(mesh, ends: tuple) -> tuple[Callable, tuple]:
  """The GPT's embedding, head and loss, forward and backward, jitted over
  ``mesh``; and ``ends`` (host ``(embed, head)``) placed for it."""
  def loss(ends, ids):
    embed, head = ends
    return gpt.head_loss_fn(head, gpt.embed_fn(embed, ids), ids)
  specs = tuple(tensor_parallel.param_specs(part, rules=gpt.TENSOR_RULES)
                for part in ends)
  placed = jax.tree.map(lambda a, s: _global(mesh, a, s), ends, specs)
  return jax.jit(jax.shard_map(jax.value_and_grad(loss), mesh=mesh,
                               in_specs=(specs, P()),
                               out_specs=(P(), specs))), placed


def _slots(spec: ModelSpec) -> int:
  """Layers of the stage timed: two where the model has them (a step's
  stage is a scan over its layers, each reading its slice of the stacked
  params), else one."""
  return min(2, spec.num_layers)


def _host_stage(spec: ModelSpec) -> tuple[Any, Any]:
  """``(split, stage)``: host params of a GPT of ``spec``'s width, heads and
  sequence with ``_slots`` layers (``split_for_pipeline``'s one stage) and
  its stage's ``[slots, ...]`` leaves."""
  config = gpt.GPTConfig(d_model=spec.d_model, num_heads=spec.num_heads,
                         seq_len=spec.seq_len, num_layers=_slots(spec),
                         vocab_size=max(spec.vocab_size, 8))
  shapes = gpt.gpt_params(nnx.eval_shape(
      lambda: gpt.GPT(config, rngs=nnx.Rngs(0))))
  host = jax.tree.map(lambda s: np.full(s.shape, 0.01, s.dtype), shapes)
  split = gpt.split_for_pipeline(host, num_stages=1)[0]
  return split, jax.tree.map(lambda a: np.asarray(a[0]), split.stages)


@functools.lru_cache(maxsize=8)
def _stage_blocks(spec: ModelSpec, devices: tuple) -> _Blocks:
  """A stage of ``min(2, layers)`` GPT blocks of ``spec``'s width, heads
  and sequence (a scan over its slots, as a step's stage is), split over
  ``devices`` as ``tensor`` (one device: not split); built once per
  ``devices``, compiled once per microbatch size."""
  slots = _slots(spec)
  split, stage = _host_stage(spec)
  mesh = jax.sharding.Mesh(np.asarray(devices), ('tensor',))
  specs = tensor_parallel.param_specs(stage, rules=gpt.TENSOR_RULES)
  params = jax.tree.map(lambda a, s: _global(mesh, a, s), stage, specs)
  x = jax.ShapeDtypeStruct((1, spec.seq_len, spec.d_model), jnp.float32)
  f, (ys, ss) = _on(mesh, _forward, (specs, P()), params, x)
  y, stash = jax.eval_shape(f, params, x)
  i, (_, ks) = _on(mesh, _input_grad, (specs, P(), ss, ys), params, x,
                   stash, y)
  kept = jax.eval_shape(i, params, x, stash, y)[1]
  kinds = (f, i, _on(mesh, _weight_grad, (specs, P(), ss, ys, ks), params,
                     x, stash, y, kept)[0],
           *(_on(mesh, fn, (specs, P(), ss, ys), params, x, stash, y)[0]
             for fn in (_backward, _weight_grad_again)))
  head, ends = _head_program(mesh, (split.embed, split.head))
  return _Blocks(kinds, head, _plain(devices, stage), params, ends, mesh,
                 slots)


def _block_seconds(spec: ModelSpec, devices: Sequence, rows: int,
                   repeats: int) -> float:
  """Seconds of the one-rank program at ``rows`` sequences on ``devices``
  as ``tensor``."""
  call = _stage_blocks(spec, tuple(devices)).plain(_microbatch(spec, rows))
  return _seconds(call, repeats=repeats)


def _microbatch(spec: ModelSpec, rows: int) -> np.ndarray:
  return np.ones((rows, spec.seq_len, spec.d_model), np.float32)


def block_calls(spec: ModelSpec, device) -> list[tuple[Callable, int]]:
  """``(call, k)`` of the one-rank step's program (a stage of ``_slots``
  layers) on ``device`` at each of ``_ROWS`` sequences per microbatch, ``k``
  calls a sample: at least ``_ROWS[3]`` sequences of work (one call of 10
  ms varies by +-20% with another process on the cores). ``_blocks_and_head``
  times them, and ``planner.measure`` again beside the candidates' steps."""
  blocks = _stage_blocks(spec, (device,))
  return [(blocks.plain(_microbatch(spec, r)), max(1, _ROWS[3] // r))
          for r in _ROWS]


def block_rates(spec: ModelSpec, seconds: Sequence[float]
                ) -> tuple[tuple[float, float], ...]:
  """``((tokens, FLOP/s), ...)`` of a layer's forward and backward, from
  the seconds per call of ``block_calls`` (``Profile.block_rates``).

  Example:
    >>> from jaxpar.models import gpt
    >>> from jaxpar.planner import ModelSpec
    >>> from jaxpar.planner._calibrate import block_rates
    >>> spec = ModelSpec.from_gpt(gpt.GPTConfig(d_model=16, num_heads=2,
    ...                                         seq_len=8, num_layers=2))
    >>> [t for t, _ in block_rates(spec, [1.0] * 6)]
    [8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
  """
  return tuple((float(r * spec.seq_len), 3 * spec.flops.per_device(1) * r
                * spec.seq_len * _slots(spec) / s)
               for r, s in zip(_ROWS, seconds))


def _blocks_and_head(spec: ModelSpec, device, repeats: int
                     ) -> tuple[tuple, tuple, tuple, tuple]:
  """``(block_rates, kind_factors, head_seconds, policy_factors)``, all from
  one run of ``repeats`` rounds (a machine's speed drifts by 10-15% within
  one calibration: a ratio holds where its two parts are timed side by
  side): ``block_calls``' rates; at ``_FACTOR_ROWS`` sequences the
  pipeline's ``F``, ``I``, ``W``, fused ``B`` and ``R`` (``W`` under
  ``w_recompute``), each its own program as the tick scan runs it, in
  seconds per second of the one-rank program (on a CPU ``I`` holds the
  backward's non-matmul work, and each block pays its own program's fixed
  costs); the GPT's embedding, head and loss, forward and backward, in
  seconds (none for a model that is not a GPT); the one-rank program under
  each of ``POLICY_FACTORS`` in seconds per second of it under ``'dots'``.
  """
  blocks = _stage_blocks(spec, (device,))
  f, i, w, b, again = blocks.kinds
  stage = _host_stage(spec)[1]
  plains = [_plain((device,), stage, policy) for policy in POLICY_FACTORS]
  calls = block_calls(spec, device)
  for r in _FACTOR_ROWS:
    k = max(1, _ROWS[3] // r)
    x = _global(blocks.mesh, _microbatch(spec, r))
    y, stash = f(blocks.params, x)
    _, kept = i(blocks.params, x, stash, y)
    ids = _global(blocks.mesh, np.zeros((r, spec.seq_len), np.int32))
    calls += [(functools.partial(fn, blocks.params, *args), k)
              for fn, args in ((f, (x,)), (i, (x, stash, y)),
                               (w, (x, stash, y, kept)), (b, (x, stash, y)),
                               (again, (x, stash, y)))] + [
        (functools.partial(blocks.head, blocks.ends, ids), k)] + [
        (plain(_microbatch(spec, r)), k) for plain in plains]
  seconds = _rounds(calls, repeats)
  rates = block_rates(spec, seconds[:len(_ROWS)])
  rows = np.reshape(seconds[len(_ROWS):], (len(_FACTOR_ROWS), -1))
  tokens = [float(r * spec.seq_len) for r in _FACTOR_ROWS]
  plain = [seconds[_ROWS.index(r)] for r in _FACTOR_ROWS]
  factors = tuple((t, tuple(float(x / p) for x in s[:5]))
                  for t, p, s in zip(tokens, plain, rows))
  head = (tuple((t, float(s[5])) for t, s in zip(tokens, rows))
          if spec.vocab_size > 1 else ())
  policies = tuple((t, tuple(float(x / p) for x in s[6:]))
                   for t, p, s in zip(tokens, plain, rows))
  return rates, factors, head, policies


def _alone_speedup(spec: ModelSpec, device, repeats: int) -> float:
  """How much faster process 0 runs the one-rank program (``_FACTOR_ROWS[-1]``
  sequences) while the others wait in a collective, as a pipeline rank
  runs a block while its neighbour idles, than with all of them running it
  (on a shared CPU host the waiting processes' cores join in: 1.5-1.95x
  on 2 cores); 1 with one process. The median over ``3 * repeats`` rounds
  of their ratio, the two timed one right after the other (a machine's
  speed drifts by 10-15% within one calibration)."""
  if jax.process_count() == 1:
    return 1.0
  call = _stage_blocks(spec, (device,)).plain(
      _microbatch(spec, _FACTOR_ROWS[-1]))
  ratios = []
  for _ in range(3 * repeats):   # warm and the median, as _rounds
    together = _rounds([(call, 1)], 1)[0]
    multihost_utils.sync_global_devices('jaxpar.planner.alone')
    if jax.process_index() == 0:
      jax.block_until_ready(call())
      start = time.perf_counter()
      jax.block_until_ready(call())
      ratios.append(together / (time.perf_counter() - start))
    multihost_utils.sync_global_devices('jaxpar.planner.alone')
  # At most one core per process joins in: between 1 and the processes.
  return float(np.clip(np.median(ratios), 1.0,
                       jax.process_count())) if ratios else 1.0


def _tensor_shares(spec: ModelSpec, device, devices: Sequence,
                   probe: Profile, repeats: int) -> tuple:
  """``((tokens, share), ...)``: the share of the ideal 2-fold speed-up of
  the one-rank program split over 2 devices as ``tensor``, against the
  same program on ``device`` alone, at each of ``_TENSOR_ROWS`` sequences
  (its 4 activation all-reduces per layer, costed by ``probe``, taken
  out); none without 2 devices or a 2-way split of the model."""
  if len(devices) < 2 or 2 not in spec.tensor_sizes(2):
    return ()
  out = []
  for rows in _TENSOR_ROWS:
    comm = 4 * _slots(spec) * probe.collective(
        'all-reduce', rows * spec.seq_len * spec.d_model * 4, 2)
    one = _block_seconds(spec, [device], rows, repeats)
    two = _block_seconds(spec, devices[:2], rows, repeats) - comm
    out.append((float(rows * spec.seq_len),
                float(np.clip(one / 2 / max(two, 1e-9), 0.05, 1.0))))
  return tuple(out)


def _zero3_program(spec: ModelSpec, devices: Sequence
                   ) -> tuple[Callable, tuple]:
  """``(program, args)``: the gradient of a stage of ``_slots`` GPT layers
  of ``spec``'s width on one token, its params ZeRO-3 slices over
  ``devices[:2]`` as ``data`` (``data_parallel.gathered``, as the trainers
  run it) and each layer under ``'dots'`` (``remat_layers``, as the step
  runs it): what a ZeRO-3 step runs per microbatch besides its FLOPs, each
  param array gathered in the forward, again in the backward, and its
  gradient reduce-scattered, one at a time in its layer's iteration."""
  mesh = jax.sharding.Mesh(np.asarray(devices[:2]).reshape(2, 1),
                           ('data', 'tensor'))
  stage = _host_stage(spec)[1]
  specs = data_parallel.data_specs(  # as the trainers split a stage's
      stage, tensor_parallel.param_specs(stage, rules=gpt.TENSOR_RULES),
      mesh=mesh, skip=1)              # leaves: never the layer dim
  params = jax.tree.map(lambda a, s: _global(mesh, a, s), stage, specs)
  stage_fn = remat_layers(gpt.stage_fn, stash_policy('dots'))  # per layer
  loss = lambda p, x: stage_fn(p, x).sum()
  grad = jax.jit(jax.shard_map(
      jax.grad(data_parallel.gathered(loss, specs, data_axis='data')),
      mesh=mesh, in_specs=(specs, P('data')), out_specs=specs))
  x = np.ones((2, 1, spec.d_model), np.float32)   # one token per device
  return grad, (params, _global(mesh, x, P('data')))


def _collective_fns(mesh) -> dict[str, Callable]:
  """The four kinds as jitted functions of a ``[n, k]`` float32 buffer,
  each ``_CHAIN`` in a row in a scan (on the last one's output cut or tiled
  back), as a step runs them: alone, each pays a dispatch and a wake-up."""
  n = mesh.devices.size
  ops = {
      'all-reduce': lambda x: jax.lax.psum(x, 'x'),
      'all-gather': lambda x: jax.lax.all_gather(x, 'x', tiled=True)[:1],
      'reduce-scatter': lambda x: jnp.tile(jax.lax.psum_scatter(
          x, 'x', scatter_dimension=1, tiled=True), (1, n)),
      'ppermute': lambda x: jax.lax.ppermute(
          x, 'x', [(i, (i + 1) % n) for i in range(n)]),
  }
  # Timing only: the gathered value is the same on every device.
  chain = lambda op: jax.jit(jax.shard_map(
      lambda x: jax.lax.scan(lambda y, _: (op(y), None), x, None,
                             length=_CHAIN)[0],
      mesh=mesh, in_specs=P('x'), out_specs=P('x'), check_vma=False))
  return {kind: chain(op) for kind, op in ops.items()}


def _links(devices: Sequence, repeats: int) -> tuple[float, float]:
  """``(alpha seconds, beta bytes/s)`` fitted over the kinds and sizes."""
  n = len(devices)
  mesh = jax.sharding.Mesh(np.asarray(devices), ('x',))
  rows, times = [], []
  probe = Profile('probe', 1.0, 1.0, 1.0, link_bandwidth=1.0, link_latency=1.0)
  for kind, fn in _collective_fns(mesh).items():
    for nbytes in _SIZES:
      host = np.zeros((n, nbytes // 4), np.float32)
      x = jax.make_array_from_callback(
          host.shape, NamedSharding(mesh, P('x')), lambda i, h=host: h[i])
      # The kind's cost is a * alpha + b * nbytes / beta: read a and b off
      # the formula with unit alpha and a huge/unit beta.
      a = probe._replace(link_bandwidth=1e30).collective(kind, nbytes, n)
      b = probe._replace(link_latency=0.0).collective(kind, nbytes, n)
      rows.append((a, b))
      times.append(_seconds(fn, x, repeats=repeats) / _CHAIN)
  # Least squares of the relative error: the small sizes fix alpha as
  # much as the large ones fix beta.
  weight = 1.0 / np.asarray(times)[:, None]
  (alpha, per_byte), *_ = np.linalg.lstsq(np.asarray(rows) * weight,
                                          np.ones(len(times)), rcond=None)
  return max(float(alpha), 1e-7), 1.0 / max(float(per_byte), 1e-13)


def _hbm_bandwidth(device, repeats: int) -> float:
  """Bytes/s of an in-place accumulate ``acc += g`` over ``_HBM_BYTES`` (two
  reads and a write, ``acc`` donated), as ``W`` adds its gradient and the
  update rewrites the state: large enough that a GPU's launch does not
  dominate (a fresh output instead pays a CPU's page faults: 6 GiB/s here
  against 29)."""
  add = jax.jit(lambda acc, g: acc + g, donate_argnums=0)
  g = jax.device_put(np.ones(_HBM_BYTES // 4, np.float32), device)
  acc = [jax.device_put(np.zeros(_HBM_BYTES // 4, np.float32), device)]

  def accumulate():
    acc[0] = add(acc[0], g)
    return acc[0]
  return 3 * g.nbytes / _seconds(accumulate, repeats=repeats)


def _first_touch_bandwidth(device, repeats: int) -> float:
  """Bytes/s of a fill of ``_HBM_BYTES`` the call allocates (as a step's
  temporaries and outputs: on a CPU mapped afresh, each page faulting in)."""
  fill = jax.jit(lambda x: jnp.full((_HBM_BYTES // 4,), x, jnp.float32))
  x = jax.device_put(np.float32(1), device)
  return _HBM_BYTES / _seconds(fill, x, repeats=repeats)


def _memory_bytes(device) -> float:
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  if stats and stats.get('bytes_limit'):
    return float(stats['bytes_limit'])
  import os
  total = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  return float(total) / max(jax.local_device_count(), 1)


def _shared(values: Sequence[float]) -> list[float]:
  """Process 0's ``values`` in every process (one profile, one ranking)."""
  if jax.process_count() == 1:
    return [float(x) for x in values]
  return [float(x) for x in multihost_utils.broadcast_one_to_all(
      np.asarray(values, np.float64))]


def _in_step_factors(spec: ModelSpec, device, devices: Sequence,
                     factors: tuple, repeats: int) -> tuple:
  """``kind_factors`` with ``F``, ``I``, ``W`` and ``B`` at
  ``_FACTOR_ROWS[-1]`` sequences timed inside a 2-rank step of the same
  stage (``in_step_costs``), in seconds per second of the one-rank program,
  and ``R`` (apart) scaled as ``W`` is. At one sequence they stay apart:
  timed in the step there they read 1.5x (0.44 ms of a 9.4 ms ``F`` the
  timeline's stamps), which put the 64-microbatch steps 49-77% high where
  apart they were within 11% (``docs/planning.md``, "0.11.0")."""
  stage = _host_stage(spec)[1]
  rows, (tokens, apart) = _FACTOR_ROWS[-1], factors[-1]
  costs = in_step_costs(gpt.stage_fn, stage, devices,
                        _microbatch(spec, rows), repeats=repeats,
                        specs=tensor_parallel.param_specs(
                            stage, rules=gpt.TENSOR_RULES))
  plain = _block_seconds(spec, (device,), rows, repeats)
  f, i, w, b = (costs[k] / plain for k in 'FIWB')
  return (*factors[:-1], (tokens, (f, i, w, b, apart[4] * w / apart[2])))


@functools.lru_cache(maxsize=8)
def _measured(spec: ModelSpec, devices: tuple, repeats: int) -> Profile:
  device = _own_device(devices)
  rates, factors, head, policies = _blocks_and_head(spec, device, repeats)
  alpha, beta = _links(devices, repeats) if len(devices) > 1 else (0.0, 1e30)
  hbm = _hbm_bandwidth(device, repeats)
  touch = _first_touch_bandwidth(device, repeats)
  per_mb = per_tick([device], 0.0, repeats)
  tick = 0.0
  if len(devices) > 1:   # a tick of 2 ranks; one 32-byte message costs:
    tick = per_tick(devices[:2], alpha + 32 / beta, repeats)
  zero3 = 0.0
  if len(devices) > 1:   # ZeRO-3's collectives, per layer and microbatch
    program, args = _zero3_program(spec, devices)
    zero3 = _seconds(program, *args, repeats=repeats) / _slots(spec)
  alone = _alone_speedup(spec, device, repeats)
  alpha, beta, hbm, touch, per_mb, tick, zero3, alone, *flat = _shared(
      [alpha, beta, hbm, touch, per_mb, tick, zero3, alone,
       *(r for _, r in rates), *(s for _, s in head),
       *(x for _, xs in factors + policies for x in xs)])
  rates = tuple(zip((t for t, _ in rates), flat[:len(rates)]))
  flat = flat[len(rates):]
  head = tuple(zip((t for t, _ in head), flat[:len(head)]))
  flat = iter(flat[len(head):])
  factors, policies = (tuple((t, tuple(next(flat) for _ in xs))
                             for t, xs in pairs)
                       for pairs in (factors, policies))
  f, i, w = factors[-1][1][:3]
  probe = Profile('probe', max(r for _, r in rates), 0.0, hbm, beta, alpha,
                  block_rates=rates,
                  block_shares=(f / (f + i + w), i / (f + i + w),
                                w / (f + i + w)),
                  kind_factors=factors, head_seconds=head,
                  alone_speedup=alone)
  shares = _tensor_shares(spec, device, devices, probe, repeats)
  if shares:   # process 0's, as the rest
    shares = tuple(zip((t for t, _ in shares),
                       _shared([x for _, x in shares])))
  if len(devices) > 1:   # last: each timeline compiles its step afresh
    factors = _in_step_factors(spec, device, devices, factors, repeats)
  return probe._replace(
      name=f'measured ({device.platform} x{len(devices)})',
      memory_bytes=_memory_bytes(device), node_devices=len(devices),
      tick_overhead=tick, microbatch_overhead=per_mb,
      kind_factors=factors, tensor_shares=shares, zero3_layer_seconds=zero3,
      policy_factors=policies, first_touch_bandwidth=touch,
      source=f'micro-benchmark on {len(devices)} {device.platform} devices: '
      f"a stage of {_slots(spec)} GPT blocks in the executor's one-rank "
      f"step at {', '.join(map(str, _ROWS))} sequences; its F, I, W and B "
      'apart and the embedding, head and loss at '
      f'{", ".join(map(str, _FACTOR_ROWS))}, the blocks in a 2-rank 1F1B '
      f'and GPipe step at {_FACTOR_ROWS[-1]} (2 devices or more); the '
      'one-rank step split over 2 devices as tensor at '
      f'{", ".join(map(str, _TENSOR_ROWS))}; psum, all_gather, psum_scatter, '
      f'ppermute at {", ".join(map(str, _SIZES))} bytes, {_CHAIN} in a row; '
      f'an in-place add and a fresh fill of {_HBM_BYTES >> 20} MiB; a 1F1B '
      'step of an [8, 8] layer at 4 and 16 microbatches on 1 and 2 ranks; '
      'ZeRO-3 gathers of the stage over 2 devices; the one-rank step in '
      'process 0 alone')


def measure_profile(spec: ModelSpec, devices: Sequence, *,
                    repeats: int = 5) -> Profile:
  """The ``Profile`` of ``devices`` for ``spec``'s blocks (module doc).

  Memoised per ``(spec, devices, repeats)``; every process of a
  multi-process job must call it (the collectives span them), and all get
  process 0's numbers, so that they rank the layouts alike.
  """
  return _measured(spec, tuple(devices), repeats)
