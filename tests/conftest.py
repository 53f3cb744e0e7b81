"""Shared test fixtures: tiny odd-shaped configs, no network, and one compilation cache for the whole session."""

import gc
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from hilore_jax import runtime  # noqa: E402


# Tests compile hundreds of tiny programs and run each a few times, so compiling costs far more than running: LLVM's
# optimisations cost about a third of the suite's time, XLA:CPU's MLIR fusion emitters 2.7x the compile time of its
# classic ones, and splitting codegen over threads a third more where two workers share two cores. The memory figures
# tests check come from XLA's HLO schedule, which the LLVM and codegen flags leave alone and the emitters move by
# bytes (a fusion's padding); subprocess tests (and xdist's workers) inherit them. Set before any test starts JAX.
# XLA aborts on a flag it does not know, and they come and go between releases (jax 0.11.2 has no fusion-emitter
# switch of this name), so only the flags this XLA starts with are added: checked once per run, in a subprocess.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                  "--xla_cpu_parallel_codegen_split_count=1", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(*flags: str) -> bool:
  """Whether this XLA starts with the flags added to XLA_FLAGS: one CPU backend, in a subprocess."""
  env = {**os.environ, "XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""), *flags]), "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                        timeout=300).returncode == 0


def _test_flags() -> tuple[str, ...]:
  new = tuple(f for f in TEST_XLA_FLAGS if f.split("=")[0] not in os.environ.get("XLA_FLAGS", ""))
  if not new or _xla_accepts(*new):  # xdist's workers inherit the first process's choice
    return new
  return tuple(f for f in new if _xla_accepts(f))


if not runtime.configure_xla_flags(_test_flags()):
  raise RuntimeError("a JAX backend started before tests/conftest.py set the test XLA flags")

# JAX's tracing and lowering allocate millions of short-lived objects: at Python's default thresholds (700, 10, 10) the
# collector ran about 3,300 times over tests/rl/test_prompt_share.py's 15 tests, its full collections scanning every
# compiled program a worker holds (6% of that file's CPU time). Collections of young objects every 50,000
# allocations, of all of them rarely: cycles still go, a little later.
gc.set_threshold(50_000, 20, 20)


@pytest.fixture
def tiny_cfg():
  import builders  # imports JAX: only once the XLA flags are set
  return builders.tiny_model(num_hidden_layers=3, tie_word_embeddings=False)


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
  """One HILORE_CACHE (profiles, tokenizers, compiled programs) for the session, inherited by every subprocess a
  test starts: the same tiny programs compile once, not once per Trainer or per process."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist: each worker's basetemp sits in the run's shared one
    base = base.parent
  root = str(base / "hilore_cache")
  os.environ["HILORE_CACHE"] = root
  runtime.enable_compilation_cache()
  yield root


# the files whose tests take the most CPU (measured per test, whole suite; the quick tier's heaviest among them),
# longest first, dealt out before the rest: with one file per worker at a time (--dist loadfile), a long file dealt
# last leaves the other worker idle until it ends. xdist would deal files by their number of tests instead, which put
# the long files of few tests last: pyproject's addopts turn that off (--no-loadscope-reorder)
LONG_FILES = ("test_real_model.py", "test_packing.py", "test_memory_cache.py", "test_bench.py",
              "test_packing_trainer.py", "test_prompt_share.py", "test_exposure_e1b.py", "test_layers.py",
              "test_compile_time.py", "test_multiprocess.py", "test_calibration.py", "test_blockwise_attention.py",
              "test_recovery.py", "test_token_budget.py", "test_sampler_at_length.py", "test_key_blocks.py",
              "test_lora_trainer.py", "test_units.py", "test_offpolicy.py", "test_sharding.py",
              "test_exposure_runtime.py", "test_capacity.py", "test_lora.py", "test_lowp.py", "test_sampler.py",
              "test_trainer.py", "test_model.py", "test_op_profile.py")


def pytest_collection_modifyitems(items):
  first = {name: i for i, name in enumerate(LONG_FILES)}
  items.sort(key=lambda it: first.get(it.path.name, len(LONG_FILES)))  # stable: file order kept otherwise


@pytest.fixture
def fixed_op_times(monkeypatch):
  """The memory manager's op profile as fixed times (1 ms an op, free codecs): a plan, and so a test's outcome, that
  does not depend on how fast this machine runs the ops when the test does."""
  from hilore_jax.memory import profile
  from hilore_jax.model import decoder

  times = {"ops": {op: 1e-3 for op in decoder.OPS}, "codec": {}, "offload": {}}
  monkeypatch.setattr(profile, "profile_ops", lambda *a, **k: times)
  return times
