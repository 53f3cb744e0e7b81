"""The lab: benchmarks and studies of the library (`python -m experiments.bench.main ...`), beside the package and not
installed with it. It reaches the library through its public modules and the memory manager through
`hilore_jax.memory.probe`."""
