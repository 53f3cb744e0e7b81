"""The lab: benchmarks and studies of the library, one folder per study, each run as
`python -m experiments.<study>.main` (docs/design.md lists them), beside the package and not installed with it. It
reaches the library through its public modules and the memory manager through `hilore_jax.memory.probe`; what the
studies share lives in `experiments/common/`."""
