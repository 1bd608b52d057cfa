"""Byte-level text data: a file's bytes, a held-out split, batches by step.

Any file is a sequence of bytes, so the vocabulary is the 256 byte values
and no tokenizer is needed. ``load_text`` reads the file and holds out its
last 10% for evaluation::

  bytes  b_0 ... b_{n-1}            n = file size
  train  b_0 ... b_{n-h-1}          h = n // 10 (the last 10%: held out)
  held   b_{n-h} ... b_{n-1}

A training batch is ``batch`` random windows of ``seq_len + 1`` bytes of the
training split (``ids`` the first ``seq_len``, ``targets`` the last): a pure
function of ``(seed, step)`` (``text_batch``), so a resumed run sees exactly
the batches of an uninterrupted one. The held-out batches are fixed windows
spread evenly over the held-out split (``held_out_batch``), the same at
every evaluation, so held-out losses of different steps compare.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from jaxpar._validate import check_int

VOCAB_SIZE = 256
HELD_OUT = 0.1


class TextData(NamedTuple):
  """A text file's bytes as ``uint8`` arrays: ``train`` then ``held_out``."""
  train: np.ndarray
  held_out: np.ndarray


def min_file_size(seq_len: int) -> int:
  """Bytes a file needs so both splits hold one ``seq_len + 1`` window.

  Example:
    >>> import numpy as np
    >>> from jaxpar.cli import text_data
    >>> text_data.min_file_size(64)        # 65 bytes are the last 10%: 650
    650
  """
  check_int('seq_len', seq_len)
  return int(np.ceil((seq_len + 1) / HELD_OUT))


def split(tokens: np.ndarray) -> TextData:
  """The first 90% of ``tokens`` to train on, the last 10% held out.

  Example:
    >>> import numpy as np
    >>> from jaxpar.cli import text_data
    >>> parts = text_data.split(np.arange(25, dtype=np.uint8))
    >>> parts.train[-1], parts.held_out      # 25 // 10 = 2 held out
    (np.uint8(22), array([23, 24], dtype=uint8))
  """
  held = int(len(tokens) * HELD_OUT)
  return TextData(tokens[:len(tokens) - held], tokens[len(tokens) - held:])


def load_text(path: str | os.PathLike, *, seq_len: int) -> TextData:
  """Read ``path`` as bytes and split it (``split``), checking it is usable.

  Args:
    path: a file of any content (text is what learns well).
    seq_len: the model's sequence length; the file needs
      ``min_file_size(seq_len)`` bytes.

  Returns:
    ``TextData(train, held_out)``, ``uint8`` arrays.

  Raises:
    ValueError: a missing, unreadable, empty or too short file, or a
      directory; the message names the path and the fix, in one line.

  Example:
    >>> import numpy as np
    >>> from jaxpar.cli import text_data
    >>> _ = open('abc.txt', 'w').write('abcdefghij' * 10)
    >>> parts = text_data.load_text('abc.txt', seq_len=8)
    >>> len(parts.train), len(parts.held_out)
    (90, 10)
  """
  check_int('seq_len', seq_len)
  path = os.fspath(path)
  fix = 'give the path of a text file'
  if os.path.isdir(path):
    raise ValueError(f'{path} is a directory; {fix}, e.g. {path}/notes.txt.')
  try:
    with open(path, 'rb') as f:
      raw = f.read()
  except FileNotFoundError:
    raise ValueError(f'{path}: no such file; {fix}.') from None
  except OSError as e:
    raise ValueError(f'{path} cannot be read ({e.strerror}); {fix} that you '
                     'can read.') from None
  need = min_file_size(seq_len)
  if len(raw) < need:
    raise ValueError(
        f'{path} has {len(raw)} bytes; sequences of {seq_len} bytes need at '
        f'least {need} (one sequence + 1 in the held-out last 10%); use a '
        f'longer file or a smaller --seq-len.')
  return split(np.frombuffer(raw, np.uint8))


def _windows(tokens: np.ndarray, starts: np.ndarray,
             seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  seq = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return seq[:, :-1], seq[:, 1:]


def _check_fits(tokens: np.ndarray, seq_len: int, what: str) -> None:
  if len(tokens) < seq_len + 1:
    raise ValueError(f'{what} has {len(tokens)} bytes, fewer than one '
                     f'sequence + 1 = {seq_len + 1}; use a smaller seq_len.')


def text_batch(tokens: np.ndarray, *, seed: int, step: int, batch: int,
               seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Training batch ``step``: random windows, a pure function of (seed, step).

  Args:
    tokens: ``uint8 [n]``, ``n >= seq_len + 1`` (e.g. ``TextData.train``).
    seed, step: the batch's identity (``np.random.default_rng([seed, step])``).
    batch, seq_len: the batch shape.

  Returns:
    ``(ids, targets)``, ``int32 [batch, seq_len]``; ``targets`` are ``ids``
    shifted by one byte.

  Example:
    >>> import numpy as np
    >>> from jaxpar.cli import text_data
    >>> tokens = np.frombuffer(b'hello world, hello jax', np.uint8)
    >>> ids, targets = text_data.text_batch(tokens, seed=0, step=3, batch=2,
    ...                                     seq_len=5)
    >>> ids.shape, bool((ids[:, 1:] == targets[:, :-1]).all())
    ((2, 5), True)
    >>> again = text_data.text_batch(tokens, seed=0, step=3, batch=2, seq_len=5)
    >>> bool((again[0] == ids).all())
    True
  """
  check_int('batch', batch)
  check_int('seq_len', seq_len)
  _check_fits(tokens, seq_len, 'the training split')
  rng = np.random.default_rng([seed, step])
  return _windows(tokens, rng.integers(0, len(tokens) - seq_len, batch),
                  seq_len)


def held_out_batch(tokens: np.ndarray, *, batch: int,
                   seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """``batch`` windows spread evenly over ``tokens``, first to last byte.

  Windows overlap only when the split is shorter than ``batch`` sequences;
  otherwise they skip bytes. The batch is fixed: evaluations at different
  steps see the same bytes.

  Example:
    >>> import numpy as np
    >>> from jaxpar.cli import text_data
    >>> tokens = np.arange(20, dtype=np.uint8)
    >>> ids, targets = text_data.held_out_batch(tokens, batch=3, seq_len=4)
    >>> ids[:, 0].tolist(), int(targets[-1, -1])      # starts; last byte
    ([0, 8, 15], 19)
  """
  check_int('batch', batch)
  check_int('seq_len', seq_len)
  _check_fits(tokens, seq_len, 'the held-out split')
  starts = np.linspace(0, len(tokens) - seq_len - 1, batch).round()
  return _windows(tokens, starts.astype(np.int64), seq_len)


def unigram_entropy(tokens: np.ndarray) -> float:
  """Entropy of the byte frequencies of ``tokens``, in nats per byte.

  ``H = -sum_b p_b log p_b``: the loss of the best model that ignores
  context. A language model that learned anything beats it.

  Example:
    >>> import numpy as np
    >>> from jaxpar.cli import text_data
    >>> round(text_data.unigram_entropy(np.frombuffer(b'abab', np.uint8)), 4)
    0.6931
  """
  p = np.bincount(np.asarray(tokens, np.int64), minlength=VOCAB_SIZE)
  p = p[p > 0] / len(tokens)
  return float(-(p * np.log(p)).sum())
