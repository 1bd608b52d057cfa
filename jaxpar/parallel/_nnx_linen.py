"""The layers of a Linen model wrapped by ``nnx.bridge.ToNNX``, as blocks.

``nnx.bridge.ToNNX(linen_model)`` keeps the Linen variables as nested dicts
of NNX variables: a list ``self.blocks = [Block() ...]`` defined in
``setup`` becomes the attributes ``blocks_0, blocks_1, ...``, each a dict,
not a module that can be called. ``LinenBlock`` makes one such dict a
module again: calling it runs the Linen submodule on the variables it holds
(``from_nnx`` stacks and runs these as it does NNX blocks).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from flax import nnx

Path = tuple[Any, ...]

# Linen names the modules of a list attribute `blocks` defined in `setup`
# `blocks_0`, `blocks_1`, ... (nnx.bridge.ToNNX keeps them so).
NUMBERED = re.compile(r'(?P<base>.+)_(?P<index>\d+)')


def _path_name(path: Path) -> str:
  return '/'.join(str(k) for k in path)


def _child(node: Any, name: Any) -> Any:
  return node[name] if isinstance(node, dict) else getattr(node, name)


def _linen_call(path: Path, module: Any, *args: Any, **kwargs: Any) -> Any:
  """Calls the Linen submodule at ``path`` of the bound ``module``: an
  attribute, or item ``i`` of the list ``base`` for ``base_i``."""
  for name in path:
    sub = getattr(module, name, None)
    m = NUMBERED.fullmatch(name)
    if sub is None and m:
      seq = getattr(module, m['base'], None)
      if isinstance(seq, (list, tuple)) and int(m['index']) < len(seq):
        sub = seq[int(m['index'])]
    if sub is None:
      raise ValueError(
          f'the Linen module {type(module).__name__} has no submodule '
          f'{name!r} to run as a block: from_nnx calls a Linen block by its '
          'attribute (defined in setup(), e.g. self.blocks = [Block() ...] '
          'for blocks_0, blocks_1, ...); modules made inside an '
          '@nn.compact __call__ cannot be called alone.')
    module = sub
  return module(*args, **kwargs)


class LinenBlock(nnx.bridge.ToNNX):
  """One layer of an ``nnx.bridge.ToNNX``-wrapped Linen model as a module:
  ``block(*args, **kwargs)`` runs the Linen submodule at ``path`` (e.g.
  ``('blocks_0',)``: ``self.blocks[0]`` of a list defined in ``setup``) on
  the variables this module holds, and keeps what it updates (batch
  statistics)."""

  def __init__(self, module: Any, path: Path, variables: dict,
               rngs: nnx.Rngs | None = None):
    super().__init__(module, rngs)
    self.to_nnx__path = tuple(path)
    for name in reversed(path[1:]):
      variables = {name: variables}
    setattr(self, path[0], variables)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return super().__call__(
        *args, method=functools.partial(_linen_call, self.to_nnx__path),
        mutable=True, **kwargs)


def linen_block(model: nnx.Module, path: Path, node: dict,
                at: Path = ()) -> LinenBlock:
  """``node`` (the variables of a ToNNX model's layer at ``path``) as a
  ``LinenBlock`` running the submodule at the ToNNX-relative path ``at``
  (default: its own)."""
  owner, start = None, 0
  current = model
  for i, name in enumerate(path):
    if isinstance(current, nnx.bridge.ToNNX):
      owner, start = current, i
    current = _child(current, name)
  if owner is None:
    raise ValueError(
        f'blocks: {_path_name(path)!r} is a dict of variables, not a module; '
        'only the layers of an nnx.bridge.ToNNX-wrapped Linen model are '
        'dicts. Pass the path of a module or of a sequence of modules.')
  variables = nnx.merge(*nnx.split(node))
  return LinenBlock(owner.to_nnx__module, at or path[start:], variables,
                    owner.to_nnx__rngs)
