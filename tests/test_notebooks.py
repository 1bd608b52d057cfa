"""Every notebook runs top to bottom in a fresh kernel, and is committed
executed: the outputs of one run from the top (``notebooks/refresh.py``)."""

import importlib.util
import pathlib

import nbformat
import pytest

_REFRESH = pathlib.Path(__file__).parent.parent / 'notebooks' / 'refresh.py'
_spec = importlib.util.spec_from_file_location('refresh', _REFRESH)
refresh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refresh)



@pytest.mark.parametrize('path', refresh.NOTEBOOKS,
                         ids=[p.name for p in refresh.NOTEBOOKS])
def test_notebook_runs(path):
  """The kernel inherits the run's XLA flags (``conftest.py``: LLVM level 0,
  ~35% less compile CPU for a 3D GPT step, 16.9 -> 10.4 s; no fusion
  emitters in started processes, notebook 07 123 -> 87 s of CPU); what the
  notebooks assert holds under either (parallel against one device compiled
  alike, memory from buffer assignment). The committed outputs come from
  ``refresh.py`` at XLA's defaults."""
  notebook = nbformat.read(path, as_version=4)
  code = [c for c in notebook.cells if c.cell_type == 'code']
  assert 'simulate_cpu_devices(8)' in code[0].source
  # Committed executed, in order, in one kernel: refresh.py's output.
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
      f'{path.name}: run python notebooks/refresh.py {path.name}')
  assert any(c.outputs for c in code)
  refresh.execute(path)
