"""`python tests/loop/crash_worker.py [train.grpo args]`: the GRPO entry point, except that the process SIGKILLs
itself at the point HILORE_TEST_KILL names, so a test kills a run at the same place on any machine:
- `rename:<k>`: inside the checkpoint save of step k, everything up to orbax's rename of its temporary directory done;
- `row:<k>`: halfway through writing step k's metrics row (a torn last row)."""

import json
import os
import signal
import sys

# this checkout (tests/<wing>/ is two levels below it), not an installed copy
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from orbax.checkpoint._src.path import atomicity  # noqa: E402

from hilore_jax.loop import metrics  # noqa: E402
from train import grpo  # noqa: E402

POINT, _, STEP = os.environ.get("HILORE_TEST_KILL", "").partition(":")


def _die():
  os.kill(os.getpid(), signal.SIGKILL)


_finalize = atomicity.AtomicRenameTemporaryPath.finalize


async def _finalize_or_die(self):
  if POINT == "rename" and self.get_final().name == STEP:
    _die()
  return await _finalize(self)


_write = metrics.MetricsWriter.write


def _write_or_die(self, row: dict):
  if POINT == "row" and str(row.get("step")) == STEP:
    line = (json.dumps(row) + "\n").encode()
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
    os.write(fd, line[:len(line) // 2])  # unbuffered: the half row is in the file before the kill
    os.close(fd)
    _die()
  return _write(self, row)


atomicity.AtomicRenameTemporaryPath.finalize = _finalize_or_die
metrics.MetricsWriter.write = _write_or_die

if __name__ == "__main__":
  grpo.main(sys.argv[1:])
