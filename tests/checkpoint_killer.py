"""A process killed with SIGKILL while ``jaxpar.checkpoint.save`` writes.

``python checkpoint_killer.py DIR MODE`` saves step 1 (``tree(1)``), prints
``saved 1``, then dies during the save of step 2:

* ``commit``: killed inside orbax's commit (just before the rename of the
  temporary directory);
* ``record``: killed after orbax's commit, before jaxpar's commit mark;
* ``loop``: saves steps 2, 3, ... of a larger state until the test kills it
  at an arbitrary moment (prints ``saving N`` before each).
"""

from __future__ import annotations

import os
import signal
import sys

import jax.numpy as jnp

from jaxpar.checkpoint import _checkpoint as checkpoint
from jaxpar.checkpoint import _integrity as integrity

LOOP_SIZE = 1 << 22   # floats per leaf in loop mode (16 MiB)


def tree(step: int, size: int = 64) -> dict:
  """A state whose every value tells the step that saved it."""
  return {'w': jnp.full((size,), float(step)),
          'b': {'c': jnp.arange(8) + step}}


def _die(*_, **__):
  os.kill(os.getpid(), signal.SIGKILL)


def main(directory: str, mode: str) -> int:
  checkpoint.save(directory, tree(1), step=1)
  print('saved 1', flush=True)
  if mode == 'commit':
    from orbax.checkpoint._src.path import atomicity  # pylint: disable=g-import-not-at-top

    async def finalize(self):
      del self
      _die()
    atomicity.AtomicRenameTemporaryPath.finalize = finalize
  elif mode == 'record':
    write = integrity._write_json  # pylint: disable=protected-access

    def write_then_die(path, value):
      if path.endswith(integrity.RECORD):
        _die()
      write(path, value)
    integrity._write_json = write_then_die  # pylint: disable=protected-access
  step = 2
  while True:
    print(f'saving {step}', flush=True)
    checkpoint.save(directory, tree(step, LOOP_SIZE if mode == 'loop' else 64),
                    step=step)
    step += 1


if __name__ == '__main__':
  sys.exit(main(*sys.argv[1:]))
