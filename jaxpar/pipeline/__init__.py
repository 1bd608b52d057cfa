"""Pipeline parallelism: schedules as data and the executor that runs them."""

from jaxpar.pipeline.schedule import Action as Action
from jaxpar.pipeline.schedule import Schedule as Schedule
