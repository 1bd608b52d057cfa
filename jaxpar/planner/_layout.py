"""A layout -- mesh sizes, schedule, microbatches, ZeRO, remat -- and the set of them.

``Layout`` is one way to train a model on ``data x stage x tensor`` devices;
``layouts`` lists every one a model and a batch allow: factorisations of
the devices (``tensor`` dividing the heads, MLP width and vocabulary;
logical stages no more than layers), every schedule constructor of
``jaxpar.pipeline`` (GPipe, 1F1B, interleaved 1F1B with ``v`` chunks,
ZB-H1, ZB-V, V-Half, V-Min, DualPipeV), microbatch counts dividing each
replica's batch, ZeRO 0/1/3 and the remat policies. A layout may also hold
a schedule of ``pipeline.search`` (``schedule_name='search'``, its
arguments in ``searched``): ``plan`` adds those for its best meshes.

Example:
  >>> from jaxpar.planner import Layout
  >>> layout = Layout(2, 2, 2, 'zero_bubble_v', 4, zero_stage=1)
  >>> layout.schedule().name, layout.num_stages, layout.devices
  ('ZB-V', 4, 8)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from jaxpar import pipeline
from jaxpar.planner._model import ModelSpec

SCHEDULES = pipeline.STAGES_PER_RANK   # constructor -> stages per rank
# The remat policies ``layouts`` tries by default (a subset of the
# trainers' ``train_state.REMAT_POLICIES``).
CANDIDATE_REMAT_POLICIES = ('dots', 'nothing', 'everything')
ZERO_STAGES = (0, 1, 3)
# Interleaved 1F1B's chunks per rank tried by default: 2 up to this.
MAX_VIRTUAL_STAGES = 8
# ``TickTable.kind`` codes of the split backward's blocks (I = 3, W = 4).
KIND_I = pipeline.KIND_CODES['I']


class SearchArgs(NamedTuple):
  """What ``pipeline.search`` is called with for a searched layout.

  Attributes:
    memory_limit: stashes per rank, in one 1F1B stage's.
    costs: ``(F, I, W)`` per 1F1B stage (relative).
    comm: a message's cost, in the same unit.
    v_shape: ``search``'s placements (``None``: all, ``False``: one stage
      per rank).

  Example (``I`` 1.4 times ``F``, up to 4 stashes a rank, 2 ranks):
    >>> from jaxpar.planner import Layout, SearchArgs
    >>> layout = Layout(1, 2, 1, 'search', 4,
    ...                 searched=SearchArgs(4.0, (1.0, 1.4, 1.2), 0.0, False))
    >>> layout.schedule().name, layout.stages_per_rank
    ('Search(memory=4)', 1)
  """
  memory_limit: float
  costs: tuple[float, float, float]
  comm: float
  v_shape: bool | None


class Layout(NamedTuple):
  """One layout of a training step.

  Attributes:
    data, stage, tensor: the mesh sizes (``jaxpar.make_mesh``).
    schedule_name: a ``jaxpar.pipeline`` constructor name
      (``'one_f_one_b'``, ``'zero_bubble_v'``, ...).
    num_microbatches: microbatches per replica and step.
    zero_stage: 0, 1 or 3 (the trainers' ``zero_stage``).
    remat_policy: what the backward keeps of each stage's forward: the
      trainers' ``remat_policy``, a name of ``STASH_POLICIES``.
    virtual_stages: chunks per rank of interleaved 1F1B (else 1).
    w_recompute: the trainers' ``w_recompute``: ``I`` keeps nothing for
      ``W``, which recomputes the input-gradient chain it needs (only for
      schedules whose tick table has ``I``/``W`` cells).
    searched: with ``schedule_name='search'``, ``pipeline.search``'s
      arguments (``SearchArgs``); else ``None``.
  """
  data: int
  stage: int
  tensor: int
  schedule_name: str
  num_microbatches: int
  zero_stage: int = 0
  remat_policy: str = 'dots'
  virtual_stages: int = 1
  w_recompute: bool = False
  searched: SearchArgs | None = None

  @property
  def devices(self) -> int:
    """``data * stage * tensor``."""
    return self.data * self.stage * self.tensor

  @property
  def stages_per_rank(self) -> int:
    """Logical stages each pipeline rank holds."""
    if self.schedule_name == 'search':
      return self.schedule().num_stages // self.stage
    return SCHEDULES[self.schedule_name] or self.virtual_stages

  @property
  def num_stages(self) -> int:
    """Logical pipeline stages: ``stage * stages_per_rank``."""
    return self.stage * self.stages_per_rank

  def schedule(self) -> pipeline.Schedule:
    """The ``jaxpar.pipeline`` schedule (memoised)."""
    return _schedule(*schedule_key(self))

  @property
  def schedule_label(self) -> str:
    """The schedule's name for tables; ``'-'`` with one stage rank (no
    pipeline: the microbatches run in turn, as data parallelism does)."""
    return '-' if self.stage == 1 else self.schedule().name

  def describe(self) -> str:
    """``'2x2x2 ZB-V m=4 ZeRO-1 dots'`` (`` wrecompute`` appended with
    ``w_recompute``): one line for tables."""
    return (f'{self.data}x{self.stage}x{self.tensor} '
            f'{self.schedule_label} m={self.num_microbatches} '
            f'ZeRO-{self.zero_stage} {self.remat_policy}'
            + (' wrecompute' if self.w_recompute else ''))


@functools.lru_cache(maxsize=4096)
def _schedule(name: str, p: int, m: int, v: int,
              searched: SearchArgs | None = None) -> pipeline.Schedule:
  if name == 'interleaved_one_f_one_b':
    return pipeline.interleaved_one_f_one_b(p, m, v)
  if name == 'search':
    f, i, w = searched.costs
    return pipeline.search(p, m, memory_limit=searched.memory_limit,
                           costs={'F': f, 'I': i, 'W': w, 'B': i + w},
                           comm=searched.comm, v_shape=searched.v_shape)
  return getattr(pipeline, name)(p, m)


@functools.lru_cache(maxsize=4096)
def tick_table(layout_schedule: tuple) -> pipeline.TickTable:
  """The tick table of ``schedule_key`` (memoised: shared by layouts)."""
  return pipeline.tick_table(_schedule(*layout_schedule))


def schedule_key(layout: Layout) -> tuple:
  """``(name, p, m, v, searched)``: what fixes a layout's schedule (and
  its tick table: ``w_recompute`` changes the blocks, not the table)."""
  return (layout.schedule_name, layout.stage, layout.num_microbatches,
          layout.virtual_stages, layout.searched)


def factorisations(n: int) -> Iterator[tuple[int, int, int]]:
  """Every ``(data, stage, tensor)`` with product ``n``."""
  for t in range(1, n + 1):
    if n % t == 0:
      for s in range(1, n // t + 1):
        if (n // t) % s == 0:
          yield n // t // s, s, t


def _schedules(p: int, m: int, num_layers: int,
               virtual: Sequence[int] | None) -> Iterator[tuple[str, int]]:
  """``(constructor, v)`` pairs that fit ``p`` ranks, ``m`` microbatches
  (``virtual`` ``None``: every ``v`` from 2 to ``MAX_VIRTUAL_STAGES``)."""
  if p == 1:
    yield 'one_f_one_b', 1
    return
  for name, per_rank in SCHEDULES.items():
    if per_rank is None:
      for v in virtual or range(2, MAX_VIRTUAL_STAGES + 1):
        if m % p == 0 and p * v <= num_layers:
          yield name, v
    elif p * per_rank <= num_layers:
      yield name, 1


def has_weight_blocks(layout: Layout) -> bool:
  """Whether the layout's tick table has ``I``/``W`` cells (a split
  backward: what ``w_recompute`` changes)."""
  return layout.stage > 1 and bool(
      (tick_table(schedule_key(layout)).kind >= KIND_I).any())


def layouts(spec: ModelSpec, *, devices: int, batch: int,
            zero_stages: Sequence[int] = ZERO_STAGES,
            remat_policies: Sequence[str] = CANDIDATE_REMAT_POLICIES,
            max_microbatches: int = 64,
            virtual_stages: Sequence[int] | None = None,
            w_recompute: Sequence[bool] = (False, True)) -> list[Layout]:
  """Every layout of ``spec`` on ``devices`` devices for a ``batch``.

  ``virtual_stages``: interleaved 1F1B's chunks per rank to try (default
  every ``v`` from 2 to ``MAX_VIRTUAL_STAGES`` with ``p * v`` no more than
  the layers); ``w_recompute``: the values to try for layouts whose tick
  table has ``I``/``W`` cells (the others: ``False``).

  Example:
    >>> from jaxpar.models import gpt
    >>> from jaxpar.planner import ModelSpec, layouts
    >>> spec = ModelSpec.from_gpt(gpt.GPTConfig(num_layers=2))
    >>> found = layouts(spec, devices=2, batch=4, zero_stages=(0,),
    ...                 remat_policies=('dots',))
    >>> sorted({(x.data, x.stage, x.tensor) for x in found})
    [(1, 1, 2), (1, 2, 1), (2, 1, 1)]
  """
  found = []
  for d, s, t in factorisations(devices):
    if t not in spec.tensor_sizes(t) or s > spec.num_layers or batch % d:
      continue
    for m in range(1, min(batch // d, max_microbatches) + 1):
      if (batch // d) % m:
        continue
      for name, v in _schedules(s, m, spec.num_layers, virtual_stages):
        split = has_weight_blocks(Layout(d, s, t, name, m, virtual_stages=v))
        for zero in (zero_stages if d > 1 else (0,)):
          found += [Layout(d, s, t, name, m, zero, r, v, w)
                    for r in remat_policies
                    for w in (w_recompute if split else (False,))]
  return found
