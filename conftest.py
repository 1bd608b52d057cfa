"""pytest setup for the tests and the doctests of every jaxpar module.

Eight simulated CPU devices, fixed before JAX starts (this file is imported
before any test or jaxpar module). Nothing else is given to the ``>>>``
examples: each imports what it uses and runs pasted into a fresh Python
after ``jaxpar.simulate_cpu_devices(8)``; each runs in a fresh directory.

One persistent compilation cache per run (``pytest_configure``), shared by
the test workers and every process they start (CLI runs, ``launch``ed
processes, notebook kernels): a program compiled twice in a run (the same
demo resumed, the kill drill's restart) is compiled once. Its key is the
program itself with the compiler and its options, so a hit is the executable
a fresh compile would make. JAX's default threshold stands: only programs
that take over a second to compile are stored (caching every tiny program
cost ~5% in files that repeat none). Set ``JAX_COMPILATION_CACHE_DIR`` to
keep one across runs.

XLA's CPU backend compiles with LLVM at optimisation level 0
(``--xla_backend_optimization_level=0``, appended to ``XLA_FLAGS``; a level
the user set is kept): the test programs are tiny, compiling them is most of
the suite's CPU time, and level 0 cuts about a fifth of it in the
compile-heavy files. The flag acts after
XLA's HLO passes, so what the tests measure in HLO is unchanged:
``memory_analysis()`` and the collective counts and bytes of the ZeRO,
pipeline and tensor-parallel steps are identical at both levels. Processes
the tests start (CLI runs, notebook kernels) inherit it, except the default
demo's (``tests/test_cli.py``: 150 steps, which run slower at level 0 than
they save in compiling).

The processes the tests start (notebook kernels, CLI runs, ``launch``ed
workers) also compile without XLA:CPU's MLIR fusion emitters
(``--xla_cpu_use_fusion_emitters=false``, set for each test by
``_child_xla_flags``; a value the user set is kept): emitting each fusion
through MLIR is about 40% of the CPU of compiling a pipeline step (the 3D
ZeRO-3 step of ``test_optimizers.py`` 19 -> 11.5 s; notebook 07 123 -> 87 s
of CPU, both measured side by side on 2 loaded cores). So do the test
processes themselves, per compile (``_fast_compiles`` wraps JAX's private
``jax._src.compiler.get_compile_options``, which every compile calls, so
the option reaches each as ``.compile(compiler_options=...)`` would give
it; their ``XLA_FLAGS`` were read when the backend started above;
``test_3d_2x2x2[0-None-3]`` with ``test_zero3_unrolled_stage_...`` 48.5 ->
32.9 s of CPU), except where the
compiled memory is the point: the older emitters fuse a little
differently, so a step's ``memory_analysis()`` temp bytes differ (231064
-> 223000 for that step), and the tests marked ``xla_defaults`` (the
planner's files and doctests, but ``_calibrate``'s, which only times
programs; each executor test that reads ``memory_analysis()`` or the
compiled HLO) compile as a user does (the calibration's doctest took 41 s
marked and 23 s not; ``tests/test_executor.py`` 67 s all marked, 58 s with
``-n 2`` now). What the others check
holds under either (parallel against one device compiled alike, float64
within 1e-10, resumes bit for bit, collectives in the HLO).
"""

import os
import shutil
import tempfile

_FLAGS = os.environ.get('XLA_FLAGS', '')
if 'xla_backend_optimization_level' not in _FLAGS:   # see the docstring
  os.environ['XLA_FLAGS'] = (
      f'{_FLAGS} --xla_backend_optimization_level=0'.strip())
import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 8)
jax.config.update('jax_platforms', 'cpu')

import pytest  # noqa: E402
from jax._src import compiler as _compiler  # noqa: E402  (_fast_compiles)

if jax.device_count() < 8:
  raise RuntimeError(
      f'jaxpar tests need 8 simulated CPU devices, got {jax.device_count()}: '
      'something started JAX before conftest.py ran.')


_CHILD_FLAG = '--xla_cpu_use_fusion_emitters=false'   # see the docstring
_CHILD_XLA_FLAGS = (os.environ['XLA_FLAGS']
                    if 'xla_cpu_use_fusion_emitters' in os.environ['XLA_FLAGS']
                    else f"{os.environ['XLA_FLAGS']} {_CHILD_FLAG}")


