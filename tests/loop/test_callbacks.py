"""The loop's hooks: each runs after the steps its `every` divides and, with at_end, once after the loop; records
merge in order, and a later hook sees the earlier ones'. The step's metrics row as its parts' records."""

import pytest

from hilore_jax.loop import records
from hilore_jax.loop.callbacks import Hooks, StepInfo


def test_hooks_run_every_n_steps_and_at_the_end():
  ran = []
  h = Hooks()
  h.add(lambda i: ran.append(("a", i.step)), every=1)
  h.add(lambda i: ran.append(("b", i.step)) or {"b": i.step}, every=3, at_end=True)
  h.add(lambda i: ran.append(("end", i.step)) or {"seen": dict(i.records)}, at_end=True)  # every=0: not mid-run
  got = [h.after_step(StepInfo(s, s == 7)) for s in range(1, 8)]
  assert [r for r in ran if r[0] == "a"] == [("a", s) for s in range(1, 8)]
  assert [r for r in ran if r[0] == "b"] == [("b", 3), ("b", 6)] and ("end", 7) not in ran
  assert got[2] == {"b": 3} and got[0] == {}
  ran.clear()
  assert h.at_end(StepInfo(7, True)) == {"b": 7, "seen": {"b": 7}}  # the later hook read the earlier one's record
  assert ran == [("b", 7), ("end", 7)]
  with pytest.raises(ValueError, match="every must be >= 0"):
    h.add(lambda i: None, every=-1)


def test_a_row_is_its_records_keys_in_order():
  upd = records.UpdateRecord([{"loss": 1.0, "grad_norm": 2.0, "clipfrac": 0.0, "kl": 0.0, "entropy": 1.0,
                               "abs_log_ratio": 0.0}] * 2, 1e-3, [5, 7])
  tok = records.TokenRecord(10, 6, 12, 2, 0.25)
  row = records.row(3, upd, tok, {"time/memory_setup_s": 0.5})
  assert list(row)[:3] == ["step", "lr", "updates"] and row["step"] == 3 and row["updates"] == 2
  assert row["memory/compiled_bytes"] == 7 and row["memory/peak_bytes"] == 7
  assert row["tokens/computed"] == 20 and row["tokens/fill"] == 0.6 and row["budget/padding_frac"] == 0.25
  assert "budget/microbatches" not in row and row["time/memory_setup_s"] == 0.5
  bad = records.UpdateRecord([{**upd.updates[0], "loss": float("nan")}], 1e-3, [])
  with pytest.raises(Exception, match="non-finite loss or gradient at step 4"):
    bad.check_finite(4)
