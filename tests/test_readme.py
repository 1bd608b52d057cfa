"""Every ``python`` example of the README and of docs/guide.md runs as
written, in a fresh namespace.

Each block imports what it uses (nothing comes from this file or conftest),
runs in a fresh directory (examples write ``1f1b.csv`` and ``ckpt/``) and
checks its own results against the one-device model where it says so.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / 'README.md'
PAGES = (README, ROOT / 'docs' / 'guide.md')


def _blocks(page: pathlib.Path) -> list[tuple[str, str]]:
  """(section heading, code) of every python block of ``page``, in order;
  the code is padded with blank lines so that tracebacks give the page's
  line numbers."""
  text, out = page.read_text(), []
  for block in re.finditer(r'```python\n(.*?)```', text, re.S):
    before = text[:block.start(1)]
    headings = re.findall(r'^## (.*)$', before, re.M)
    out.append((headings[-1] if headings else '',
                '\n' * before.count('\n') + block.group(1)))
  return out


BLOCKS = [(page, heading, code) for page in PAGES
          for heading, code in _blocks(page)]


def test_readme_has_examples():
  assert len(_blocks(README)) >= 7, [h for h, _ in _blocks(README)]


@pytest.mark.parametrize(
    'page,code', [(page, code) for page, _, code in BLOCKS],
    ids=[re.sub(r'\W+', '_', f'{page.stem} {heading}').strip('_').lower()
         for page, heading, _ in BLOCKS])
def test_example_runs_as_written(page, code, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  exec(compile(code, str(page), 'exec'), {'__name__': '__readme__'})  # pylint: disable=exec-used
