"""The package's shape, read from its source (``ast``; nothing is imported
but the packages whose ``__all__`` is checked).

- no import circle among jaxpar's modules, at any level;
- ``jaxpar.pipeline.schedules`` imports no JAX: its modules and every jaxpar
  module they import use the standard library, numpy and (to draw)
  matplotlib only;
- the root holds at most 7 modules;
- no module imports another package's private module or name
  (``from jaxpar.X._y import`` or ``from jaxpar.X import _y`` outside
  ``jaxpar.X``); a package's own rooms and its ancestors' (the root's
  ``_compat``, ``_validate``) are its to use;
- every package's ``__init__`` lists its API in ``__all__`` and binds no
  other name (what packages share beyond their API is in their
  ``internal`` module);
- no public class name is defined in two modules;
- no function body (its code lines, without the docstring, blank lines and
  comments) is over 100 lines, no module over 600 lines, and the README
  has at most 250 lines.
"""

import ast
import collections
import importlib
import pathlib
import sys

import jaxpar

PACKAGE = pathlib.Path(jaxpar.__file__).parent
README = PACKAGE.parent / 'README.md'
ROOT_MODULES = 7
MAX_BODY_LINES = 100
MAX_MODULE_LINES = 600
MAX_README_LINES = 250
# What an ``__init__`` may bind besides its ``__all__``.
INIT_EXTRAS = {'__all__', '__version__', 'annotations'}
# What the schedules may import besides the standard library (matplotlib:
# only ``Schedule.plot``, imported inside it).
SCHEDULE_IMPORTS = {'numpy', 'matplotlib'}


def module_name(path):
  parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob('*.py'))}


def is_package(name):
  return MODULES[name].name == '__init__.py'


def absolute(node, package):
  """The module a ``from ... import`` in ``package`` names, relative
  imports resolved."""
  base = node.module or ''
  if not node.level:
    return base
  parts = package.split('.')[:len(package.split('.')) - node.level + 1]
  return '.'.join(parts + ([base] if base else []))


def imported(name, source, modules=MODULES):
  """Every name the module ``name`` imports, as ``(dotted name, line)``: top
  level, in functions, in ``if TYPE_CHECKING:`` blocks alike; relative
  imports resolved; ``from m import x`` is ``m.x`` when that is a module
  (or a private name: ``m._x``), else ``m``."""
  package = name if name in modules and is_package(name) else (
      name.rsplit('.', 1)[0])
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found += [(alias.name, node.lineno) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = absolute(node, package)
      for alias in node.names:
        sub = f'{base}.{alias.name}'
        private = alias.name.startswith('_') and base.startswith('jaxpar')
        found.append((sub if sub in modules or private else base,
                      node.lineno))
  return found


def imports(name):
  """The jaxpar modules ``name`` imports (a private name: its module's)."""
  found = set()
  for target, _ in imported(name, MODULES[name].read_text()):
    if target not in MODULES:
      target = target.rsplit('.', 1)[0]
    if target in MODULES and target != name:
      found.add(target)
  return found


def cycle(graph):
  """One import circle of ``graph`` as a list of modules, or ``None``."""
  state = {}

  def visit(node, path):
    state[node] = 'open'
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 'open':
        return path[path.index(nxt):] + [nxt]
      if nxt not in state and (found := visit(nxt, path + [nxt])):
        return found
    state[node] = 'done'
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node, [node])):
      return found
  return None


def private_imports(name, source):
  """``'line: name imports X (private to P)'`` for each import of a private
  module or name of a package ``P`` that is neither ``name``'s package nor
  one of its ancestors."""
  package = name if name in MODULES and is_package(name) else (
      name.rsplit('.', 1)[0])
  bad = []
  for target, line in imported(name, source):
    parts = target.split('.')
    if parts[0] != 'jaxpar':
      continue
    for i, part in enumerate(parts):
      if part.startswith('_') and not part.startswith('__'):
        owner = '.'.join(parts[:i])
        if not (package == owner or package.startswith(owner + '.')):
          bad.append(f'{line}: {name} imports {target} (private to {owner})')
        break
  return bad


def third_party(name):
  """The top-level packages outside jaxpar and the standard library that
  ``name`` imports."""
  tops = {m.split('.')[0] for m, _ in imported(name, MODULES[name].read_text())}
  return tops - {'jaxpar', '__future__'} - set(sys.stdlib_module_names)


def closure(names):
  """``names`` and every jaxpar module they import, transitively."""
  seen, todo = set(), list(names)
  while todo:
    name = todo.pop()
    if name not in seen:
      seen.add(name)
      todo += imports(name)
  return seen


def body_lines(node, lines):
  """Code lines of a function's body: no docstring, blank line or comment."""
  body = node.body
  if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)):
    body = body[1:]
  if not body:
    return 0
  return sum(1 for line in lines[body[0].lineno - 1:node.end_lineno]
             if line.strip() and not line.strip().startswith('#'))


