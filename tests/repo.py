"""Paths the tests share, wherever a test lives under tests/: the repository's root, the tests' folder, their data."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
DATA = os.path.join(TESTS, "data")
