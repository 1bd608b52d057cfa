"""The command line: ``python -m jaxpar demo | bench | launch``.

``demo`` trains the GPT on any mesh (``demo.main``), ``bench`` runs the
benchmarks (``bench.main``), ``launch`` starts local processes
(``jaxpar.distributed.launch``); ``text_data`` reads a text file as
byte-level training data for ``demo --data``.
"""

from jaxpar.cli import bench as bench
from jaxpar.cli import demo as demo
from jaxpar.cli import text_data as text_data
from jaxpar.cli._main import main as main

__all__ = ['bench', 'demo', 'main', 'text_data']
