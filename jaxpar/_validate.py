"""Checks of jaxpar's user-facing arguments: an integer, a function's keywords.

A value of the wrong type raises ``TypeError``; a value of the right type that
breaks the rule raises ``ValueError``. NumPy integers are ints; ``True`` is
not (``bool`` subclasses ``int``, so ``zero_stage=True`` would silently mean
1).

Example:
  >>> import numpy as np
  >>> from jaxpar._validate import check_int
  >>> check_int('num_workers', np.int64(4))
  4
  >>> check_int('num_workers', True)
  Traceback (most recent call last):
  ...
  TypeError: num_workers=True must be an int >= 1, got a bool.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def check_int(name: str, value: Any, *, minimum: int | None = 1,
              fix: str = '', where: str = '') -> int:
  """``value`` as a Python int, or a ``TypeError`` / ``ValueError``.

  Args:
    name: the argument's name, as the user wrote it.
    value: what the user passed.
    minimum: the smallest allowed value; ``None``: any int.
    fix: appended to the message: what to pass instead.
    where: the function or class the argument belongs to, as a prefix.
  """
  prefix = f'{where}: ' if where else ''
  suffix = f' {fix}' if fix else ''
  rule = 'an int' if minimum is None else f'an int >= {minimum}'
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f'{prefix}{name}={value!r} must be {rule}, '
                    f'got a {type(value).__name__}.{suffix}')
  if minimum is not None and value < minimum:
    raise ValueError(f'{prefix}{name}={value!r} must be an int >= '
                     f'{minimum}.{suffix}')
  return int(value)


def check_keywords(fn: Callable[..., Any], name: str, data: str,
                   keywords: Sequence[str]) -> None:
  """``TypeError`` unless ``fn`` takes each of ``keywords`` by keyword.

  jaxpar passes a user function its data positionally and its extras by
  keyword: ``key=`` when the step has a key, ``state=`` to a function with
  model state. ``fn`` qualifies with a parameter of that name (not
  positional-only) or a ``**kwargs``. A function whose signature Python
  cannot read (a builtin) is not checked.

  Args:
    fn: the user's function.
    name: its argument's name, e.g. ``'stage_fn'``.
    data: its data arguments as jaxpar passes them, e.g. ``'params, x'``.
    keywords: the extras this step passes, e.g. ``('key',)``.

  Example:
    >>> from jaxpar._validate import check_keywords
    >>> check_keywords(lambda p, x, key=None: x, 'stage_fn', 'params, x',
    ...                ('key',))
    >>> def stage_fn(p, x, rng): return x
    >>> check_keywords(stage_fn, 'stage_fn', 'params, x', ('key',))
    Traceback (most recent call last):
    ...
    TypeError: stage_fn(p, x, rng) does not take key=: ...
  """
  if not keywords:
    return
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return
  params = signature.parameters.values()
  if any(p.kind is p.VAR_KEYWORD for p in params):
    return
  named = {p.name for p in params
           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  missing = [k for k in keywords if k not in named]
  if not missing:
    return
  why = {'key': 'the step has a key', 'state': 'it has model state'}
  call = ', '.join([data] + [f'{k}={k[0]}' for k in keywords])
  raise TypeError(
      f'{name}{signature} does not take '
      f'{" or ".join(k + "=" for k in missing)}: '
      f'{" and ".join(why[k] for k in missing)}, so jaxpar calls '
      f'{name}({call}): the data positionally, jaxpar\'s extras by keyword. '
      f'Define it as def {name}({data}, *, {", ".join(keywords)}): ... '
      '(a parameter of that name, or **kwargs).')
