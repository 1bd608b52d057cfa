"""``plan``: every layout of a model on N devices, ranked; ``Plan``, ``Candidate``.

Example (a 2-layer GPT on 8 simulated CPU devices, a plan on paper for an
H100 node: no micro-benchmark, no compile):

  >>> import jaxpar
  >>> from jaxpar.models import gpt
  >>> config = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16,
  ...                        num_heads=2, num_layers=2)
  >>> plan = jaxpar.plan(config, batch=16, devices=8, profile='H100-SXM',
  ...                    remat_policies=('dots',))
  >>> plan.best.fits, plan.best.layout.devices
  (True, 8)
  >>> print(str(plan).splitlines()[0])     # doctest: +NORMALIZE_WHITESPACE
  #  d x s x t  schedule  m  ZeRO  remat  step ms  GiB/dev  bubble  note
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar import parallel
from jaxpar._validate import check_int
from jaxpar.planner import _layout
from jaxpar.planner._checks import (check_counts, check_remat_policies,
                                    check_zero_stages, no_layout, parse_size)
from jaxpar.planner._calibrate import measure_profile
from jaxpar.planner._layout import Layout, layouts
from jaxpar.planner._memory import Memory, memory
from jaxpar.planner._model import ModelSpec
from jaxpar.planner._profile import PROFILES, Profile
from jaxpar.planner._compile import compiled_memory
from jaxpar.planner._searched import searched
from jaxpar.planner._source import Source, build_trainer, source
from jaxpar.planner._time import StepTime, step_time

GIB = 2.0**30
# Stage shapes ``plan`` compiles by default where the devices are present.
DEFAULT_COMPILES = 2


class Candidate(NamedTuple):
  """One layout with its predictions.

  Attributes:
    layout: the ``Layout`` (data, stage, tensor, schedule, microbatches,
      ZeRO stage, remat policy).
    memory: predicted bytes per device by part (``Memory``).
    time: predicted seconds by part (``StepTime``).
    fits: ``memory_bytes <= memory_per_device``.
    compiled: whether ``memory``'s work part comes from a compiled step of
      the same stage shape.
    changes: what the layout changes in what the model computes, ``''``
      where it computes the model as written (one device, the whole
      batch at once): a model with batch statistics (unsynced
      ``nnx.BatchNorm``) normalises each device's microbatch alone when
      ``data * num_microbatches > 1``, e.g. ``'BatchNorm statistics over
      4 of 32 rows'``.
  """
  layout: Layout
  memory: Memory
  time: StepTime
  fits: bool
  compiled: bool = False
  changes: str = ''

  @property
  def as_written(self) -> bool:
    """Whether the layout computes the model as written (``changes``)."""
    return not self.changes

  @property
  def memory_bytes(self) -> int:
    """Predicted bytes per device."""
    return self.memory.total

  @property
  def predicted_s(self) -> float:
    """Predicted seconds per step."""
    return self.time.total

  def row(self, rank: int, cap: float) -> dict:
    """The candidate as a table / JSON row."""
    x = self.layout
    return {'rank': rank, 'data': x.data, 'stage': x.stage,
            'tensor': x.tensor, 'schedule': x.schedule_label,
            'microbatches': x.num_microbatches, 'zero_stage': x.zero_stage,
            'remat_policy': x.remat_policy, 'predicted_s': self.predicted_s,
            'memory_bytes': self.memory_bytes, 'bubble': self.time.bubble,
            'fits': self.fits, 'compiled': self.compiled,
            'changes': self.changes,
            'note': '; '.join(x for x in (
                '' if self.fits else f'needs {self.memory_bytes / GIB:.3g}'
                f' > {cap / GIB:.3g} GiB', self.changes) if x)}


class Plan(NamedTuple):
  """Every candidate, the fitting ones first, fastest first.

  Attributes:
    candidates: ``Candidate`` s, ranked.
    memory_per_device: the cap, bytes.
    profile: the ``Profile`` the times are for.
    source: the model (``plan``'s ``_source.Source``).
    devices: the devices (``None`` on paper).
  """
  candidates: tuple[Candidate, ...]
  memory_per_device: float
  profile: Profile
  source: Source
  devices: tuple | None

  @property
  def best(self) -> Candidate:
    """The fastest candidate that fits (with ``plan(...,
    prefer_as_written=True)``, the default: the fastest that fits and
    computes the model as written, where one does)."""
    return self.candidates[0]

  @property
  def spec(self) -> ModelSpec:
    """The model's ``ModelSpec``."""
    return self.source.spec

  def rows(self, limit: int | None = None) -> list[dict]:
    """The ranked candidates as dicts (``Candidate.row``)."""
    return [c.row(i + 1, self.memory_per_device)
            for i, c in enumerate(self.candidates[:limit])]

  def table(self, limit: int = 15) -> str:
    """The ranked table as text, ``limit`` rows."""
    head = ('#', 'd x s x t', 'schedule', 'm', 'ZeRO', 'remat', 'step ms',
            'GiB/dev', 'bubble', 'note')
    body = [(str(r['rank']), f"{r['data']}x{r['stage']}x{r['tensor']}",
             r['schedule'], str(r['microbatches']), str(r['zero_stage']),
             r['remat_policy'], f"{1e3 * r['predicted_s']:.4g}",
             f"{r['memory_bytes'] / GIB:.4g}", f"{r['bubble']:.2f}",
             '; '.join(x for x in ('compiled' if r['compiled'] else '',
                                   r['note']) if x))
            for r in self.rows(limit)]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ['  '.join(x.ljust(w) for x, w in zip(line, widths)).rstrip()
             for line in (head, *body)]
    fits = sum(c.fits for c in self.candidates)
    lines.append(f'{len(self.candidates)} candidates, {fits} fit '
                 f'{self.memory_per_device / GIB:.4g} GiB; times on '
                 f'{self.profile.name}')
    return '\n'.join(lines)

  def __str__(self) -> str:
    return self.table()

  def _check(self, candidate: Candidate | None) -> Candidate:
    if self.source.pipeline is None:
      raise ValueError('this plan is on paper (a ModelSpec): there is no '
                       'model to train; plan with the model itself.')
    if self.devices is None:
      raise ValueError('this plan is for devices that are not here '
                       '(devices=<int>); plan with devices=jax.devices().')
    return self.best if candidate is None else candidate

  def params(self, candidate: Candidate | None = None):
    """The model's ``PipelineParams`` split for ``candidate`` (default best)."""
    layout = self._check(candidate).layout
    return self.source.pipeline(layout.num_stages)[0]

  def model_state(self, candidate: Candidate | None = None):
    """The model's state that is not params (an NNX model's ``BatchStat`` s),
    split like ``params(candidate)``, or ``None`` (jaxpar's GPT, a model
    without any): ``trainer.init(plan.params(), plan.model_state())``."""
    layout = self._check(candidate).layout
    functions = self.source.pipeline(layout.num_stages)[1]
    if isinstance(functions, parallel.PipelineModel):
      return functions.model_state
    return None

  def trainer(self, optimizer: optax.GradientTransformation,
              candidate: Candidate | None = None, **options: Any):
    """``parallel.trainer`` of ``candidate`` (default the best) on the
    plan's devices; ``options`` go to it too (``max_grad_norm``, ``key``)."""
    layout = self._check(candidate).layout
    return build_trainer(self.source, self.devices, layout, optimizer,
                         **options)

def _devices(devices: Any) -> tuple[tuple | None, int]:
  if devices is None:
    devices = jax.devices()
  if isinstance(devices, int) and not isinstance(devices, bool):
    if devices < 1:
      raise ValueError(f'plan: devices={devices} must be >= 1.')
    return None, devices
  devices = tuple(devices)
  if not devices:
    raise ValueError('plan: devices=() is empty; pass jax.devices() or a '
                     'count with a profile.')
  return devices, len(devices)


def _profile(profile: Any, spec: ModelSpec, devices: tuple | None) -> Profile:
  if isinstance(profile, Profile):
    return profile
  if isinstance(profile, str):
    if profile not in PROFILES:
      raise ValueError(f'plan: profile={profile!r} is not one of '
                       f'{sorted(PROFILES)}; pass one or a Profile.')
    return PROFILES[profile]
  if profile is not None:
    raise TypeError(f'plan: profile must be a Profile or a name of '
                    f'{sorted(PROFILES)}, got {type(profile).__name__}.')
  if devices is None:
    raise ValueError('plan: devices=<int> plans for devices that are not '
                     f'here: pass profile= (one of {sorted(PROFILES)} or a '
                     'Profile).')
  return measure_profile(spec, devices)


def _batch_size(batch: Any) -> tuple[int, Any]:
  if isinstance(batch, bool):
    raise TypeError('plan: batch=True: pass (inputs, targets) of one step '
                    'or its size as an int.')
  if isinstance(batch, (int, np.integer)):
    return int(batch), None
  inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
  leaves = jax.tree.leaves(inputs)
  if not leaves or not hasattr(leaves[0], 'shape') or not leaves[0].shape:
    raise TypeError('plan: batch must be (inputs, targets) with a leading '
                    f'batch dim, or an int; got {type(batch).__name__}.')
  return int(leaves[0].shape[0]), inputs


def _opt_factor(optimizer: Any) -> float:
  """Optimizer-state bytes per param byte (Adam: 2), from ``eval_shape`` of
  its ``init`` on a layer-like tree (no arrays made, nothing compiled)."""
  if optimizer is None:
    return 2.0
  params = {'w': jax.ShapeDtypeStruct((256, 1024), jnp.float32),
            'b': jax.ShapeDtypeStruct((1024,), jnp.float32)}
  size = lambda tree: sum(x.size * x.dtype.itemsize
                          for x in jax.tree.leaves(tree))
  return size(jax.eval_shape(optimizer.init, params)) / size(params)


def _nothing_fits(ranked: list[Candidate], cap: float, n: int) -> ValueError:
  least = min(ranked, key=lambda c: c.memory_bytes)
  return ValueError(
      f'plan: no layout of the model on {n} devices fits memory_per_device='
      f'{cap / GIB:.4g} GiB; the smallest, {least.layout.describe()}, needs '
      f'{least.memory_bytes / GIB:.4g} GiB per device. Use more devices, '
      "zero_stage 3 and remat_policy 'nothing' among the candidates, more "
      'microbatches (smaller ones), a smaller model or batch, or a larger '
      'memory_per_device.')


def plan(model: Any, optimizer: optax.GradientTransformation | None = None,
         *, batch: Any, devices: Sequence | int | None = None,
         memory_per_device: float | str | None = None,
         profile: Profile | str | None = None, blocks: str = 'blocks',
         embed: Any = None, head_loss: Any = None,
         tensor_rules: Mapping[str, Any] | None = None,
         zero_stages: Sequence[int] = _layout.ZERO_STAGES,
         remat_policies: Sequence[str] = _layout.CANDIDATE_REMAT_POLICIES,
         max_microbatches: int = 64, where: Any = None,
         compile: int | None = None, search: int = 0,
         prefer_as_written: bool = True) -> Plan:
  """Ranks every layout of ``model`` on ``devices`` by predicted step time.

  Args:
    model: jaxpar's ``gpt.GPT`` (or ``GPTConfig``), a Flax NNX model (cut
      by ``parallel.from_nnx`` with ``blocks``, ``embed``, ``head_loss``,
      ``tensor_rules``), a ``parallel.PipelineModel`` (cut already: only
      layouts of its logical stage count) or a ``ModelSpec`` (a plan on
      paper).
    optimizer: the optax optimizer (its state's size; default Adam's 2x).
    batch: ``(inputs, targets)`` of one global step, or its size.
    devices: the devices (default ``jax.devices()``), or a count with a
      ``profile`` for devices that are not here.
    memory_per_device: bytes, a number or a string such as ``'80GiB'``
      (``parse_size``); default the profile's.
    profile: a ``Profile`` or a name of ``PROFILES``; default measured on
      ``devices`` (``measure_profile``).
    blocks, embed, head_loss, tensor_rules: as ``parallel.from_nnx`` takes
      them (an NNX model); ``tensor_rules`` gives a model without Flax
      sharding metadata its ``tensor`` candidates.
    zero_stages: ZeRO stages to try, a subset of ``(0, 1, 3)``.
    remat_policies: names of ``train_state.REMAT_POLICIES`` to try.
    max_microbatches: the most microbatches per replica to try (>= 1).
    where: ``where(layout) -> bool`` keeps only some layouts (e.g.
      ``lambda x: x.stage > 1``).
    compile: compile the steps of this many distinct stage shapes, the
      best first, ranking again after each (a shape whose step needs more
      than predicted gives way), and use their memory for every candidate
      of the shape (``_compile``); default ``DEFAULT_COMPILES`` where the
      devices are present and the model can be built, else 0 (``0``: the
      analytic memory alone).
    search: add ``pipeline.search``'s schedule for this many of the best
      pipelined meshes and microbatch counts (their block costs, their
      memory left under the cap; ``_searched``), where it beats the
      built-in constructors; 0 (default): none. Opt-in: the search
      optimises against the time model's blind spots
      (``docs/planning.md``).
    prefer_as_written: rank the layouts that compute the model as written
      (``Candidate.changes`` empty) before those that change it (a
      BatchNorm's statistics over each device's microbatch); ``False``:
      rank all by time.

  Returns:
    ``Plan``: ``plan.best`` the fastest layout that fits.

  Raises:
    TypeError: arguments of the wrong type (a ``memory_per_device`` that is
      neither a number nor a size string, ``zero_stages`` not a sequence).
    ValueError: an argument out of its range (naming it and the rule), no
      layout of the model (naming what removed them), none that fits
      (naming the smallest need and what to change).
  """
  zero_stages = check_zero_stages(zero_stages)
  remat_policies = check_remat_policies(remat_policies)
  cap = (None if memory_per_device is None
         else parse_size(memory_per_device))
  check_int('search', search, minimum=0, where='plan')
  if compile is not None:
    check_int('compile', compile, minimum=0, where='plan')
  n_batch, inputs = _batch_size(batch)
  max_microbatches = check_counts(batch=n_batch,
                                  max_microbatches=max_microbatches)
  devs, n = _devices(devices)
  src = source(model, blocks=blocks, embed=embed, head_loss=head_loss,
               inputs=inputs, tensor_rules=tensor_rules)
  found = _layouts(src, n, n_batch, where, zero_stages=zero_stages,
                   remat_policies=remat_policies,
                   max_microbatches=max_microbatches)
  prof = _profile(profile, src.spec, devs)
  cap = float(prof.memory_bytes) if cap is None else cap
  factor = _opt_factor(optimizer)
  judge = lambda layout: _candidate(src, layout, n_batch, prof, factor, cap)
  rank = lambda c: _ranked(c, prefer_as_written)
  ranked = rank([judge(x) for x in found])
  if search:
    ranked = rank(ranked + [judge(x) for x in searched(
        ranked, search, src.spec, batch=n_batch, opt_factor=factor, cap=cap,
        profile=prof, num_stages=src.num_stages)
        if where is None or where(x)])
  if compile is None:
    compile = DEFAULT_COMPILES
  if compile and devs is not None and src.pipeline is not None:
    ranked = compiled_memory(ranked, compile, src, devs,
                             optimizer or optax.adam(1e-3), batch, cap, rank)
  if not ranked[0].fits:
    raise _nothing_fits(ranked, cap, n)
  return Plan(tuple(ranked), cap, prof, src, devs)


def _layouts(src: Source, n: int, batch: int, where: Any,
             **ranges: Any) -> list[Layout]:
  """The layouts of ``src`` on ``n`` devices that ``where`` and its cut
  keep, or the ``ValueError`` naming what removed them all."""
  allowed = layouts(src.spec, devices=n, batch=batch, **ranges)
  found = [x for x in allowed if (where is None or where(x)) and (
      src.num_stages in (None, x.num_stages))]
  if not found:
    raise no_layout(name=src.spec.name, devices=n, batch=batch,
                    num_layers=src.spec.num_layers,
                    tensor_sizes=src.spec.tensor_sizes(n),
                    allowed=[x[:3] for x in allowed],
                    num_stages=src.num_stages, where=where is not None)
  return found


def _candidate(src: Source, layout: Layout, batch: int, profile: Profile,
               opt_factor: float, cap: float) -> Candidate:
  mem = memory(src.spec, layout, batch=batch, opt_factor=opt_factor)
  rows = batch // (layout.data * layout.num_microbatches)
  changes = (f'BatchNorm statistics over {rows} of {batch} rows'
             if src.batch_statistics and rows < batch else '')
  return Candidate(layout, mem, step_time(src.spec, layout, batch=batch,
                                          profile=profile, mem=mem),
                   mem.total <= cap,
                   changes=changes)


def _ranked(candidates: list[Candidate],
            prefer_as_written: bool = True) -> list[Candidate]:
  """Fitting first; among them those as written first (if preferred),
  then by predicted time; the others by memory."""
  return sorted(candidates, key=lambda c: (
      not c.fits, prefer_as_written and not c.as_written,
      c.predicted_s if c.fits else c.memory_bytes, c.memory_bytes))
