"""``plan``'s arguments checked before any work: ranges, sizes, the reason
no layout is left.

A value of the wrong type raises ``TypeError``, one of the right type that
breaks the rule ``ValueError``; each message names the value, the rule and
what to pass instead (``jaxpar._validate``'s convention).

Example:
  >>> from jaxpar.planner import parse_size
  >>> parse_size('80GiB') / 2**30, parse_size('2GB'), parse_size(1e9)
  (80.0, 2000000000.0, 1000000000.0)
  >>> parse_size('-1GiB')
  Traceback (most recent call last):
  ...
  ValueError: plan: memory_per_device='-1GiB' must be a positive finite ...
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from typing import Any

from jaxpar._validate import check_int
from jaxpar.planner._layout import ZERO_STAGES
from jaxpar.train_state import REMAT_POLICIES

_UNITS = {'': 1, 'B': 1, 'KiB': 2**10, 'MiB': 2**20, 'GiB': 2**30,
          'TiB': 2**40, 'KB': 1e3, 'MB': 1e6, 'GB': 1e9, 'TB': 1e12}
_SIZE = re.compile(r'\s*([-+0-9.eE]+|nan|inf)\s*([A-Za-z]*)\s*')
_SIZE_FIX = ("pass bytes as a number (2 * 2**30) or a string such as "
             "'80GiB', '512MiB', '2GB' (units B, KiB, MiB, GiB, TiB, KB, "
             "MB, GB, TB).")


def parse_size(value: Any, name: str = 'memory_per_device') -> float:
  """Bytes of ``value``: a positive finite number, or a string of one with
  a unit (``'80GiB'``, ``'2GB'``, ``'1e9'``).

  Raises:
    TypeError: neither a number nor a string (a bool is neither).
    ValueError: a string that is not a size, or a size that is not a
      positive finite number.
  """
  number = value
  if isinstance(value, str):
    match = _SIZE.fullmatch(value)
    if not match or match.group(2) not in _UNITS:
      raise ValueError(f'plan: {name}={value!r} is not a size: {_SIZE_FIX}')
    try:
      number = float(match.group(1)) * _UNITS[match.group(2)]
    except ValueError:
      raise ValueError(f'plan: {name}={value!r} is not a size: '
                       f'{_SIZE_FIX}') from None
  elif isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f'plan: {name}={value!r} must be bytes, got a '
                    f'{type(value).__name__}: {_SIZE_FIX}')
  if not (math.isfinite(number) and number > 0):
    raise ValueError(f'plan: {name}={value!r} must be a positive finite '
                     f'number of bytes: {_SIZE_FIX}')
  return float(number)


def _sequence(name: str, value: Any, example: str) -> tuple:
  if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
    raise TypeError(f'plan: {name}={value!r} must be a sequence of '
                    f'candidates, e.g. {name}={example}.')
  if not value:
    raise ValueError(f'plan: {name}={value!r} is empty: pass at least one '
                     f'candidate, e.g. {name}={example}.')
  return tuple(value)


def check_zero_stages(value: Any) -> tuple[int, ...]:
  """``zero_stages`` as ints of ``ZERO_STAGES`` (the trainers' stages)."""
  out = []
  for x in _sequence('zero_stages', value, '(0, 1)'):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
      raise TypeError(f'plan: zero_stages={value!r} holds {x!r}, a '
                      f'{type(x).__name__}: the ZeRO stages are the ints '
                      f'{ZERO_STAGES}; pass a subset of them.')
    if x not in ZERO_STAGES:
      raise ValueError(
          f'plan: zero_stages={value!r} holds {x!r}: the trainers run ZeRO '
          f'stages {ZERO_STAGES} only (0: replicated; 1: optimizer state '
          'split over data; 3: params too); pass a subset of them.')
    out.append(int(x))
  return tuple(out)


def check_remat_policies(value: Any) -> tuple[str, ...]:
  """``remat_policies`` as names of ``train_state.REMAT_POLICIES``."""
  names = tuple(REMAT_POLICIES)
  for x in _sequence('remat_policies', value, "('dots', 'nothing')"):
    if x not in names:
      raise ValueError(
          f'plan: remat_policies={value!r} holds {x!r}, not a remat policy '
          f'the planner can cost: pass names of '
          f'jaxpar.train_state.REMAT_POLICIES, {names}.')
  return tuple(value)


def check_counts(*, batch: int, max_microbatches: Any) -> int:
  """``max_microbatches`` as an int >= 1 (``batch`` is checked by
  ``batch_size``)."""
  if batch < 1:
    raise ValueError(f'plan: batch={batch} sequences: a step needs at '
                     'least one; pass the global batch of one step.')
  return check_int('max_microbatches', max_microbatches, where='plan',
                   fix='It caps the microbatches per replica; pass e.g. 64.')


def no_layout(*, name: str, devices: int, batch: int, num_layers: int,
              tensor_sizes: Sequence[int], allowed: Sequence[tuple],
              num_stages: int | None, where: bool) -> ValueError:
  """The error when no layout is left, naming what removed them.

  ``allowed``: the meshes ``(data, stage, tensor)`` the model and batch
  allow before ``where`` and a ``PipelineModel``'s cut (empty: none);
  ``where``: whether a ``where=`` was given.
  """
  prefix = f'plan: no layout of {name} on {devices} devices'
  if not allowed:
    return ValueError(
        f'{prefix} with batch {batch}: a mesh needs data dividing the '
        f'batch, tensor in {tuple(tensor_sizes)} (dividing the heads, '
        f'widths and vocabulary) and stage at most the {num_layers} '
        f'layer(s), with data x stage x tensor = {devices}; none does. '
        'Change the batch or the devices.')
  meshes = ', '.join(f'{d}x{s}x{t}' for d, s, t in sorted(set(allowed)))
  kept = []
  if num_stages is not None:
    kept.append(f"has {num_stages} logical stages (the PipelineModel's "
                'cut)')
  if where:
    kept.append('passes where=')
  fix = ('pass the NNX model itself (blocks=, embed=, head_loss=) to plan '
         'every stage count' if not where else 'loosen where=')
  return ValueError(
      f"{prefix}: none of the layouts the model allows {' and '.join(kept)}"
      f'. The model has {num_layers} layer(s), so stage is at most '
      f'{num_layers} (logical stages are at most the layers); the meshes '
      f'data x stage x tensor are {meshes}. Fix: {fix}, or plan a model '
      'with more layers.')