def top_level(source):
  """The statements of a module's top level, with those in its ``if`` /
  ``try`` / ``with`` / loop blocks (not those in functions or classes)."""
  todo = list(ast.parse(source).body)
  while todo:
    node = todo.pop(0)
    yield node
    for field in ('body', 'orelse', 'finalbody', 'handlers'):
      if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                               ast.ClassDef)):
        todo += getattr(node, field, [])


def bound_names(package, source, star=lambda module: ()):
  """Every ``(name, line)`` the top level of ``package``'s ``__init__``
  binds: imported names (``as`` names; a plain ``import a.b`` binds ``a``),
  assigned names, functions and classes; ``from m import *`` binds
  ``star(m)`` (the names of ``m.__all__``)."""
  found = []
  for node in top_level(source):
    if isinstance(node, ast.Import):
      found += [(a.asname or a.name.split('.')[0], node.lineno)
                for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = absolute(node, package)
      for a in node.names:
        names = star(base) if a.name == '*' else [a.asname or a.name]
        found += [(n, node.lineno) for n in names]
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                           ast.ClassDef)):
      found.append((node.name, node.lineno))
    elif isinstance(node, ast.ExceptHandler) and node.name:
      found.append((node.name, node.lineno))
    else:
      targets = {ast.Assign: lambda n: n.targets,
                 ast.AnnAssign: lambda n: [n.target],
                 ast.AugAssign: lambda n: [n.target],
                 ast.For: lambda n: [n.target],
                 ast.With: lambda n: [i.optional_vars for i in n.items
                                      if i.optional_vars]}.get(type(node))
      for target in targets(node) if targets else ():
        found += [(n.id, node.lineno) for n in ast.walk(target)
                  if isinstance(n, ast.Name)]
  return sorted(found, key=lambda found: found[1])


def unlisted_bindings(package, source, listed, star=lambda module: ()):
  """``'line: name'`` for each name the ``__init__`` of ``package`` binds
  that is neither in ``listed`` (its ``__all__``) nor in ``INIT_EXTRAS``."""
  allowed = set(listed) | INIT_EXTRAS
  return [f'{line}: {name}' for name, line in
          bound_names(package, source, star) if name not in allowed]


def duplicate_classes(sources):
  """``{class name: [modules]}`` for each public class (its name not
  starting with ``_``) defined at the top level of more than one of
  ``sources`` (``{module: source}``)."""
  where = collections.defaultdict(list)
  for name, source in sorted(sources.items()):
    for node in top_level(source):
      if isinstance(node, ast.ClassDef) and not node.name.startswith('_'):
        where[node.name].append(name)
  return {cls: names for cls, names in where.items() if len(names) > 1}


def too_long(texts, limit):
  """``'name: n lines'`` for each of ``texts`` (``{name: text}``) that has
  more than ``limit`` lines."""
  counts = {name: len(text.splitlines()) for name, text in texts.items()}
  return [f'{name}: {n} lines' for name, n in sorted(counts.items())
          if n > limit]


# -- the checkers can fail ---------------------------------------------------


def test_cycle_finder_finds_a_circle():
  assert cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
  assert cycle({'a': {'b'}, 'b': set()}) is None


def test_private_import_finder_finds_them():
  name = 'jaxpar.parallel._trainer'
  assert private_imports(name, 'from jaxpar.pipeline.executor._jaxpr import '
                         'flatten') == [
      '1: jaxpar.parallel._trainer imports jaxpar.pipeline.executor._jaxpr '
      '(private to jaxpar.pipeline.executor)']
  assert private_imports(name, 'from jaxpar.pipeline import _helper') == [
      '1: jaxpar.parallel._trainer imports jaxpar.pipeline._helper '
      '(private to jaxpar.pipeline)']
  assert private_imports(name, 'from ..data_parallel import _specs')
  # Its own package's rooms, the root's shared ones, public names: allowed.
  assert not private_imports(name, 'from jaxpar.parallel import _params\n'
                             'from . import _placement\n'
                             'from jaxpar._validate import check_int\n'
                             'from jaxpar.pipeline import executor\n'
                             'import jaxpar._compat')


def test_the_jax_finder_sees_jax():
  """The executor's modules import JAX: the check below would see it."""
  assert 'jax' in third_party('jaxpar.pipeline.executor._tick_scan')


def test_binding_finder_finds_names_outside_all():
  source = ('"""Doc."""\n'
            'from __future__ import annotations\n'
            'from jaxpar.x._a import f as f\n'
            'from jaxpar.x._b import g as g   # shared with another package\n'
            'import os.path\n'
            'from . import _c as c\n'
            'HELPER, (OTHER, _X) = 1, (2, 3)\n'
            'def main(): pass\n'
            'class Error(Exception): pass\n'
            'try:\n  import numpy as np\nexcept ImportError as e:\n  np = None\n'
            'from jaxpar.y import *\n'
            "__all__ = ['f', 'main']\n"
            "__version__ = '1'\n")
  star = lambda module: ['h', 'f'] if module == 'jaxpar.y' else []
  assert unlisted_bindings('jaxpar.x', source, ['f', 'main'], star) == [
      '4: g', '5: os', '6: c', '7: HELPER', '7: OTHER', '7: _X',
      '9: Error', '11: np', '12: e', '13: np', '14: h']
  # Re-exporting exactly __all__, through a star import too: nothing.
  assert not unlisted_bindings('jaxpar.x', 'from jaxpar.x._a import f as f\n'
                               'from ._b import *\n__all__ = ["f", "h"]\n',
                               ['f', 'h'], lambda module: ['h'])


