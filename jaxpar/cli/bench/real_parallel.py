"""Pipelining where ranks really run in parallel: N processes on N cores.

Simulated devices that share cores measure total work only. This section
runs ``N`` processes (default 2) joined by ``jax.distributed`` with gloo
collectives (``jaxpar.distributed.launch`` with ``cores_per_process=1``),
each with one CPU device and all its threads on its own core: real N-way
parallel hardware with real communication. Each process computes on one
thread (``ONE_THREAD``, and its backend started while pinned: XLA sizes its
intra-op pool by the cores a process may use; more threads would only spin
on the same core); the ``_unpinned`` sections then let the OS place the
threads on all the ranks' cores (before 0.18.1 their backends started
unpinned, with two compute threads each: ``one core, sequential`` ran on
two).

The model: ``L = 8`` residual layers ``x <- x + tanh(x @ w_k)`` (the
``gelu`` variant: ``x + gelu(x @ w_k)``), weights stacked ``[L, D, D]``, then
a linear head and a mean squared error. A schedule with ``S`` stages gets
``L / S`` layers per stage, sliced out of a ``[L/S, D, D]`` leaf inside the
stage function (as a GPT stage does), so interleaved and V schedules run the
same model. The batch is ``m`` microbatches of ``microbatch`` rows.

Sections of ``python -m jaxpar bench --only real_parallel``:

* ``real_parallel`` (tanh, ``D = 512``) and ``real_parallel_gelu`` (gelu,
  ``D = 384``, microbatch 96, ``m = 12``): 2 ranks, the rows below; GPipe,
  1F1B and ZB-H1 (``TARGETS``) also run under ``jaxpar.pipeline.timeline``;
* ``real_parallel_unpinned`` and ``real_parallel_gelu_unpinned``: the same
  with the processes not pinned, for ``TARGETS`` only;
* ``real_parallel_targets``: the four settings above side by side, one row
  each, with the measures the targets are set on (``GOALS``): ZB-H1's and
  GPipe's speed over 1F1B's (``vs_1f1b``) and 1F1B's efficiency over data
  parallelism's (``eff_vs_dp``), and how many of them are met;
* ``one_core``: the executor's own cost, no messages: one rank (``p = 1``)
  pinned to one core, 4 gelu layers (``D = 384``, microbatch 96, ``m = 8``),
  GPipe, 1F1B and ZB-H1 with each stash policy against the sequential
  microbatches, in process CPU time (``cpu_ratio``); and
  ``parallel.trainer`` with one pipeline stage against
  ``data_parallel.trainer`` for the same model and batch (embed, the 4
  layers, head; Adam; ``m = 8`` microbatches accumulated by both).

Rows, timed in rotated rounds after a warm-up, each step started by all
ranks together after a barrier (rank 0's median wall and CPU time; every
ratio below is the median over rounds of that round's ratio, so that load
which comes and goes over a run falls on both steps of a ratio alike):

* ``one core, sequential``: the same ``m`` microbatches one after the other
  on one pinned core (``lax.scan`` of ``value_and_grad`` of the whole model,
  gradients accumulated) -- speed-up 1.00 by definition;
* every schedule constructor that ``jaxpar.pipeline`` defines (GPipe, 1F1B,
  interleaved 1F1B with ``v = 2``, ZB-H1, ZB-V, ...) through
  ``pipeline_value_and_grad`` on the mesh ``stage=N`` (for interleaved and V
  schedules that includes permuting the stage params and grads between model
  order and rank order every step, as ``pipeline_value_and_grad`` does);
  with ``input_grads=False``: no step computes the inputs' cotangent;
* ``data parallel``: the honest contrast, mesh ``data=N``, each rank running
  ``m/N`` of the microbatches sequentially, then one gradient ``pmean``.
* ``one message``: 32 ``ppermute``s of one activation ``[mb, D]`` in turn
  around the ranks, and a scalar ``psum``: the cost of one collective over
  gloo between the pinned ranks (``median_ms`` is the 33 of them).

Columns: ``speedup`` = baseline (``vs``: the sequential step) wall time /
this time; ``ideal`` = total work / ``Schedule.simulate(costs).makespan``
with costs ``F=1, B=2, I=W=1`` (``N`` for data parallelism); ``efficiency``
= speedup / ideal; ``p10_ms`` and ``p90_ms`` the 10th and 90th percentiles of
the step's wall time over the rounds (the machine's noise: a target is met
or missed by chance where it sits inside it); ``cpu_ratio`` = this CPU time
/ the baseline's (rank 0's
process: with ``N > 1`` ranks it includes time spent waiting in gloo);
``policy`` the stash policy; ``cores`` the cores the ranks ran on; for
pipelines, ``eff_vs_dp`` = efficiency / data parallelism's (DP's time /
this time x DP's ideal / this ideal) and ``vs_1f1b`` = speed-up / 1F1B's
with the same policy (1F1B's time / this time); the targets: 1F1B and ZB-H1
at ``eff_vs_dp >= 0.95``, ZB-H1 ``vs_1f1b >= 0.97``, GPipe ``>= 0.9``,
interleaved and V within 10%. ``messages`` = the collectives over the
pipeline axis in one step (``ppermute``s, the final ``psum``) and
``comm_ms`` = ``messages`` times one message's cost;
``pinned`` whether the threads were pinned. A pipeline run under a timeline
adds where
its time went, per step, mean over the ranks (``jaxpar.pipeline.Timeline``):
``compute_ms`` (the blocks), ``messages_ms`` (the ticks' collectives once
every rank reached them), ``waiting_ms`` (for the last rank to reach them;
``bubble_ms`` of it on idle ticks), ``overhead_ms`` (between ticks),
``outside_ms`` (before the first tick and after the last rank's last
tick), which add up to
``timeline_ms``, the step's time under the timeline (its host callbacks
included: compare with ``median_ms``). With
fewer usable cores than ranks the section is one ``skipped`` row; a run that
fails or times out (all processes are killed) is one ``failed`` row, its
output on stderr.
"""

