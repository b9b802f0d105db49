"""Regions: ``sac2.region`` (a callable the policy sees as one op it can save or recompute), and regions made in
a model you did not write (``apply_ac(mode="regions")``: module calls, attention calls, experts' matmuls)."""

__all__: list[str] = []
