"""Which modules a name picks, in one place: sac2's rule for the names its own APIs take (``apply_ac``'s ``save``,
``sac2.policies.recompute_linears``), and torchtitan's rule, kept for the torchtitan preset's parity.

sac2's rule: a name's dot-separated parts, each a glob (``fnmatch``, case-sensitive), match the last parts of a
module's qualified name one for one. ``"gate"`` and ``"router.gate"`` pick ``layers.3.moe.router.gate``;
``"*_proj"`` picks ``self_attn.q_proj``; ``"layers.*.mlp"`` picks ``model.layers.0.mlp``; ``"attn"`` does not pick
``self_attn`` nor ``attn.q_proj``. torchtitan's ``force_recompute_mm_shapes_by_fqns`` matches substrings of the
qualified name (``"router"`` picks ``moe.router.gate``); ``sac2.policies.torchtitan`` answers as torchtitan does.
"""

from __future__ import annotations

import fnmatch

__all__ = ["names_module", "torchtitan_names_module"]


def names_module(name: str, fqn: str) -> bool:
    """Whether ``name`` picks the module whose qualified name is ``fqn`` (sac2's rule, above)."""
    parts, names = name.split("."), fqn.split(".")
    return len(parts) <= len(names) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names[len(names) - len(parts):], strict=True)
    )


def torchtitan_names_module(name: str, fqn: str) -> bool:
    """Whether ``name`` picks ``fqn`` by torchtitan's rule for ``force_recompute_mm_shapes_by_fqns``: a substring."""
    return name in fqn
