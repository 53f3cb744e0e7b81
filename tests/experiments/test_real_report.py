"""The real-model bench's report shows the parts measured so far (results are written after each part)."""

from experiments.real_model import report as real_report

ROW = {"shape": "8x1024", "method": "gc", "budget_ratio": None, "budget_bytes": None, "peak_bytes": 3 * 2**20,
       "grad_bytes": 2**20, "grad_temp_bytes": 2 * 2**20, "update_temp_bytes": 2**19, "logits_chunk_bytes": 2**20,
       "frac_H": 0.0, "frac_L": 0.0, "frac_R": 1.0, "params_bytes": 5 * 2**20, "opt_state_bytes": 10 * 2**20}


def test_a_report_of_the_memory_part_alone_has_its_table_and_no_other_section():
  text = real_report.report({"config": {"model": {"path": "m"}}, "tolerance": 0.01, "memory": [ROW]})
  assert "| 8x1024 | gc | — | 3 | — | 0.00 / 0.00 / 1.00 |" in text and "AdamW state 10 MiB" in text
  assert "## The manager's set-up" not in text and "## Relative gradient error" not in text and "LoGRA" not in text


def test_the_l_error_table_says_whether_every_unit_l_binds():
  err = {"int8": {"per_kind_median": {"q": 1e-3}, "per_kind_max": {"q": 2e-3}, "all_l": 0.05, "minibatches": 1}}
  tiny = {"int8": {"per_kind_median": {"q": 4e-3}, "all_l": 0.008}}
  text = real_report.report({"config": {"model": {}}, "tolerance": 0.01, "l_error": err, "l_error_tiny": tiny})
  assert "| q | 1.00e-03 / 2.00e-03 | 4.00e-03 |" in text and "**5.00e-02** (binds) | 8.00e-03 |" in text
