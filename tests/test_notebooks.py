"""Every notebook runs top to bottom in a fresh kernel and carries no outputs."""

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / 'notebooks').glob('*.ipynb'))


@pytest.mark.parametrize('path', NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
  notebook = nbformat.read(path, as_version=4)
  # Committed notebooks are stripped: outputs could go stale against the code.
  assert not any(cell.get('outputs') for cell in notebook.cells
                 if cell.cell_type == 'code'), f'{path.name} has outputs'
  first_code = next(c for c in notebook.cells if c.cell_type == 'code')
  assert 'simulate_cpu_devices(8)' in first_code.source
  nbclient.NotebookClient(notebook, timeout=600, kernel_name='python3',
                          resources={'metadata': {'path': str(path.parent)}}
                          ).execute()
