"""A process for ``jaxpar.distributed.launch`` tests that starts instantly (no JAX).

``python -m launch_probe env DIR`` writes the ``JAXPAR_*`` variables it got to
``DIR/<JAXPAR_PROCESS_ID>.json``; ``fail RANK``: process ``RANK`` exits with
``FAIL_CODE`` at once, the others sleep; ``sleep``: all sleep; ``stubborn
DIR``: all write their pid to ``DIR/<JAXPAR_PROCESS_ID>.pid``, print a line
and sleep, ignoring SIGTERM as a JAX worker of a ``jax.distributed`` job does
(its preemption notifier takes the signal), so only SIGKILL stops them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

FAIL_CODE = 3
SLEEP_S = 120


def main(argv: list[str]) -> int:
  mode, rank = argv[0], os.environ['JAXPAR_PROCESS_ID']
  if mode == 'env':
    with open(os.path.join(argv[1], f'{rank}.json'), 'w') as f:
      json.dump({k: v for k, v in os.environ.items()
                 if k.startswith('JAXPAR_')}, f)
    return 0
  if mode == 'fail' and rank == argv[1]:
    return FAIL_CODE
  if mode == 'stubborn':
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f'probe {rank} ignores SIGTERM', flush=True)
    with open(os.path.join(argv[1], f'{rank}.pid.tmp'), 'w') as f:
      f.write(str(os.getpid()))
    os.replace(os.path.join(argv[1], f'{rank}.pid.tmp'),
               os.path.join(argv[1], f'{rank}.pid'))
  time.sleep(SLEEP_S)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
