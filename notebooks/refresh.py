"""Runs the notebooks top to bottom and stores their outputs in place.

    python notebooks/refresh.py                  # every notebook here
    python notebooks/refresh.py notebooks/03_*.ipynb

The notebooks are committed executed, so their charts and numbers show where
the code is browsed; run this after changing a notebook or what it shows.
Each runs in a fresh kernel from this folder (as ``tests/test_notebooks.py``
runs them, which fails on any error). No per-cell timings are stored, so a
refresh changes only what the notebook prints and draws.
"""

from __future__ import annotations

import os
import pathlib
import sys

import nbclient
import nbformat

HERE = pathlib.Path(__file__).resolve().parent
NOTEBOOKS = sorted(HERE.glob('*.ipynb'))


def execute(path: pathlib.Path) -> nbformat.NotebookNode:
  """The notebook at ``path`` run top to bottom in a fresh kernel (raises
  ``nbclient.exceptions.CellExecutionError`` at the first failing cell).

  The kernel imports ``jaxpar`` from this checkout (first on its
  ``PYTHONPATH``), whichever one the environment has installed.
  """
  notebook = nbformat.read(path, as_version=4)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(HERE.parent)] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
  nbclient.NotebookClient(notebook, timeout=600, kernel_name='python3',
                          record_timing=False,
                          resources={'metadata': {'path': str(path.parent)}}
                          ).execute(env=env)
  return notebook


def main(argv: list[str]) -> int:
  for path in [pathlib.Path(p) for p in argv] or NOTEBOOKS:
    print(f'running {path.name} ...', flush=True)
    nbformat.write(execute(path), path)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
