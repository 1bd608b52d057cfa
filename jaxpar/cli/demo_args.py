"""The demo's command line: ``python -m jaxpar demo``'s flags, their checks
(each error names the flag, the rule and the fix) and the schedule they
choose."""

from __future__ import annotations

import argparse
import math

from jaxpar import pipeline


# Model defaults: (synthetic task, --data text). The text model learns
# below the unigram entropy in a few minutes on 2 CPU cores (docs/text.md).
DEFAULTS = {'seq_len': (16, 64), 'heads': (8, 4),
            'eval_every': (None, 50)}
# --schedule NAME is jaxpar.pipeline.NAME(p, m) (interleaved_one_f_one_b with
# --virtual-stages v), or the fastest under --memory-limit (auto).
SCHEDULES = (*pipeline.STAGES_PER_RANK, 'auto')


class _Parser(argparse.ArgumentParser):
  """Bad flags: one line on stderr and exit code 2, no usage dump."""

  def error(self, message):
    self.exit(2, f'{self.prog}: error: {message}\n')


def _mesh_flag(text: str) -> dict[str, int]:
  sizes = {}
  for part in text.split(','):
    name, _, value = part.partition('=')
    if name not in ('data', 'stage', 'tensor') or not value.isdigit() or int(
        value) < 1:
      raise argparse.ArgumentTypeError(
          f'--mesh {text!r}: use data=D,stage=S,tensor=T with positive sizes')
    sizes[name] = int(value)
  return {k: sizes.get(k, 1) for k in ('data', 'stage', 'tensor')}


def parse_args(argv: list[str] | None
               ) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
  """``(args, parser)``: the flags, defaults filled in, checked in order.

  A bad flag exits with code 2 and one line on stderr naming the rule and
  the fix (``parser.error``), before any JAX work.
  """
  p = _Parser(prog='python -m jaxpar demo', description=__doc__.splitlines()[0])
  for add in (_add_pipeline_flags, _add_model_flags, _add_text_flags,
              _add_run_flags, _add_training_flags, _add_process_flags):
    add(p)
  args = p.parse_args(argv)
  if isinstance(args.mesh, str):
    args.mesh = _mesh_flag(args.mesh)
  for name, values in DEFAULTS.items():
    if getattr(args, name) is None:
      setattr(args, name, values[args.data is not None])
  for check in _CHECKS:
    message = check(args)
    if message:
      p.error(message)
  return args, p


def _add_pipeline_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument('--mesh', type=_mesh_flag, default='data=2,stage=2,tensor=2',
                 help='mesh sizes; uses the first D*S*T devices')
  p.add_argument('--schedule', choices=SCHEDULES, default='one_f_one_b',
                 help='a jaxpar.pipeline constructor, or auto (search)')
  p.add_argument('--microbatches', type=int, default=4)
  p.add_argument('--virtual-stages', type=int, default=2,
                 help='stages per rank for --schedule interleaved_one_f_one_b')
  p.add_argument('--memory-limit', type=float, metavar='X',
                 help='--schedule auto: the fastest schedule holding at most '
                 'X stages of activations per rank (1F1B needs stage=S)')
  p.add_argument('--plan', action='store_true',
                 help="train on jaxpar.plan's best layout for the devices "
                 '(sets --mesh, --schedule, --microbatches, --zero)')


def _add_model_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument('--steps', type=int, default=150)
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--seq-len', type=int, help='tokens per sequence (default '
                 '16; 64 with --data)')
  p.add_argument('--d-model', type=int, default=64, help='model width')
  p.add_argument('--heads', type=int, help='attention heads (default 8; 4 '
                 'with --data)')


def _add_text_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument('--data', metavar='PATH', help='train on the bytes of this '
                 'text file (vocab 256); its last 10%% is held out')
  p.add_argument('--eval-every', type=int, metavar='N', help='--data: '
                 'held-out loss every N steps (default 50) and at the end')
  p.add_argument('--sample', type=int, metavar='N', help='--data: print N '
                 'bytes the model writes after --prompt at the end')
  p.add_argument('--prompt', help='--sample: the text to continue (default: '
                 'the start of a held-out line)')
  p.add_argument('--temperature', type=float, metavar='T',
                 help='--sample: 0 greedy (default), T > 0 samples '
                 'softmax(logits / T) with a key from --seed')


def _add_run_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument('--batch', type=int, default=32, help='sequences per step')
  p.add_argument('--lr', type=float, default=3e-3)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--devices', type=int,
                 help='simulated CPU devices per process (default 8)')
  p.add_argument('--json', metavar='PATH', help='write config and per-step stats')
  p.add_argument('--plot', metavar='PATH', help='loss curve + schedule chart (PNG)')
  p.add_argument('--checkpoint', metavar='DIR', help='save the state here at the end')
  p.add_argument('--resume', action='store_true',
                 help='continue from the latest checkpoint in --checkpoint')


