"""`python tests/crash_worker.py [train.grpo args]`: the GRPO entry point, except that the checkpoint save of the
step named by HILORE_TEST_STALL_SAVE stalls just before orbax renames its temporary directory, so a test can
SIGKILL the process inside a real save (everything up to the rename has run)."""

import asyncio
import os
import sys

# this checkout (tests/<wing>/ is two levels below it), not an installed copy
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from orbax.checkpoint._src.path import atomicity  # noqa: E402

from train import grpo  # noqa: E402

_finalize = atomicity.AtomicRenameTemporaryPath.finalize


async def _stalling_finalize(self):
  if self.get_final().name == os.environ.get("HILORE_TEST_STALL_SAVE"):
    await asyncio.sleep(600)
  return await _finalize(self)


atomicity.AtomicRenameTemporaryPath.finalize = _stalling_finalize

if __name__ == "__main__":
  grpo.main(sys.argv[1:])
