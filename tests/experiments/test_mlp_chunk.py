"""experiments/mlp_chunk: the chunked arm is a chunked program (fewer bytes at its peak), and the report's fields."""

import json

from experiments.mlp_chunk import main as mlp_chunk

TINY = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 61, "hidden_size": 24, "intermediate_size": 200,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def test_the_chunked_arm_holds_less_and_is_timed_against_a_floor(tmp_path):
  shape = tmp_path / "tiny.json"
  shape.write_text(json.dumps(TINY))
  mlp_chunk.main(["--shape", str(shape), "--layers", "3", "--rows", "3", "--positions", "96", "--chunk", "24",
                  "--reps", "2", "--out", str(tmp_path)])
  out = json.loads((tmp_path / "mlp_chunk.json").read_text())
  progs = out["programs"]
  # the same whole-MLP program twice; the chunked one holds a chunk's [3, 24, 200] MLP intermediates at a time
  assert progs["whole"] == progs["whole_again"]
  assert progs["chunked"]["hlo_instructions"] > progs["whole"]["hlo_instructions"]  # its loop over 4 chunks
  assert out["peak_ratio"] < 0.95
  assert {len(v) for v in out["seconds"].values()} == {2} and out["floor"]["n"] == 2