def _add_training_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument('--zero', type=int, choices=(0, 1, 3), default=0,
                 help='ZeRO stage: 1 shards the optimizer state over data, '
                 '3 the params too (FSDP)')
  p.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32',
                 help='compute dtype of the stages (activations, stashes, '
                 'messages); params, optimizer state and loss stay float32')
  p.add_argument('--dropout', type=float, default=0.0, metavar='P',
                 help='residual and embedding dropout rate while training '
                 '(masks from --seed and the step: resumable)')
  p.add_argument('--max-skipped', type=int, default=5, metavar='K',
                 help='stop (exit code 3) after K consecutive steps skipped '
                 'for non-finite loss or gradients')
  p.add_argument('--baseline', action=argparse.BooleanOptionalAction,
                 default=True, help='on CPU, also time a plain jitted step '
                 'of the dense model on one device, for contrast')


def _add_process_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument('--coordinator', metavar='HOST:PORT',
                 help='jax.distributed coordinator (multi-process runs)')
  p.add_argument('--num-processes', type=int)
  p.add_argument('--process-id', type=int)


def _flag(name: str) -> str:
  return '--' + name.replace('_', '-')


# The checks of parse_args, in order: each returns the error line of the
# first rule the flags break, or None.

def _check_text_flags(args) -> str | None:
  if args.data is None:
    for name in ('eval_every', 'sample', 'prompt'):
      if getattr(args, name) is not None:
        return (f'{_flag(name)} needs --data PATH (a text file to train on); '
                'the synthetic task has no held-out text')
  return None


def _check_counts(args) -> str | None:
  for name in ('microbatches', 'virtual_stages', 'steps', 'layers', 'batch',
               'devices', 'max_skipped', 'seq_len', 'd_model', 'heads',
               'eval_every', 'sample'):
    value = getattr(args, name)
    if value is not None and value < 1:
      return f'{_flag(name)} must be >= 1, got {value}'
  return None


def _check_memory_limit(args) -> str | None:
  if (args.schedule == 'auto') != (args.memory_limit is not None):
    return ('--schedule auto needs --memory-limit X and --memory-limit needs '
            '--schedule auto, e.g. --schedule auto --memory-limit 1.5')
  if args.memory_limit is not None and not args.memory_limit >= 1:
    return (f'--memory-limit {args.memory_limit}: the minimum feasible memory '
            'is 1 (one stage of activations per rank); use 1 or more')
  return None


def _check_model(args) -> str | None:
  stages = num_stages(args)
  if args.layers < stages:
    return (f'--layers {args.layers} is fewer than the {stages} pipeline '
            f'stages of {args.schedule} on stage={args.mesh["stage"]}; use '
            f'--layers {stages} or more')
  if args.d_model % args.heads:
    return (f'--d-model {args.d_model} is not divisible by --heads '
            f'{args.heads}; use a multiple of {args.heads}')
  return None


def _check_sampling(args) -> str | None:
  if args.sample is None and (args.prompt is not None
                              or args.temperature is not None):
    return ('--prompt and --temperature need --sample N (bytes to write), '
            "e.g. --sample 200 --prompt 'def ' --temperature 0.8")
  if args.prompt == '':
    return "--prompt is empty; give the text to continue, e.g. --prompt 'def '"
  if args.temperature is not None and not (
      math.isfinite(args.temperature) and args.temperature >= 0):
    return (f'--temperature must be a finite number >= 0 (0: greedy), got '
            f'{args.temperature}')
  return None


def _check_training(args) -> str | None:
  if not math.isfinite(args.lr) or args.lr <= 0:
    return f'--lr must be a finite number > 0, got {args.lr}'
  if not 0 <= args.dropout < 1:
    return f'--dropout must be a rate in [0, 1), got {args.dropout}'
  if args.resume and not args.checkpoint:
    return '--resume needs --checkpoint DIR'
  return None


def _check_batch(args) -> str | None:
  need = args.mesh['data'] * args.microbatches
  if args.batch % need:
    return (f'--batch {args.batch} must be a multiple of data x microbatches '
            f'= {need}')
  if (args.schedule == 'interleaved_one_f_one_b'
      and args.microbatches % args.mesh['stage']):
    return (f'--schedule interleaved_one_f_one_b needs --microbatches '
            f'divisible by stage={args.mesh["stage"]}')
  return None


_CHECKS = (_check_text_flags, _check_counts, _check_memory_limit,
           _check_model, _check_sampling, _check_training, _check_batch)


def num_stages(args) -> int:
  """The logical pipeline stages of ``--schedule`` on ``--mesh stage=p``."""
  if args.schedule == 'auto':
    return make_schedule(args).num_stages
  per_rank = pipeline.STAGES_PER_RANK[args.schedule] or args.virtual_stages
  return args.mesh['stage'] * per_rank


def make_schedule(args) -> pipeline.Schedule:
  """``--schedule NAME``: ``jaxpar.pipeline.NAME(p, m)``, or ``search``."""
  p, m = args.mesh['stage'], args.microbatches
  if args.schedule == 'auto':
    return pipeline.search(p, m, memory_limit=args.memory_limit)
  if args.schedule == 'interleaved_one_f_one_b':
    return pipeline.interleaved_one_f_one_b(p, m, args.virtual_stages)
  return getattr(pipeline, args.schedule)(p, m)
