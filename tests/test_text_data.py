"""jaxpar.cli.text_data: byte-level text for the demo. The split, batches as
a pure function of (seed, step), their bounds, bad files refused with the
path and the fix, the unigram entropy."""

import numpy as np
import pytest

from jaxpar.cli import text_data as data


def test_split_holds_out_the_last_tenth():
  tokens = np.arange(1000) % 256
  parts = data.split(tokens.astype(np.uint8))
  assert len(parts.train) == 900 and len(parts.held_out) == 100
  np.testing.assert_array_equal(np.concatenate(parts), tokens)


def test_load_text_reads_bytes_and_splits(tmp_path):
  raw = ('héllo wörld\n' * 100).encode()
  path = tmp_path / 'text.txt'
  path.write_bytes(raw)
  parts = data.load_text(path, seq_len=16)
  assert parts.train.dtype == np.uint8
  assert parts.train.tobytes() + parts.held_out.tobytes() == raw
  assert len(parts.held_out) == len(raw) // 10


def test_batches_are_a_pure_function_of_seed_and_step():
  tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
  kw = dict(batch=8, seq_len=32)
  a = data.text_batch(tokens, seed=1, step=7, **kw)
  np.testing.assert_array_equal(a, data.text_batch(tokens, seed=1, step=7,
                                                   **kw))
  assert not np.array_equal(a[0], data.text_batch(tokens, seed=1, step=8,
                                                  **kw)[0])
  assert not np.array_equal(a[0], data.text_batch(tokens, seed=2, step=7,
                                                  **kw)[0])
  ids, targets = a
  assert ids.shape == targets.shape == (8, 32) and ids.dtype == np.int32
  np.testing.assert_array_equal(ids[:, 1:], targets[:, :-1])
  # Each row is a window of the text: find it.
  for row_ids, row_targets in zip(ids, targets):
    start = next(s for s in range(len(tokens) - 32)
                 if np.array_equal(tokens[s:s + 32], row_ids))
    assert tokens[start + 32] == row_targets[-1]


def test_batches_reach_both_ends_and_stay_inside():
  """A text of exactly seq_len + 1 bytes has one window; longer texts are
  sampled up to the last byte, never past it."""
  seq_len = 6
  tokens = np.arange(seq_len + 1, dtype=np.uint8)
  ids, targets = data.text_batch(tokens, seed=0, step=0, batch=4,
                                 seq_len=seq_len)
  np.testing.assert_array_equal(ids, np.tile(tokens[:-1], (4, 1)))
  np.testing.assert_array_equal(targets, np.tile(tokens[1:], (4, 1)))
  tokens = np.arange(20, dtype=np.uint8)
  firsts = np.concatenate([data.text_batch(tokens, seed=0, step=s, batch=64,
                                           seq_len=seq_len)[0][:, 0]
                           for s in range(4)])
  assert firsts.min() == 0 and firsts.max() == 20 - seq_len - 1
  ids, targets = data.held_out_batch(tokens, batch=5, seq_len=seq_len)
  assert ids[0, 0] == 0 and targets[-1, -1] == 19
  with pytest.raises(ValueError, match='fewer than one sequence'):
    data.text_batch(tokens[:seq_len], seed=0, step=0, batch=1,
                    seq_len=seq_len)


def test_bad_arguments_name_the_value():
  tokens = np.zeros(100, np.uint8)
  with pytest.raises(TypeError, match='batch=True must be an int'):
    data.text_batch(tokens, seed=0, step=0, batch=True, seq_len=4)
  with pytest.raises(ValueError, match='seq_len=0 must be an int >= 1'):
    data.held_out_batch(tokens, batch=2, seq_len=0)
  assert data.text_batch(tokens, seed=0, step=0, batch=np.int64(2),
                         seq_len=4)[0].shape == (2, 4)


@pytest.mark.parametrize('case,message', [
    ('missing', 'no such file'),
    ('directory', 'is a directory'),
    ('empty', 'has 0 bytes'),
    ('short', 'has 100 bytes; sequences of 64 bytes need at least 650'),
])
def test_bad_files_are_refused_with_the_path_and_the_fix(tmp_path, case,
                                                         message):
  path = tmp_path / case
  if case == 'directory':
    path.mkdir()
  elif case == 'empty':
    path.write_bytes(b'')
  elif case == 'short':
    path.write_bytes(b'x' * 100)
  with pytest.raises(ValueError, match=message) as e:
    data.load_text(path, seq_len=64)
  assert str(path) in str(e.value) and '\n' not in str(e.value)
  assert data.min_file_size(64) == 650


def test_unigram_entropy():
  uniform = np.arange(256, dtype=np.uint8).repeat(3)
  np.testing.assert_allclose(data.unigram_entropy(uniform), np.log(256))
  assert data.unigram_entropy(np.zeros(10, np.uint8)) == 0.0