def test_duplicate_class_finder_finds_them():
  sources = {'jaxpar.a': 'class Plan:\n  class Inner: pass\nclass _Run: pass',
             'jaxpar.b': 'from typing import NamedTuple\n'
                         'class Plan(NamedTuple):\n  x: int\n'
                         'class _Run: pass\nclass Inner: pass',
             'jaxpar.c': 'def f():\n  class Plan: pass\n'}
  # Private and nested classes (Inner inside a.Plan, c's local) do not count.
  assert duplicate_classes(sources) == {'Plan': ['jaxpar.a', 'jaxpar.b']}
  assert not duplicate_classes({'jaxpar.a': 'class A: pass',
                                'jaxpar.b': 'class B: pass'})


def test_line_counter_finds_long_texts():
  texts = {'long.py': 'x = 1\n' * 601, 'short.py': 'x = 1\n' * 600,
           'README.md': '# jaxpar\n' * 251}
  assert too_long(texts, 600) == ['long.py: 601 lines']
  assert too_long({'README.md': texts['README.md']}, 250) == [
      'README.md: 251 lines']


# -- the properties ------------------------------------------------------------


def test_no_import_circle():
  graph = {name: imports(name) for name in MODULES}
  assert len(graph) > 60 and graph['jaxpar.pipeline.schedules._action'] == {
      'jaxpar._validate'}
  assert cycle(graph) is None, f'import circle: {" -> ".join(cycle(graph))}'


def test_schedules_import_no_jax():
  schedules = [n for n in MODULES
               if n.startswith('jaxpar.pipeline.schedules')]
  assert len(schedules) >= 12
  used = {name: third_party(name) - SCHEDULE_IMPORTS
          for name in sorted(closure(schedules))}
  assert not any(used.values()), {n: u for n, u in used.items() if u}


def test_root_holds_at_most_7_modules():
  root = sorted(p.name for p in PACKAGE.glob('*.py'))
  assert len(root) <= ROOT_MODULES, root


def test_no_module_imports_another_packages_private_module():
  bad = [f'{MODULES[name].relative_to(PACKAGE.parent)}:{line}'
         for name in MODULES
         for line in private_imports(name, MODULES[name].read_text())]
  assert not bad, '\n'.join(bad)


def test_every_package_lists_its_api_in_all():
  packages = sorted(n for n in MODULES if is_package(n))
  assert len(packages) >= 12
  for name in packages:
    module = importlib.import_module(name)
    assert isinstance(getattr(module, '__all__', None), list), (
        f'{name} defines no __all__')
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f'{name}.__all__ names what it lacks: {missing}'


def test_every_init_binds_only_its_all():
  """What other packages need beyond the API is in an ``internal`` module,
  not bound in the ``__init__`` below its ``__all__``."""
  packages = sorted(n for n in MODULES if is_package(n))
  star = lambda module: importlib.import_module(module).__all__
  bad = []
  for name in packages:
    listed = importlib.import_module(name).__all__
    bad += [f'{MODULES[name].relative_to(PACKAGE.parent)}:{line}' for line in
            unlisted_bindings(name, MODULES[name].read_text(), listed, star)]
  assert not bad, '\n'.join(bad)


def test_every_internal_module_lists_its_names():
  internals = [n for n in MODULES if n.endswith('.internal')]
  assert {'jaxpar.data_parallel.internal', 'jaxpar.train_state.internal',
          'jaxpar.pipeline.executor.internal'} <= set(internals)
  for name in internals:
    module = importlib.import_module(name)
    doc = ' '.join(module.__doc__.lower().split())
    assert "for jaxpar's other packages" in doc and 'not api' in doc, name
    bound = {n for n, _ in bound_names(name, MODULES[name].read_text())}
    assert sorted(bound - INIT_EXTRAS) == sorted(module.__all__), name


def test_no_public_class_name_defined_twice():
  twice = duplicate_classes({name: path.read_text()
                             for name, path in MODULES.items()})
  assert not twice, twice


def test_no_module_over_600_lines():
  long = too_long({str(path.relative_to(PACKAGE.parent)): path.read_text()
                   for path in MODULES.values()}, MAX_MODULE_LINES)
  assert not long, '\n'.join(long)


def test_readme_at_most_250_lines():
  long = too_long({'README.md': README.read_text()}, MAX_README_LINES)
  assert not long, long


def test_no_function_body_over_100_lines():
  long = []
  for path in MODULES.values():
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = body_lines(node, lines)
        if n > MAX_BODY_LINES:
          long.append(f'{path.relative_to(PACKAGE.parent)}:{node.lineno} '
                      f'{node.name}: {n} lines')
  assert not long, '\n'.join(long)
