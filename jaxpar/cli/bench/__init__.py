"""``python -m jaxpar bench [--quick] [--json PATH]``: every benchmark section.

Each module ``jaxpar/cli/bench/<topic>.py`` defines ``run(*, quick) ->
{section: [row, ...]}`` with rows of JSON scalars; the runner (``main``,
in ``_runner``) prints each section as a markdown table (``markdown_table``)
and writes them all to JSON.
"""

from jaxpar.cli.bench._runner import main as main
from jaxpar.cli.bench._runner import markdown_table as markdown_table

__all__ = ['main', 'markdown_table']
