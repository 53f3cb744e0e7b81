"""Float32 comparisons that hold on any CPU: errors counted in float32 steps of the magnitude they come from.

XLA picks fusions, vector widths and FMA per machine, so float32 results legitimately differ in the last bits
across CPUs. An element formed as a sum of many terms is off by about eps * sum|terms|, which for an element that
cancels is far more than eps * |element|: an elementwise rtol then fails on a correct result (a bias gradient
that is ~0 by symmetry, say). These helpers allow `ulps` float32 steps of a scale that bounds the terms -- the
largest magnitude of the leaf, of the whole tree, or one the test names -- so a test states how much reassociation
noise it accepts, and can say how far below the effect it detects that is.
"""

import jax
import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7


def _leaves(tree) -> list[np.ndarray]:
  return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(jax.device_get(tree))]


def max_abs(tree) -> float:
  """Largest |element| of an array or a tree of them."""
  return max((float(np.abs(x).max()) for x in _leaves(tree) if x.size), default=0.0)


def assert_close(actual, expected, ulps: float = 16, scale: float | None = None, err_msg: str = ""):
  """|actual - expected| <= ulps * eps32 * scale everywhere; scale defaults to max |expected|."""
  a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  np.testing.assert_equal(a.shape, b.shape, err_msg=err_msg)
  scale = max_abs(b) if scale is None else scale
  np.testing.assert_allclose(a, b, rtol=0, atol=ulps * EPS32 * scale, err_msg=err_msg)


def assert_trees_close(actual, expected, ulps: float = 64, scale: str | float = "leaf"):
  """assert_close per leaf; scale: 'leaf' (each leaf's max |expected|), 'tree' (the tree's), or a number."""
  flat_a, tree_a = jax.tree_util.tree_flatten_with_path(jax.device_get(actual))
  flat_b, tree_b = jax.tree_util.tree_flatten_with_path(jax.device_get(expected))
  assert tree_a == tree_b, (tree_a, tree_b)
  tree_scale = max_abs(expected) if scale == "tree" else None
  for (path, a), (_, b) in zip(flat_a, flat_b):
    s = max_abs(b) if scale == "leaf" else tree_scale if scale == "tree" else float(scale)
    assert_close(a, b, ulps, s, err_msg=jax.tree_util.keystr(path))


def rel_err(actual, expected) -> float:
  """||actual - expected|| / ||expected|| over every element of two trees."""
  a, b = _leaves(actual), _leaves(expected)
  diff = np.sqrt(sum(float(np.sum((x - y) ** 2)) for x, y in zip(a, b)))
  return diff / np.sqrt(sum(float(np.sum(y ** 2)) for y in b))
