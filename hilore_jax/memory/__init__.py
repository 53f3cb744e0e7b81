"""The memory wing: HiLoRe's decisions (profile, exposure, calibration, cost model, allocator, buckets, budget
fit, methods, manager and its state). It never imports a trainer or the lab: the trainer's side arrives as
`StepHooks`, and the lab asks a manager what only a study needs through `probe.py`."""

from hilore_jax.memory.budget import budget_bytes
from hilore_jax.memory.hooks import StepHooks
from hilore_jax.memory.manager import Allocation, MemoryManager
from hilore_jax.memory.state import Calibration, ManagerState

__all__ = ["Allocation", "Calibration", "ManagerState", "MemoryManager", "StepHooks", "budget_bytes"]
