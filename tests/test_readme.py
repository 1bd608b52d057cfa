"""Every ``python`` example of the README runs as written, in a fresh namespace.

Each block imports what it uses (nothing comes from this file or conftest),
runs in a fresh directory (examples write ``1f1b.csv`` and ``ckpt/``) and
checks its own results against the one-device model where it says so.
"""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).parent.parent / 'README.md'


def _blocks() -> list[tuple[str, str]]:
  """(section heading, code) of every python block, in order; the code is
  padded with blank lines so that tracebacks give README's line numbers."""
  text, out = README.read_text(), []
  for block in re.finditer(r'```python\n(.*?)```', text, re.S):
    before = text[:block.start(1)]
    headings = re.findall(r'^## (.*)$', before, re.M)
    out.append((headings[-1] if headings else '',
                '\n' * before.count('\n') + block.group(1)))
  return out


BLOCKS = _blocks()


def test_readme_has_examples():
  assert len(BLOCKS) >= 7, [h for h, _ in BLOCKS]


@pytest.mark.parametrize('code', [c for _, c in BLOCKS],
                         ids=[re.sub(r'\W+', '_', h).strip('_').lower()
                              for h, _ in BLOCKS])
def test_example_runs_as_written(code, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  exec(compile(code, str(README), 'exec'), {'__name__': '__readme__'})  # pylint: disable=exec-used
