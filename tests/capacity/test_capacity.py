"""The capacity tool: the search on known peak curves, then a tiny odd shape compiled for real (compile-only): the
boundary it finds, the cache a rerun reads, capacity.json's schema; bad command lines fail with one clear line."""

import dataclasses
import json
import os

import jax
import pytest

import repo

from hilore_jax import model
from hilore_jax.capacity import measure as C
from hilore_jax.capacity import report as capacity_report, run as capacity_run
from hilore_jax.capacity import search
from hilore_jax.errors import ConfigError
from hilore_jax.memory.config import MemoryConfig
from train import capacity as entry

TINY = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 97, "hidden_size": 40, "intermediate_size": 72,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
# completions up to 64 - 8 = 56 tokens on an 8-token grid: a handful of tiny compiles
SETTINGS = C.Settings(prompt_len=8, rows=2, grid=8, budget_probes=1)


@pytest.mark.parametrize("a,b,c", [(5e6, 3e3, 0.0), (1e8, 1e4, 40.0), (2e9, 1.0, 0.5)])
@pytest.mark.parametrize("budget", [3e6, 4e8, 5e9, 1e11])
def test_search_finds_the_boundary_of_a_known_curve(a, b, c, budget):
  calls = []
  curve = lambda t: int(a + b * t + c * t * t)
  found = search.longest(lambda t: calls.append(t) or curve(t), int(budget), 64, 32768, 768)
  brute = max([t for t in range(64, 32769, 64) if curve(t) <= budget] or [0])
  assert found.longest == brute
  assert found.capped == (brute == 32768)
  assert found.compiled == len(set(calls)) <= 8  # the predicted crossing, not a 9-step bisection of 512 grid steps
  if 0 < brute < 32768:
    assert brute + 64 in found.points  # the step after the longest was compiled and does not fit
  again = search.longest(lambda t: pytest.fail("a known point was recompiled"), int(budget), 64, 32768, 768,
                         found.points)
  assert again.longest == brute and again.compiled == 0


def test_search_rejects_a_bad_grid():
  with pytest.raises(ValueError, match="multiple"):
    search.longest(lambda t: t, 10, 64, 1024, 100)


