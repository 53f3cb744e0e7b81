"""The capacity tool behind `python -m train.capacity` (docs/capacity.md): the longest completion whose whole GRPO
step compiles within a per-device budget (`measure`, `search`, `run`, `report`), and the compile-only projection it
fits plans with (`projection`, `flops`, `roofline`, synthetic batches in `synthetic`). The lab reuses these too."""
