"""Counting a traced program's size, for the tests that hold it flat in depth."""


def eqn_count(jaxpr) -> int:
  """Equations in a jaxpr, counting those of every sub-jaxpr (scan, remat, custom_vjp bodies)."""
  n = 0
  for e in jaxpr.eqns:
    n += 1
    for v in e.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          n += eqn_count(inner)
  return n


def scan_lengths(jaxpr) -> list[int]:
  """The trip count of every scan in a jaxpr and its sub-jaxprs (a lax.map is a scan too)."""
  out = []
  for e in jaxpr.eqns:
    if e.primitive.name == "scan":
      out.append(e.params["length"])
    for v in e.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out += scan_lengths(inner)
  return out