from __future__ import annotations

import json
import os
import tempfile

from jaxpar import distributed

WORKER = 'jaxpar.cli.bench._real_parallel_worker'
VARIANTS = ('tanh', 'gelu')   # the worker's layer kinds
# The executor's own cost (section ``one_core``): the stash policies timed.
BENCH_REMAT_POLICIES = ('everything', 'dots', 'nothing')
# The schedules with targets, run under a timeline and timed unpinned too.
TARGETS = ('gpipe', 'one_f_one_b', 'zero_bubble_h1')
# The targets (issue 43): (step, column of its row, least value) per setting.
GOALS = (('ZB-H1', 'vs_1f1b', 0.97), ('GPipe', 'vs_1f1b', 0.9),
         ('1F1B', 'eff_vs_dp', 0.95))
# One compute thread per process: on a core of its own, XLA's intra-op pool
# only adds threads that spin and switch on that core (a message between
# pinned ranks took 1.7 ms with it, a fraction of that without).
ONE_THREAD = '--xla_cpu_multi_thread_eigen=false'


def _check_sizes(**sizes: int) -> None:
  for name, value in sizes.items():
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'real_parallel.measure: {name}={value!r} must be an '
                       'int >= 1.')


def measure(*, num_processes: int = 2, layers: int = 8, width: int = 512,
            microbatch: int = 128, num_microbatches: int = 8,
            repeats: int = 10, warmup: int = 2,
            timeout: float = 1200.0, variant: str = 'tanh',
            schedules: list[str] | None = None,
            policies: list[str] | None = None, data_parallel: bool = True,
            stage1: bool = False, timeline: list[str] | None = None,
            pinned: bool = True, xla_flags: str = '') -> list[dict]:
  """Times every schedule on ``num_processes`` pinned cores (see the module).

  Args:
    num_processes: ``N``, the ranks (processes, cores, devices).
    layers: ``L``, residual tanh layers in the model; schedules whose number
      of stages does not divide it get a ``note`` row instead.
    width: ``D``, the features.
    microbatch: rows per microbatch.
    num_microbatches: ``m``; the batch is ``m * microbatch`` rows.
    repeats: timed rounds (the medians are reported).
    warmup: untimed steps first (the first one compiles).
    timeout: seconds before all processes are killed (a ``failed`` row).
    variant: the layers, ``'tanh'`` or ``'gelu'``.
    schedules: constructor names of ``jaxpar.pipeline`` to time (e.g.
      ``['one_f_one_b']``); ``None``: all of them.
    policies: stash policies (``remat_policy`` names) to time each schedule
      with; ``None``: the executor's default, ``'dots'``.
    data_parallel: also time data parallelism.
    stage1: also time ``parallel.trainer`` with one stage against
      ``data_parallel.trainer``.
    timeline: constructor names whose step (first policy) also runs under
      ``jaxpar.pipeline.timeline``: its row gets the ``<part>_ms`` columns
      (compute, messages, waiting, bubble, overhead, outside; ms per step,
      mean over the ranks) and ``timeline_ms``.
    pinned: pin each process's threads to its core; ``False``: the OS
      places them (``cores`` then only counts them).
    xla_flags: appended to each process's ``XLA_FLAGS`` (e.g.
      ``'--xla_cpu_multi_thread_eigen=false'``: one compute thread).

  Returns:
    Rows of ``step, policy, ranks, stages, m, width, microbatch, layers,
    variant, median_ms, p10_ms, p90_ms, cpu_ms, speedup, ideal, efficiency,
    cpu_ratio, vs, cores`` (pipelines: and ``eff_vs_dp``, ``vs_1f1b``;
    those under a timeline: the split), all with ``pinned``; or one
    ``skipped`` / ``failed`` row with a ``note``.

  Raises:
    ValueError: a size that is not an int >= 1, ``timeout <= 0`` or an
      unknown variant.

  Example:
    >>> from jaxpar.cli.bench import real_parallel
    >>> rows = real_parallel.measure(width=64, microbatch=8)  # doctest: +SKIP
    >>> [row['step'] for row in rows][:3]   # doctest: +SKIP
    ['one core, sequential', 'GPipe', '1F1B']
  """
  _check_sizes(num_processes=num_processes, layers=layers, width=width,
               microbatch=microbatch, num_microbatches=num_microbatches,
               repeats=repeats, warmup=warmup)
  if not timeout > 0:
    raise ValueError(f'real_parallel.measure: timeout={timeout!r} must be > 0 '
                     'seconds.')
  if variant not in VARIANTS:
    raise ValueError(f'real_parallel.measure: variant={variant!r} is not one '
                     f'of {VARIANTS}.')
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < num_processes:
    return [{'step': 'skipped', 'ranks': num_processes, 'note': (
        f'{len(cores)} core(s) usable by this process (os.sched_getaffinity), '
        f'{num_processes} ranks need one each')}]
  with tempfile.TemporaryDirectory() as tmp:
    config = {'out': os.path.join(tmp, 'rows.json'),
              'cores': cores[:num_processes], 'layers': layers,
              'width': width, 'microbatch': microbatch,
              'num_microbatches': num_microbatches, 'repeats': repeats,
              'warmup': warmup, 'variant': variant, 'schedules': schedules,
              'policies': policies, 'data_parallel': data_parallel,
              'stage1': stage1, 'timeline': timeline, 'pinned': pinned,
              'xla_flags': xla_flags}
    try:
      code = distributed.launch(num_processes, [json.dumps(config)],
                                devices_per_process=1, module=WORKER,
                                timeout=timeout, cores_per_process=1)
    except TimeoutError as e:
      return [{'step': 'failed', 'ranks': num_processes, 'note': str(e)}]
    if code != 0:
      return [{'step': 'failed', 'ranks': num_processes, 'note': (
          f'a rank exited with code {code}; its output is on stderr')}]
    with open(config['out']) as f:
      return json.load(f)


