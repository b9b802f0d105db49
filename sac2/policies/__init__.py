"""Ready-made selective-checkpointing policies: ``sac2.policies.llm()``, ``torchtitan(model)``,
``every_other_matmul()``, ``recompute_linears(model, names)`` and ``compose(...)`` to combine them, and memory
budgets. See ``sac2.policies.presets``, ``sac2.policies.torchtitan_sac`` and ``sac2.policies.budget``; every
one pickles."""

from sac2.policies.budget import MemoryBudget, memory_budget
from sac2.policies.presets import compose, every_other_matmul, llm, llm_save_list, recompute_linears
from sac2.policies.torchtitan_sac import torchtitan, torchtitan_save_list

__all__ = [
    "memory_budget",
    "MemoryBudget",
    "llm",
    "llm_save_list",
    "torchtitan",
    "torchtitan_save_list",
    "every_other_matmul",
    "recompute_linears",
    "compose",
]
