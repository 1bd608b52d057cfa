"""The test helpers' own checks: ``tree_allclose``, the one closeness
assertion of the suite."""

import re

import numpy as np
import pytest

import jaxpar
from helpers import tree_allclose


def tree(w_error=0.0, b_error=0.0, dtype=np.float64):
  return {'layer': {'w': np.ones((2, 3), dtype) + w_error,
                    'b': np.zeros(3, dtype) + b_error}, 'step': np.int32(4)}


def test_passes_within_the_dtype_default():
  tree_allclose(tree(1e-12), tree())                       # float64: 1e-10
  tree_allclose(tree(1e-6, dtype=np.float32), tree(dtype=np.float32))  # 1e-5


def test_names_each_failing_leaf_with_its_errors():
  with pytest.raises(AssertionError) as failure:
    tree_allclose(tree(w_error=1e-3), tree(), rtol=1e-6)
  message = str(failure.value)
  assert "1 of 3 leaves differ" in message
  assert re.search(r"\['layer'\]\['w'\]: 6 of 6 entries off; max abs error "
                   r"0\.001 .* max rel error 0\.001", message), message
  assert "['layer']['b']" not in message


def test_structure_shape_and_kind_must_match():
  with pytest.raises(AssertionError, match=r"only in expected: \[\"\['b'\]\"\]"):
    tree_allclose({'a': 1.0}, {'a': 1.0, 'b': 2.0})
  with pytest.raises(AssertionError, match=r"\['a'\]: shape \(2,\), expected"):
    tree_allclose({'a': np.ones(2)}, {'a': np.ones(3)})
  with pytest.raises(AssertionError, match='another kind'):
    tree_allclose(np.ones(2, np.int32), np.ones(2))
  tree_allclose(np.float32(1.0), 1)   # a Python number matches any kind


def test_atol_scaled_by_the_leaf_or_the_tree():
  # Gradients that are zero in exact arithmetic hold rounding noise.
  got, want = [np.ones(2), np.array([1e-14])], [np.ones(2), np.zeros(1)]
  tree_allclose(got, want, rtol=1e-12, atol_scale='tree')
  with pytest.raises(AssertionError, match=r'\[1\]: 1 of 1'):
    tree_allclose(got, want, rtol=1e-12, atol_scale='leaf')
  with pytest.raises(ValueError, match="atol_scale='max'"):
    tree_allclose(got, want, atol_scale='max')


def test_padded_leaves_compare_as_their_logical_arrays():
  padded = jaxpar.data_parallel.Padded(np.array([1.0, 2.0, 3.0, 0.0]), (3,))
  tree_allclose({'w': padded}, {'w': np.array([1.0, 2.0, 3.0])})