def run(*, quick: bool) -> dict[str, list[dict]]:
  """The sections of the module doc (quick: smaller, fewer repeats)."""
  times = (dict(repeats=5, warmup=1, timeout=600) if quick else
           dict(repeats=25, warmup=2))
  tanh = (dict(width=256, microbatch=64) if quick else
          dict(width=512, microbatch=128))
  gelu = dict(variant='gelu', width=384, microbatch=96,
              num_microbatches=8 if quick else 12)
  if quick:
    gelu.update(width=192, microbatch=48)
  one_core = dict(num_processes=1, layers=4, width=384, microbatch=96,
                  num_microbatches=8, variant='gelu',
                  policies=list(BENCH_REMAT_POLICIES),
                  schedules=list(TARGETS), data_parallel=False, stage1=True)
  pinned = dict(timeline=list(TARGETS), xla_flags=ONE_THREAD, **times)
  unpinned = dict(pinned, schedules=list(TARGETS), pinned=False)
  sections = {'real_parallel': measure(**tanh, **pinned),
              'real_parallel_gelu': measure(**gelu, **pinned),
              'real_parallel_unpinned': measure(**tanh, **unpinned),
              'real_parallel_gelu_unpinned': measure(**gelu, **unpinned)}
  return {**sections, 'real_parallel_targets': targets(sections),
          'one_core': measure(**one_core, xla_flags=ONE_THREAD, **times)}


def targets(sections: dict[str, list[dict]]) -> list[dict]:
  """One row per section of ``measure`` rows: each ``GOALS`` measure (``None``
  where its row is missing, e.g. a failed run) and ``met``, how many reach
  their least value.

  Example:
    >>> from jaxpar.cli.bench.real_parallel import targets
    >>> rows = [{'step': 'ZB-H1', 'vs_1f1b': 0.98, 'variant': 'gelu',
    ...          'pinned': True}, {'step': 'GPipe', 'vs_1f1b': 0.85},
    ...         {'step': '1F1B', 'eff_vs_dp': 1.02}]
    >>> targets({'real_parallel_gelu': rows})[0]['met']
    '2/3'
  """
  out = []
  for name, rows in sections.items():
    by_step = {row['step']: row for row in rows}
    row = {'section': name, 'variant': rows[0].get('variant'),
           'pinned': rows[0].get('pinned')}
    met = 0
    for step, column, least in GOALS:
      value = by_step.get(step, {}).get(column)
      row[f'{step} {column}'] = value
      met += value is not None and value >= least
    out.append({**row, 'met': f'{met}/{len(GOALS)}'})
  return out
