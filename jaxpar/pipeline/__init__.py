"""Pipeline parallelism: schedules as data and the executor that runs them.

Two subpackages, and this one re-exports both:

* ``jaxpar.pipeline.schedules`` -- numpy only: build, validate, simulate,
  plot, search and balance schedules, and lay them out as a tick table;
* ``jaxpar.pipeline.executor`` -- JAX: run a schedule's tick table as one
  ``lax.scan`` inside one ``jax.shard_map``, and time a step (``timeline``):
  every rank's ticks as they ran (a ``Timeline``: where the time went, a Gantt
  chart next to the simulated one).

Example:
  >>> import jaxpar
  >>> s = jaxpar.pipeline.one_f_one_b(4, 8)
  >>> round(s.simulate().bubble_fraction, 3)
  0.273
"""

from jaxpar.pipeline import executor as executor
from jaxpar.pipeline import schedules as schedules
from jaxpar.pipeline.executor import *  # noqa: F401,F403 (its __all__)
from jaxpar.pipeline.schedules import *  # noqa: F401,F403 (its __all__)

__all__ = ['executor', 'schedules', *executor.__all__, *schedules.__all__]
