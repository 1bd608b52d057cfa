"""The command line: ``python -m jaxpar demo | bench | launch | plan``.

``demo`` trains the GPT on any mesh (``demo.main``; its flags in
``demo_args``), ``bench`` runs the benchmarks (``bench.main``), ``launch``
starts local processes (``jaxpar.distributed.launch``), ``plan`` ranks the
layouts for N devices (``plan.main``, ``jaxpar.plan``); ``text_data`` reads
a text file as byte-level training data for ``demo --data``.
"""

from jaxpar.cli import bench as bench
from jaxpar.cli import demo as demo
from jaxpar.cli import demo_args as demo_args
from jaxpar.cli import plan as plan
from jaxpar.cli import text_data as text_data
from jaxpar.cli._main import main as main

__all__ = ['bench', 'demo', 'demo_args', 'main', 'plan', 'text_data']
