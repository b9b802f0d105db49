"""The texts of what a policy may be and answer: op lists, the presets' and ``compose``'s arguments, memory budgets, the
knapsack, profiling costs (``sac2.core.decisions``, ``sac2.policies``, ``sac2.policies.knapsack``,
``sac2.policies.profile``).
"""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "forward_state_needs_sac2", "bad_policy_answer", "op_list_packet", "op_list_bad_item", "not_a_policy",
    "recompute_linears_not_linear", "recompute_linears_unmatched", "recompute_linears_twins", "compose_bad_answer",
    "COMPOSE_NO_POLICY", "compose_not_callable", "torchtitan_not_linear", "budget_unprofiled_call", "budget_bad_type",
    "budget_fraction_out_of_range", "budget_negative_bytes", "knapsack_negative_capacity", "KNAPSACK_NEGATIVE_ITEMS",
    "profile_bad_cost",
]


def forward_state_needs_sac2(policy: object) -> str:
    return (
        f"sac2: the policy {policy!r} counts op calls within each checkpointed forward, which needs sac2's "
        f"modes: build the context_fn with sac2.create_selective_checkpoint_contexts (it works with "
        f"torch.utils.checkpoint.checkpoint too), not torch's create_selective_checkpoint_contexts."
    )


def bad_policy_answer(value: object, op: str, call_index: int) -> str:
    return (
        f"sac2: the policy returned {value!r} (type {type(value).__name__}) for {op} "
        f"(call {call_index}); a policy must return a CheckpointPolicy member or a bool (True saves)."
    )


def op_list_packet(op: object) -> str:
    """Led by torch's own words for this error, which code may match."""
    return (
        f"Expected op in `op_list` to be an OpOverload but got {op} of type {type(op)}. Please update "
        f"the OpOverloadPacket to a specific OpOverload: an OpOverloadPacket names every overload of the "
        f"op; list the overload the op runs as, e.g. {op}.default."
    )


def op_list_bad_item(op: object) -> str:
    """Led by torch's own words for this error, which code may match."""
    return (
        f"Expected op in `op_list` to be an OpOverload, a higher-order op or a sac2.Region, but got "
        f"{op!r} (type {type(op).__name__}); list OpOverloads such as torch.ops.aten.mm.default, "
        f"higher-order ops such as torch.ops.higher_order.flex_attention, or regions such as "
        f"sac2.Region('attn')."
    )


def not_a_policy(value: object) -> str:
    """Led by torch's own words for this error, which code may match."""
    return (
        f"policy_fn_or_list must be either a function or a list of ops. Got {type(value).__name__}: pass a "
        f"policy function, a sac2 policy or a list such as [torch.ops.aten.mm.default]."
    )


def recompute_linears_not_linear(fqn: str, name: str, module: object) -> str:
    return (
        f"sac2.policies.recompute_linears: {fqn!r} (matched by {name!r}) is a {type(module).__name__}, "
        f"not an nn.Linear; name the Linear inside it."
    )


def recompute_linears_unmatched(unmatched: Sequence[str]) -> str:
    return (
        f"sac2.policies.recompute_linears: no module of the model is named {unmatched}, so nothing is forced "
        f"to recompute for them (torchtitan's default 'moe.router.gate' matches nothing in a dense model too)."
    )


def recompute_linears_twins(twins: Sequence[str], chosen: Sequence[str]) -> str:
    return (
        f"sac2.policies.recompute_linears: {twins} have the same weight shape as {chosen}, so their "
        f"matmuls are recomputed too (a dispatch mode recognises a matmul by its shapes)."
    )


def compose_bad_answer(policy: object, answer: object, op: str) -> str:
    return (
        f"sac2.policies.compose: {policy!r} returned {answer!r} for {op}; a policy must "
        f"return a CheckpointPolicy member or a bool (True saves)."
    )


COMPOSE_NO_POLICY = "sac2.policies.compose: give at least one policy."


def compose_not_callable(policy: object) -> str:
    return f"sac2.policies.compose: {policy!r} is not a policy callable."


def torchtitan_not_linear(fqn: str, module: object) -> str:
    return (
        f"sac2.policies.torchtitan: force_recompute_mm_shapes_by_fqns matched {fqn!r}, a "
        f"{type(module).__name__}; it must match nn.Linear modules."
    )


def budget_unprofiled_call(op: str, n: int, seen: int) -> str:
    return (
        f"sac2.memory_budget: this forward runs {op} (call {n} of that op), which the profiled "
        f"forward did not run ({seen} calls of it): it is recomputed, so the budget keeps no more than it "
        f"profiled. sac2.explain(fn, inputs, policy) shows what this forward keeps next to the budget's "
        f"prediction; profile with inputs that take the same path for the same decisions."
    )


def budget_bad_type(budget: object) -> str:
    return f"sac2.memory_budget: budget must be a fraction (float) or bytes (int), got {budget!r}."


def budget_fraction_out_of_range(budget: float) -> str:
    return f"sac2.memory_budget: a fractional budget must be in [0, 1], got {budget}; pass an int for bytes."


def budget_negative_bytes(budget: int) -> str:
    return f"sac2.memory_budget: a budget in bytes must be >= 0, got {budget}."


def knapsack_negative_capacity(capacity: int) -> str:
    return f"sac2.policies.knapsack: capacity must be >= 0, got {capacity}."


KNAPSACK_NEGATIVE_ITEMS = "sac2.policies.knapsack: weights and values must be >= 0."


def profile_bad_cost(cost: object) -> str:
    return f"sac2.policies.profile: cost must be 'time' or 'flops', got {cost!r}."