@pytest.fixture(autouse=True)
def _child_xla_flags(monkeypatch):
  """The processes a test starts compile without the fusion emitters (the
  module docstring); this process read its ``XLA_FLAGS`` at startup."""
  monkeypatch.setenv('XLA_FLAGS', _CHILD_XLA_FLAGS)


# The tests that compile as a user does (the module docstring): these files
# and folders, and each test marked ``xla_defaults``.
XLA_DEFAULTS = ('tests/test_planner', 'jaxpar/planner/')
# ... but for these, which time programs and read no compiled memory.
TIMES_ONLY = ('jaxpar/planner/_calibrate.py',)


@pytest.fixture(autouse=True)
def _fast_compiles(request, monkeypatch):
  """This process's compiles in the test go without the fusion emitters
  (an option a compile is given itself wins), but in ``xla_defaults``
  tests or where ``XLA_FLAGS`` names the option."""
  if (request.node.get_closest_marker('xla_defaults')
      or 'xla_cpu_use_fusion_emitters' in _FLAGS):
    return
  get = _compiler.get_compile_options

  def without_emitters(*args, env_options_overrides=None, **kwargs):
    return get(*args, env_options_overrides={
        'xla_cpu_use_fusion_emitters': False,
        **(env_options_overrides or {})}, **kwargs)
  monkeypatch.setattr(_compiler, 'get_compile_options', without_emitters)


@pytest.fixture(autouse=True)
def _doctest_directory(request):
  """Doctests run in a fresh directory: examples that write files
  (``to_csv('1f1b.csv')``, ``savefig``) leave the tree clean."""
  if isinstance(request.node, pytest.DoctestItem):
    request.getfixturevalue('monkeypatch').chdir(
        request.getfixturevalue('tmp_path'))


_CACHE = pytest.StashKey[str]()


def pytest_configure(config):
  """The run's compilation cache (see the module docstring): made by the
  controller before ``-n`` starts its workers, which inherit the variable."""
  config.addinivalue_line(
      'markers', 'xla_defaults: compiles in this process with XLA\'s default '
      'options (conftest.py: the fusion emitters on)')
  if os.environ.get('JAX_COMPILATION_CACHE_DIR'):   # the user's, or a worker
    return
  path = tempfile.mkdtemp(prefix='jaxpar-tests-jit-cache-')
  config.stash[_CACHE] = path
  os.environ['JAX_COMPILATION_CACHE_DIR'] = path
  jax.config.update('jax_compilation_cache_dir', path)


def pytest_unconfigure(config):
  if _CACHE in config.stash:
    shutil.rmtree(config.stash[_CACHE], ignore_errors=True)
    del os.environ['JAX_COMPILATION_CACHE_DIR']


# The files whose tests take minutes (a process or a kernel each, programs to
# compile), slowest first: run first, they overlap the many short tests.
SLOW_FIRST = ('tests/test_notebooks.py', 'tests/test_distributed.py',
              'tests/test_cli.py')


def pytest_collection_modifyitems(items):
  """The files of ``SLOW_FIRST`` first, in its order; each file's tests
  together and in their own order (module fixtures are made once per
  worker). The tests under ``XLA_DEFAULTS`` are marked ``xla_defaults``."""
  def rank(item):
    path = item.nodeid.split('::')[0]   # relative to the root directory
    return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)
  items.sort(key=rank)   # stable
  for item in items:
    if (item.nodeid.startswith(XLA_DEFAULTS)
        and not item.nodeid.startswith(TIMES_ONLY)):
      item.add_marker('xla_defaults')


def pytest_ignore_collect(collection_path, config):
  """Under tests/ only ``test_*.py`` are modules to import: the other scripts
  there (process workers, data exporters) are programs, and
  ``--doctest-modules`` would import them."""
  try:
    rel = collection_path.relative_to(config.rootpath)
  except ValueError:
    return None
  if (rel.suffix == '.py' and rel.parts[0] == 'tests'
      and not rel.name.startswith(('test_', 'conftest'))):
    return True
  return None
