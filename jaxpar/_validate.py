"""The one integer check of jaxpar's user-facing arguments.

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
