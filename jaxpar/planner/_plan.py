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

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpar import parallel
from jaxpar.planner import _layout
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
  """
  layout: Layout
  memory: Memory
  time: StepTime
  fits: bool
  compiled: bool = False

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
            'note': '' if self.fits else
            f'needs {self.memory_bytes / GIB:.3g} > {cap / GIB:.3g} GiB'}


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
    """The fastest candidate that fits."""
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
             r['note'] or ('compiled' if r['compiled'] else ''))
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
  if isinstance(batch, int) and not isinstance(batch, bool):
    return batch, None
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
         memory_per_device: float | None = None,
         profile: Profile | str | None = None, blocks: str = 'blocks',
         embed: Any = None, head_loss: Any = None,
         zero_stages: Sequence[int] = _layout.ZERO_STAGES,
         remat_policies: Sequence[str] = _layout.CANDIDATE_REMAT_POLICIES,
         max_microbatches: int = 64, where: Any = None,
         compile: int = 0, search: int = 0) -> Plan:
  """Ranks every layout of ``model`` on ``devices`` by predicted step time.

  Args:
    model: jaxpar's ``gpt.GPT`` (or ``GPTConfig``), a Flax NNX model (cut
      by ``parallel.from_nnx`` with ``blocks``, ``embed``, ``head_loss``), a
      ``parallel.PipelineModel`` (cut already: only layouts of its logical
      stage count) or a ``ModelSpec`` (a plan on paper).
    optimizer: the optax optimizer (its state's size; default Adam's 2x).
    batch: ``(inputs, targets)`` of one global step, or its size.
    devices: the devices (default ``jax.devices()``), or a count with a
      ``profile`` for devices that are not here.
    memory_per_device: bytes; default the profile's.
    profile: a ``Profile`` or a name of ``PROFILES``; default measured on
      ``devices`` (``measure_profile``).
    blocks, embed, head_loss: as ``parallel.from_nnx`` takes them.
    zero_stages, remat_policies, max_microbatches: the candidates' ranges.
    where: ``where(layout) -> bool`` keeps only some layouts (e.g.
      ``lambda x: x.stage > 1``).
    compile: compile the steps of this many distinct stage shapes (those of
      the best candidates; devices present) and use their memory for every
      candidate of the same shape.
    search: add ``pipeline.search``'s schedule for this many of the best
      pipelined meshes and microbatch counts (their block costs, their
      memory left under the cap; ``_searched``), where it beats the
      built-in constructors; 0 (default): none. Opt-in: the search
      optimises against the time model, which on 2 CPU processes predicts
      its two schedules 17-19% fast and data parallelism 5-12% fast
      (``docs/planning.md``).

  Returns:
    ``Plan``: ``plan.best`` the fastest layout that fits.

  Raises:
    ValueError: no layout fits (naming the smallest need and what to
      change), bad devices, profile, ``compile`` or ``search``.
  """
  for name, value in (('compile', compile), ('search', search)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f'plan: {name}={value!r} must be an int >= 0.')
  n_batch, inputs = _batch_size(batch)
  src = source(model, blocks=blocks, embed=embed, head_loss=head_loss,
               inputs=inputs)
  devs, n = _devices(devices)
  found = layouts(src.spec, devices=n, batch=n_batch,
                  zero_stages=zero_stages, remat_policies=remat_policies,
                  max_microbatches=max_microbatches)
  found = [x for x in found if (where is None or where(x)) and (
      src.num_stages in (None, x.num_stages))]
  if not found:
    cut = ('' if src.num_stages is None else
           f' and {src.num_stages} logical stages (the PipelineModel\'s cut)')
    raise ValueError(
        f'plan: no layout of {src.spec.name} on {n} devices with batch '
        f'{n_batch}{cut}: the batch must divide by the data size and the '
        f'tensor size divide {src.spec.divisors}; change the batch or '
        'devices.')
  prof = _profile(profile, src.spec, devs)
  cap = float(prof.memory_bytes if memory_per_device is None
              else memory_per_device)
  factor = _opt_factor(optimizer)
  judge = lambda layout: _candidate(src.spec, layout, n_batch, prof, factor,
                                   cap)
  ranked = _ranked([judge(x) for x in found])
  if search:
    ranked = _ranked(ranked + [judge(x) for x in searched(
        ranked, search, src.spec, batch=n_batch, opt_factor=factor, cap=cap,
        profile=prof, num_stages=src.num_stages)
        if where is None or where(x)])
  if compile and devs is not None and src.pipeline is not None:
    ranked = _ranked(compiled_memory(ranked, compile, src, devs,
                                     optimizer or optax.adam(1e-3), batch,
                                     cap))
  if not ranked[0].fits:
    raise _nothing_fits(ranked, cap, n)
  return Plan(tuple(ranked), cap, prof, src, devs)


def _candidate(spec: ModelSpec, layout: Layout, batch: int, profile: Profile,
               opt_factor: float, cap: float) -> Candidate:
  mem = memory(spec, layout, batch=batch, opt_factor=opt_factor)
  return Candidate(layout, mem, step_time(spec, layout, batch=batch,
                                          profile=profile), mem.total <= cap)


def _ranked(candidates: list[Candidate]) -> list[Candidate]:
  return sorted(candidates, key=lambda c: (
      not c.fits, c.predicted_s if c.fits else c.memory_bytes,
      c.memory_bytes))