def test_growth_check_by_hand():
  affine = {"1024": 10 + 1024, "2048": 10 + 2048, "4096": 10 + 4096}
  assert capacity_report.growth_check(affine) == {"increment_ratio": 2.0, "slope_ratio": 1.0}
  quad = {str(t): t * t for t in (1024, 2048, 4096)}
  assert capacity_report.growth_check(quad) == {"increment_ratio": 4.0, "slope_ratio": 2.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("capacity")
  shape = str(d / "tiny.json")
  with open(shape, "w") as f:
    json.dump(TINY, f)
  out = str(d / "out")
  first = capacity_run.Grid(out, SETTINGS, progress=lambda s: None)
  # a budget between two compiled points: the device bytes of a 24-token completion
  budget_gib = first.point(shape, "gc", None, "xla", 1, 24)["device_bytes"] / capacity_run.GiB
  result = capacity_run.run(out, [shape], ["gc"], [budget_gib], [1], ["xla"], ["gc"], SETTINGS,
                            progress=lambda s: None, growth_tokens=(16, 32, 48))
  return shape, out, budget_gib, result


def test_the_compiled_search_stops_at_the_boundary(tiny):
  shape, out, budget_gib, result = tiny
  (row,) = result["rows"]
  T = row["longest_completion"]
  assert T >= 24 and not row["capped"]
  cache = search.PointCache(os.path.join(out, "capacity_cache.json"), SETTINGS.programs())
  pts = cache.series(capacity_run.point_key(shape, "gc", None, "xla", 1), "device_bytes")
  budget = int(budget_gib * capacity_run.GiB)
  assert pts[T] <= budget < pts[T + SETTINGS.grid]


def test_a_cache_of_other_settings_is_moved_aside_and_an_older_one_read_as_it_ran(tmp_path):
  path = str(tmp_path / "capacity_cache.json")
  older = {k: v for k, v in SETTINGS.programs().items() if k not in ("mlp_chunk_len", "plan_runs")}  # before both
  with open(path, "w") as f:
    json.dump({"settings": older, "points": {"p|T=8": {"device_bytes": 1}}}, f)
  unchunked = dataclasses.replace(SETTINGS, mlp_chunk_len=0, plan_runs=4).programs()
  assert search.PointCache(path, dataclasses.replace(SETTINGS, mlp_chunk_len=0).programs(),
                           C.with_legacy).points == {}  # the trainer's 2 runs: other plans
  assert search.PointCache(path, unchunked, C.with_legacy).points == {"p|T=8": {"device_bytes": 1}}
  assert search.PointCache(path, unchunked).points == {}  # without the upgrade the settings differ
  chunked = search.PointCache(path, SETTINGS.programs(), C.with_legacy)  # 512: other programs
  assert chunked.points == {}
  chunked.put("p|T=16", {"device_bytes": 2})
  (aside,) = [f for f in os.listdir(tmp_path) if f != "capacity_cache.json"]
  with open(tmp_path / aside) as f:
    assert json.load(f)["points"] == {"p|T=8": {"device_bytes": 1}}  # kept, not overwritten
  assert search.PointCache(path, SETTINGS.programs()).points == {"p|T=16": {"device_bytes": 2}}


def test_the_settings_bound_the_plans_runs():
  assert C.Measurer(dataclasses.replace(SETTINGS, plan_runs=3)).config().memory.plan_runs == 3
  assert C.Settings().plan_runs == MemoryConfig().plan_runs == 2
  with pytest.raises(ConfigError, match=r"--plan-runs must be >= 0"):
    C.Settings(plan_runs=-1)


def test_the_settings_chunk_the_mlp_of_every_shape():
  assert C.load_shape("smollm2-135m", dataclasses.replace(SETTINGS, mlp_chunk_len=7)).mlp_chunk_len == 7
  assert C.load_shape("smollm2-135m", dataclasses.replace(SETTINGS, mlp_chunk_len=0)).mlp_chunk_len == 0


def test_a_rerun_compiles_nothing(tiny):
  shape, out, budget_gib, result = tiny
  grid = capacity_run.Grid(out, SETTINGS, progress=lambda s: None, measurer=object())  # measure() would fail
  again = grid.longest(shape, "gc", None, "xla", 1, budget_gib)
  assert again == {**result["rows"][0], "points_compiled": 0}
  assert grid.growth(shape, "gc", None, "xla", (16, 32, 48)) == result["growth"][0]
  assert grid.compiled == 0
  other = capacity_run.Grid(out, dataclasses.replace(SETTINGS, rows=4), progress=lambda s: None)
  assert other.cache.points == {}  # other settings: other programs
  wider = capacity_run.Grid(out, dataclasses.replace(SETTINGS, grid=16, max_completion=64), measurer=object())
  assert wider.cache.points == grid.cache.points and wider.cap(shape) == 64  # the search's own settings share points


def test_capacity_json_schema(tiny):
  shape, out, _, result = tiny
  with open(os.path.join(out, "capacity.json")) as f:
    data = json.load(f)
  assert data == json.loads(json.dumps(result))
  for row in data["rows"]:
    assert {"shape", "method", "budget_ratio", "attention", "devices", "budget_gib", "longest_completion"} <= set(row)
  (g,) = data["growth"]
  assert {"shape", "method", "attention", "rows", "peak_bytes"} <= set(g) and g["rows"] == SETTINGS.rows
  assert sorted(map(int, g["peak_bytes"])) == [16, 32, 48]
  assert all(v > 0 for v in g["peak_bytes"].values())
  assert os.path.exists(os.path.join(out, "capacity.png"))
  with open(os.path.join(out, "capacity.md")) as f:
    assert f"| {shape} | 1 | xla | gc | {result['rows'][0]['longest_completion']} |" in f.read()


def test_a_lora_point_holds_the_adapters_optimizer_state_and_no_reference_copy(tiny):
  """--lora RANK: the frozen base is the reference (no copy) and AdamW holds the adapters' moments alone."""
  shape, out, _, _ = tiny
  full = capacity_run.Grid(out, SETTINGS, progress=lambda s: None).point(shape, "gc", None, "xla", 1, 24)
  grid = capacity_run.Grid(out, dataclasses.replace(SETTINGS, lora_rank=2), progress=lambda s: None)
  assert grid.cache.points == {}  # other programs
  lp = grid.point(shape, "gc", None, "xla", 1, 24)
  cfg = C.load_shape(shape, SETTINGS)
  shapes = lambda c: jax.eval_shape(lambda: model.init_params(c, jax.random.PRNGKey(0)))
  size = lambda c: 4 * sum(x.size for x in jax.tree.leaves(shapes(c)))
  lcfg = C.load_shape(shape, grid.settings)
  params, adapters = size(cfg), size(lcfg) - size(cfg)
  assert adapters > 0 and lcfg.lora.rank == 2
  # the forward program's footprint: full holds AdamW's 2x the params and the reference's 1x beside it, LoRA 2x the
  # adapters' (its own argument grows by the adapters, its temp by their x A: 8% of the params at this tiny shape)
  saved = full["programs"]["forward"] - lp["programs"]["forward"]
  assert 3 * params - 3 * adapters - 0.1 * params <= saved <= 3 * params
  assert lp["device_bytes"] < full["device_bytes"]


@pytest.mark.parametrize("argv,message", [
    (["--lora", "-2"], "--lora must be >= 0 (0: full fine-tuning), got -2"),
    (["--methods", "gc,fast"], "--methods: unknown ['fast']"),
    (["--shapes", "llama-70b"], "--shapes: unknown ['llama-70b']"),
    (["--budgets-gib", "24,-1"], "--budgets-gib must be positive"),
    (["--budgets-gib", "lots"], "--budgets-gib must be comma-separated numbers"),
    (["--devices", "1,two"], "--devices must be comma-separated integers"),
    (["--attention", "flash"], "--attention: unknown ['flash']"),
    (["--grid", "0"], "--grid must be positive"),
    (["--max-completion", "0"], "--max-completion must be positive"),
])
def test_bad_command_lines_say_what_is_wrong(tmp_path, argv, message):
  with pytest.raises(SystemExit) as e:
    entry.main(["--out", str(tmp_path), *argv])
  assert message in str(e.value) and str(e.value).startswith("config error:")


@pytest.mark.slow
def test_a_budgeted_plan_stays_within_its_ratio_of_gc(tiny):
  """hilore (uncalibrated risk) at 1.00x: its compiled peak within GC's at the same T, the whole step's bytes too."""
  shape, out, _, _ = tiny
  grid = capacity_run.Grid(out, SETTINGS, progress=lambda s: None)
  gc = grid.point(shape, "gc", None, "xla", 1, 24)
  planned = grid.point(shape, "hilore", 1.0, "xla", 1, 24)
  assert planned["peak_bytes"] <= gc["peak_bytes"]
  assert planned["device_bytes"] <= gc["device_bytes"] + (gc["device_bytes"] - gc["peak_bytes"]) * 0.01


def test_a_packed_point_is_one_buffer_per_device_with_a_cache_of_its_own():
  batch = C.abstract_batch(8, 8, 128, True, packed_devices=1)
  assert batch.packing.shape == (1, 1024) and batch.prompt_table.shape == (1, 8)  # one group: one prompt
  assert C.abstract_batch(16, 8, 128, True, packed_devices=8).packing.shape == (8, 256)
  assert C.Settings(packed=True).programs() != C.Settings().programs()


@pytest.mark.slow
def test_packed_microbatches_are_priced_as_one_buffer_per_device(tmp_path):
  # 8 rows of 128-token completions: packed, one buffer of 1,024 positions and the group's prompt once. Blockwise
  # attention holds less than the padded rows (no per-row prompt, one row of score blocks); xla holds the buffer's
  # 1,024 x 1,032 scores, far more: what the tool is for
  shape = str(tmp_path / "tiny.json")
  with open(shape, "w") as f:
    json.dump({**TINY, "max_position_embeddings": 256}, f)
  settings = C.Settings(prompt_len=8, rows=8, grid=8, budget_probes=1)
  peak = {}
  for packed in (False, True):
    m = C.Measurer(dataclasses.replace(settings, packed=packed))
    for attention in ("xla", "blockwise"):
      mcfg = C.load_shape(shape, settings).replace(attention=attention)
      peak[packed, attention] = m.measure(mcfg, "gc", None, 1, 128)["peak_bytes"]
  assert peak[True, "blockwise"] < 0.7 * peak[False, "blockwise"]  # measured 0.48
  assert peak[True, "xla"] > 3 * peak[True, "blockwise"]  # measured 13.7


def _table_script():
  import importlib.util
  spec = importlib.util.spec_from_file_location("capacity_table", os.path.join(repo.ROOT, "scripts",
                                                                                "capacity_table.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_grid_table_merges_pieces_once_each_in_grid_order(tmp_path):
  table = _table_script()
  row = lambda shape, method, ratio, gib, longest, devices=1: {
      "shape": shape, "devices": devices, "attention": "xla", "method": method, "budget_ratio": ratio,
      "budget_gib": gib, "longest_completion": longest, "capped": False, "points_compiled": 1}
  settings = {"prompt_len": 8, "rows": 2, "grid": 8, "dtype": "bfloat16", "param_dtype": "float32", "beta": 0.04}
  pieces = {"qwen2.5-0.5b/pieces/1-xla-sac.json": [row("qwen2.5-0.5b", "gc", None, 24.0, 72),
                                                   row("qwen2.5-0.5b", "sac", 1.1, 24.0, 64)],
            "qwen2.5-0.5b/pieces/1-xla-nogc.json": [row("qwen2.5-0.5b", "gc", None, 24.0, 72),
                                                    row("qwen2.5-0.5b", "nogc", None, 24.0, 8)],
            "smollm2-135m/pieces/8-xla-nogc.json": [row("smollm2-135m", "gc", None, 24.0, 40, devices=8)]}
  for path, rows in pieces.items():
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(json.dumps({"settings": settings, "rows": rows, "growth": []}))
  got = [(r["shape"], r["devices"], r["method"]) for r in table.merged(str(tmp_path))["rows"]]
  # GC's series, in both 0.5B pieces, once; SmolLM2 first (the grid's order), then GC, No-GC, the budgeted methods
  assert got == [("smollm2-135m", 8, "gc"), ("qwen2.5-0.5b", 1, "gc"), ("qwen2.5-0.5b", 1, "nogc"),
                 ("qwen2.5-0.5b", 1, "sac")]
  left = table.missing(str(tmp_path))
  assert "qwen2.5-0.5b x1 xla sac" not in left and "qwen2.5-0.5b x1 xla hilore" in left
  assert len(left) == 4 * 2 * 2 * 5 - 3
  (tmp_path / "smollm2-135m/pieces/8-xla-nogc.json").write_text(json.dumps(
      {"settings": {**settings, "rows": 4}, "rows": [], "growth": []}))
  with pytest.raises(ValueError, match=r"8-xla-nogc.json: its settings differ"):
    table.merged(str(tmp_path))
  # a field added since: a piece without it ran at its LEGACY value (the MLP unchunked), so it merges with 0 only
  for chunk, same in ((0, True), (512, False)):
    (tmp_path / "smollm2-135m/pieces/8-xla-nogc.json").write_text(json.dumps(
        {"settings": {**settings, "mlp_chunk_len": chunk}, "rows": [], "growth": []}))
    if same:
      assert table.merged(str(tmp_path))["settings"]["mlp_chunk_len"] == 0
    else:
      with pytest.raises(ValueError, match=r"its settings differ"):
        table.merged(str(tmp_path))
