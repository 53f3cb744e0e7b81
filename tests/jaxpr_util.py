"""Walking a traced program: its size, for the tests that hold it flat in depth, and what its ops are."""


def eqns(jaxpr):
  """Every equation of a jaxpr, those of every sub-jaxpr (scan, remat, custom_vjp bodies) included."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from eqns(inner)


def eqn_count(jaxpr) -> int:
  """Equations in a jaxpr, counting those of every sub-jaxpr."""
  return sum(1 for _ in eqns(jaxpr))


def scan_lengths(jaxpr) -> list[int]:
  """The trip count of every scan in a jaxpr and its sub-jaxprs (a lax.map is a scan too)."""
  return [e.params["length"] for e in eqns(jaxpr) if e.primitive.name == "scan"]


def reduce_sums(jaxpr) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
  """(operand shape, axes) of every reduce_sum in a jaxpr and its sub-jaxprs."""
  return [(tuple(e.invars[0].aval.shape), tuple(e.params["axes"])) for e in eqns(jaxpr)
          if e.primitive.name == "reduce_sum"]
