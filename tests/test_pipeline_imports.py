"""The pipeline modules import each other without a circle, at any level."""

import ast
import pathlib

import jaxpar

PACKAGE = pathlib.Path(jaxpar.__file__).parent


def module_name(path):
  parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def imports(path, modules):
  """Every jaxpar module ``path`` imports: top level, in functions, in
  ``if TYPE_CHECKING:`` blocks alike (``from pkg import sub`` is ``pkg.sub``)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        sub = f'{node.module}.{alias.name}'
        found.add(sub if sub in modules else node.module)
  return {name for name in found if name in modules}


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


def test_cycle_finder_finds_a_circle():
  assert cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
  assert cycle({'a': {'b'}, 'b': set()}) is None


def test_no_import_circle_in_the_pipeline_package():
  paths = {module_name(p): p for p in (PACKAGE / 'pipeline').glob('*.py')}
  # An ``__init__`` that re-exports its submodules is not part of a circle.
  graph = {name: imports(path, paths) - {'jaxpar.pipeline'}
           for name, path in paths.items() if name != 'jaxpar.pipeline'}
  assert set(graph) >= {'jaxpar.pipeline.schedule', 'jaxpar.pipeline.simulate',
                        'jaxpar.pipeline.plot', 'jaxpar.pipeline._action'}
  assert cycle(graph) is None, f'import circle: {" -> ".join(cycle(graph))}'
  assert graph['jaxpar.pipeline._action'] == set()

