"""``python -m jaxpar demo|bench|launch ...`` (``jaxpar.cli``)."""

import sys

from jaxpar.cli import main

if __name__ == '__main__':
  sys.exit(main())
