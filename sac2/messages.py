"""Every text sac2 shows its user: the messages of the exceptions it raises and of the warnings it gives.

One function or constant per message, grouped by the module that raises it, each building the exact text the
tests pin. Callers pass what the text names (op names as ``op_name`` renders them, positions as
``Record.describe`` renders them); this module computes nothing else and imports nothing from sac2, so every
module, ``_compat`` included, can use it. Texts that reproduce torch's own wording (its ``CheckpointError``s,
``Expected op in op_list...``) say so: code may match them. Whether a warning is given once is
``sac2.notices``' business; the bench's command-line errors belong to ``sac2.bench.cli``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    # divergence (sac2.modes, sac2.region_record)
    "DIVERGED", "diverged", "recompute_diverged", "recompute_ran_past_forward", "recompute_ended_early",
    "region_diverged", "regions_ended_early",
    # saved values that went stale (sac2.modes, sac2.record, sac2.region_record)
    "unseen_writes", "overlapping_write", "stale_in_forward", "stale_after_region", "saved_output_modified",
    # policies (sac2.answers, sac2.policies)
    "forward_state_needs_sac2", "bad_policy_answer", "op_list_packet", "op_list_bad_item", "not_a_policy",
    "recompute_linears_not_linear", "recompute_linears_unmatched", "recompute_linears_twins",
    "compose_bad_answer", "COMPOSE_NO_POLICY", "compose_not_callable", "torchtitan_not_linear",
    "budget_unprofiled_call", "budget_bad_type", "budget_fraction_out_of_range", "budget_negative_bytes",
    "knapsack_negative_capacity", "KNAPSACK_NEGATIVE_ITEMS", "profile_bad_cost",
    # checkpoint (sac2.checkpointing) and torch's frame errors (sac2.frame, sac2._compat.torch_checkpoint)
    "unexpected_keyword_arguments", "REENTRANT_WITH_POLICY", "REENTRANT_OPTIONS", "HOOKS_BYPASSED",
    "unpacked_twice", "more_saved_in_recompute", "saved_count_differs", "metadata_differs",
    "CONTEXT_SUPPRESSED_ERROR", "DEVICE_INITIALIZED_IN_FORWARD", "bad_determinism_check", "FRAME_YIELDED_TWICE",
    "saved_tensor_modified", "internal_error", "not_a_generator", "debug_trace", "SLOT_UNFILLED", "NO_CONTEXTS",
    "NO_STOP_PENDING", "illegal_transition",
    "NEVER_PACKED", "NOT_OFFLOADED", "NOT_SAVED", "COMPOSE_EMPTY", "PROFILER_NOT_RUN", "COPY_BACK_NOT_STARTED",
    "NO_GRADIENT", "NOT_KEPT",
    # wrappers, apply_ac, regions (sac2.wrappers, sac2.apply, sac2.model_regions, sac2.compiled)
    "WRAPPER_REENTRANT_WITH_POLICY", "nested_checkpoint", "already_checkpointed", "CHECKPOINT_MODULE_REENTRANT",
    "apply_ac_bad_mode", "apply_ac_policy_needs_selective", "apply_ac_save_needs_regions", "apply_ac_bad_every",
    "apply_ac_checkpointed_twice", "APPLY_AC_CONTAINER_NOT_SUBMODULE", "apply_ac_blocks_is_one_name",
    "APPLY_AC_PREDICATE_MATCHED_NOTHING", "apply_ac_no_such_submodule", "APPLY_AC_NO_CONTAINER",
    "apply_ac_several_containers", "REGIONS_NOTHING_TO_SAVE", "regions_bad_target", "pattern_matches_nothing",
    "NO_ATTENTION_CALL", "nested_regions", "region_is_checkpointed", "region_holds_checkpoints",
    "region_is_container", "region_forward_on_instance", "mode_above_sac2_modes",
    # integrations, distributed wrappers, bench
    "not_an_op_path", "not_a_wrap_policy", "INSTALL_UNINSTALLED", "install_rebound", "torchtitan_blocks_unwrapped",
    "bench_memory_bad_device",
    # advise
    "advise_nothing_fits", "advise_block_never_called", "advise_no_loss", "advise_bad_target", "advise_bad_steps",
    "advise_unknown_candidate", "ADVISE_NO_TRANSFORMERS", "advise_no_such_config", "advise_not_a_model_config",
    "advise_no_causal_lm", "advise_config_not_json", "advise_config_without_model_type",
    "advise_factory_bad_form", "advise_factory_import", "advise_factory_no_function", "advise_factory_bad_return",
    "advise_bad_memory_target", "ADVISE_PLOT_NEEDS_MATPLOTLIB",
]

# --- divergence: recompute ran other ops than forward -------------------------------------------------------------

DIVERGED = (
    "The checkpointed function must run the same ops in backward as in forward: look for control flow that "
    "depends on global state, on data that changed since forward, or on whether a tensor requires grad, and for "
    "state the function updates as it runs, such as a KV cache (Hugging Face models: pass use_cache=False when "
    "training with checkpointing)."
)

_FRESH = "aten.lift_fresh"


def diverged(forward_op: str) -> str:
    """The advice for a divergence at an op forward ran (its name): ``DIVERGED``, led by the likely cause where the
    op says.

    ``lift_fresh`` is ``torch.tensor(...)`` from Python data: a forward that made one where recompute did not was
    setting up state on its first call, as a KV cache does (transformers' ``DynamicCache``)."""
    if forward_op.startswith(_FRESH):
        return (
            "Forward built a tensor from Python data here (torch.tensor) and recompute did not: the function keeps "
            "state across calls that it set up in forward, such as a KV cache filled on its first call. Hugging "
            "Face models build a DynamicCache in train mode unless use_cache=False: pass use_cache=False (or set "
            "model.config.use_cache = False) when training with checkpointing. " + DIVERGED
        )
    return DIVERGED


def recompute_diverged(i: int, forward_ran: str, recompute_ran: str, advice: str) -> str:
    return (
        f"sac2: recompute diverged from forward at op {i} of the region: forward ran "
        f"{forward_ran}, recompute ran {recompute_ran}. {advice}"
    )


def recompute_ran_past_forward(op: str, i: int, n: int) -> str:
    return f"sac2: recompute ran {op} as op {i} of the region, but the forward ran only {n} ops. {DIVERGED}"


def recompute_ended_early(cursor: int, n: int, missing: str) -> str:
    return (
        f"sac2: recompute ended after {cursor} ops, but the forward ran {n}; the first op missing is "
        f"{missing}. {DIVERGED}"
    )


def region_diverged(i: int, forward_ran: str, region: str) -> str:
    return (
        f"sac2: recompute diverged from forward at op {i} of the region: forward ran {forward_ran}, recompute ran "
        f"region {region!r}. {DIVERGED}"
    )


def regions_ended_early(cursor: int, n: int, missing: str) -> str:
    return (
        f"sac2: recompute ended after {cursor} regions, but the forward ran {n}; the first one missing is "
        f"{missing}. {DIVERGED}"
    )


# --- saved values sac2 cannot keep --------------------------------------------------------------------------------


def unseen_writes(op: str) -> str:
    return (
        f"sac2: the policy saves {op}, which returns nothing yet takes tensors, so it can only have "
        f"written into them in ways sac2 cannot see or write back; it is recomputed in backward instead of saved."
    )


def overlapping_write(op: str) -> str:
    return (
        f"sac2: the policy saves {op}, which wrote into a tensor whose elements overlap in memory (an "
        f"expanded view), so what it wrote cannot be copied back; it is recomputed in backward instead of saved. "
        f"Have the policy recompute it, or write into a contiguous tensor, to silence this warning."
    )


def stale_in_forward(position: str, wrote: bool) -> str:
    return (
        f"sac2: the policy saves {position}, but a tensor it {'wrote' if wrote else 'returned'} was modified in "
        f"place later in the forward, so the saved value is stale; sac2 recomputes this op in backward instead. "
        f"Have the policy recompute it to silence this warning."
    )


def stale_after_region(position: str) -> str:
    return (
        f"sac2: the policy saves {position}, but a tensor it returned or wrote was modified in "
        f"place after it ran, so the saved value is stale; sac2 runs the region again in backward instead. "
        f"Have the policy recompute it to silence this warning."
    )


def saved_output_modified(position: str) -> str:
    return (
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"sac2: the output of {position} that selective checkpointing saved was "
        f"modified in place after the checkpointed forward ended, so serving it would give wrong "
        f"gradients. Don't modify the region's outputs in place, have the policy recompute this op, "
        f"or pass allow_cache_entry_mutation=True to recompute it in backward."
    )


# --- policies -----------------------------------------------------------------------------------------------------


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
    return f"sac2.knapsack: capacity must be >= 0, got {capacity}."


KNAPSACK_NEGATIVE_ITEMS = "sac2.knapsack: weights and values must be >= 0."


def profile_bad_cost(cost: object) -> str:
    return f"sac2.profile: cost must be 'time' or 'flops', got {cost!r}."


# --- checkpoint, and torch's frame errors in torch's words ------------------------------------------------------


def unexpected_keyword_arguments(names: Iterable[str]) -> str:
    """torch's error for keyword arguments without a function to checkpoint."""
    return "Unexpected keyword arguments: " + ",".join(names)


REENTRANT_WITH_POLICY = (
    "sac2.checkpoint: use_reentrant=True recomputes the whole function and cannot apply a selective "
    "policy; drop use_reentrant (sac2 defaults to False) to use context_fn."
)

#: torch 2.14's own error, given on torch 2.13 too.
REENTRANT_OPTIONS = (
    "Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` is only supported when "
    "use_reentrant=False."
)

HOOKS_BYPASSED = (
    "A saved_tensors_hooks context (e.g. save_on_cpu) is active around a selective activation checkpoint region. "
    "Tensors that SAC saves currently bypass these hooks, but a future release will route them through the hooks "
    "like any other saved tensor. Silence this warning and choose the behavior explicitly by passing "
    "respect_saved_tensors_hooks=True|False to sac2.checkpoint."
)


def saved_tensor_modified(tensor: str, version: int, saved: int, node: str | None, position: int) -> str:
    """autograd's error for a saved tensor written in place after it was saved (its words lead), and where."""
    by = f"{node} saved it" if node else "it was saved"
    return (
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"{tensor} is at version {version}; expected version {saved} instead. sac2: {by} inside a checkpointed "
        f"function (saved tensor {position} of its forward), and it was written in place after that, so the "
        "gradient would be computed from another value than the forward used. Without checkpointing autograd "
        "raises this error too: write into a copy (t = t.clone()) or after the backward."
    )


def saved_tensor_written_after_forward(tensor: str, position: int) -> str:
    """A saved tensor written after the checkpointed forward ended, under saved-tensor hooks that keep it by
    reference: backward without checkpointing would read the written values, which no recompute can make."""
    return (
        f"sac2: a tensor {tensor} saved for backward inside a checkpointed function (saved tensor {position} of its "
        "forward) was modified in place after the checkpointed forward ended. Your saved-tensor hooks keep saved "
        "tensors themselves (as save_on_cpu does for CPU tensors), so without checkpointing backward would read the "
        "written values, and no recompute can make them. Write into a copy (t = t.clone()) or after the backward."
    )


def unpack_hook_returned(kind: str) -> str:
    """autograd's words for an unpack hook that returns something else than a tensor."""
    return f"Output of saved tensor unpack_hook expected to be a Tensor but got result of type {kind}"


def internal_error(what: str) -> str:
    """A broken invariant of sac2's own engine (never the user's doing)."""
    return f"sac2 internal error: {what}. This is a bug in sac2; please report it with the code that triggers it."


#: The invariants of sac2's engine, as ``internal_error`` names them.
SLOT_UNFILLED = "recompute left no tensor at the position of a live holder"
NO_CONTEXTS = "a context_fn gave no (forward, recompute) contexts"
NO_STOP_PENDING = "early stop finished an op with no stop pending"
NEVER_PACKED = "a saved entry was unpacked that its hooks never packed"
NOT_OFFLOADED = "a saved entry was read back from the host that was never moved there"
NOT_SAVED = "a position the record serves or lists as saved holds no saved entry"
COMPOSE_EMPTY = "compose holds no policy (its constructor requires one)"
PROFILER_NOT_RUN = "allocation sizes were read from a profiler that has not run and stopped"
COPY_BACK_NOT_STARTED = "an offloaded entry was waited for before its copy back started"
NO_GRADIENT = "a tensor that requires grad has no gradient after its backward"
NOT_KEPT = "a region's unpack hook met what its pack hook never made"


def illegal_transition(state: str, to: str) -> str:
    """A saved entry (``sac2.saved.Saved``) asked to go from ``state`` to ``to``, which its lifecycle has no step
    for."""
    return f"a saved entry in state {state} was moved to {to}, which its lifecycle does not allow"


def debug_trace(error: str, forward: Sequence[str], recompute: Sequence[str], saved: Sequence[str]) -> str:
    """``debug=True``: ``error``, then the ops forward and recompute ran, side by side (the first difference
    marked ``<<``), then what sac2's selective modes saved."""
    width = max([len(op) for op in forward] + [len("forward")])
    shorter = min(len(forward), len(recompute))
    first = next((i for i in range(shorter) if forward[i] != recompute[i]), shorter)
    lines = [f"{'':>5}  {'forward':<{width}}  recompute"]
    for i in range(max(len(forward), len(recompute))):
        a = forward[i] if i < len(forward) else "-"
        b = recompute[i] if i < len(recompute) else "-"
        lines.append(f"{i:>5}  {a:<{width}}  {b}{'  <<' if i == first else ''}")
    kept = ", ".join(saved) if saved else "nothing (full activation checkpointing, or no selective policy)"
    return (
        f"{error}\n\nsac2 debug trace (debug=True): the ops the checkpointed function dispatched, first difference "
        f"marked <<\n" + "\n".join(lines) + f"\nsac2 saved: {kept}"
    )


def not_a_generator(value: object) -> str:
    return f"sac2.preserve_generators takes torch.Generator objects, got {type(value).__name__}."


def unpacked_twice(in_graph_exec_group: bool) -> str:
    """torch's error for a saved tensor unpacked a second time in one backward (``in_graph_exec_group``: inside
    ``torch.utils.checkpoint.GraphExecGroup``)."""
    extra = ""
    if in_graph_exec_group:
        extra = (
            "Performing two backward calls that overlap (i.e. require the same saved activation in order to compute "
            "gradients) is not allowed while under the torch.utils.checkpoint.GraphExecGroup context. "
        )
    return (
        "torch.utils.checkpoint: Unpack is being triggered for a tensor that was already unpacked once. "
        f"{extra}If you are calling ctx.saved_tensors in backward, make sure to do so only once. Otherwise please "
        "open an issue with details on your use case."
    )


def more_saved_in_recompute(tip: str) -> str:
    """torch's error; ``tip`` is the debug tip torch appends (``_compat.DEBUG_TIP``)."""
    return (
        "torch.utils.checkpoint: trying to save more tensors during recomputation than during the "
        "original forward pass.\n" + tip
    )


def saved_count_differs(forward: int, recompute: int, tip: str) -> str:
    """torch's error; ``tip`` is the debug tip torch appends (``_compat.DEBUG_TIP``)."""
    return (
        "torch.utils.checkpoint: A different number of tensors was saved during the original forward and "
        f"recomputation.\nNumber of tensors saved during forward: {forward}\nNumber of tensors saved during "
        f"recomputation: {recompute}.\n" + tip
    )


def metadata_differs(mismatches: Sequence[tuple[int, object, object]], tip: str) -> str:
    """torch's error; ``mismatches``: (position, saved metadata, recomputed metadata) per tensor, ``tip``: the debug
    tip torch appends."""
    details = "".join(
        f"tensor at position {i}:\nsaved metadata: {saved}\nrecomputed metadata: {recomputed}\n"
        for i, saved, recomputed in mismatches
    )
    return (
        "torch.utils.checkpoint: Recomputed values for the following tensors have different metadata than "
        f"during the forward pass.\n{details}.\n" + tip
    )


#: torch's error when a ``context_fn``'s forward context swallows the forward's exception.
CONTEXT_SUPPRESSED_ERROR = (
    "torch.utils.checkpoint: the forward context provided by context_fn suppressed an exception raised "
    "during the checkpointed forward. This is not supported because checkpoint cannot return a value "
    "for a failed forward."
)

#: torch's error.
DEVICE_INITIALIZED_IN_FORWARD = (
    "PyTorch's device state was initialized in the forward pass of a Checkpoint, which is not allowed. "
    "Please open an issue if you need this feature."
)


def bad_determinism_check(valid: Iterable[str], got: str) -> str:
    """torch's error."""
    return f"determinism_check should be one of {list(valid)}, but got {got}"


FRAME_YIELDED_TWICE = "torch.utils.checkpoint: expected the frame generator to yield exactly once"

# --- wrappers, apply_ac and regions -------------------------------------------------------------------------------

WRAPPER_REENTRANT_WITH_POLICY = (
    "sac2.checkpoint_wrapper: CheckpointImpl.REENTRANT recomputes the whole module and cannot apply "
    "a selective policy (context_fn); use CheckpointImpl.NO_REENTRANT, the default."
)


def nested_checkpoint(module: object) -> str:
    return (
        f"sac2: this {type(module).__name__} is checkpointed inside the forward of another checkpoint, so backward "
        f"recomputes it twice. Checkpoint it once: drop the outer checkpoint (in transformers, "
        f"model.gradient_checkpointing_disable()) or the sac2 wrapper."
    )


def already_checkpointed(module: object) -> str:
    return f"sac2.checkpoint_module: this {type(module).__name__} is already checkpointed."


CHECKPOINT_MODULE_REENTRANT = (
    "sac2.checkpoint_module: use_reentrant=True is not supported; the in-place form runs sac2's "
    "non-reentrant checkpoint."
)


def apply_ac_bad_mode(mode: object, modes: Sequence[str]) -> str:
    return f"sac2.apply_ac: mode={mode!r}; expected one of {modes}."


def apply_ac_policy_needs_selective(mode: str) -> str:
    return f"sac2.apply_ac: a policy only applies to mode='selective', not mode={mode!r}."


def apply_ac_save_needs_regions(mode: str) -> str:
    return f"sac2.apply_ac: save= only applies to mode='regions', not mode={mode!r}."


def apply_ac_bad_every(every: object) -> str:
    return f"sac2.apply_ac: every={every!r}; expected a positive int (1 wraps every block)."


def apply_ac_checkpointed_twice(names: Sequence[str]) -> str:
    return (
        f"sac2.apply_ac: {names} already run under transformers' gradient checkpointing "
        f"(gradient_checkpointing = True), so wrapping them checkpoints them twice. Call "
        f"model.gradient_checkpointing_disable() before sac2.apply_ac."
    )


APPLY_AC_CONTAINER_NOT_SUBMODULE = "sac2.apply_ac: the blocks container given is not a submodule of the model."


def apply_ac_blocks_is_one_name(blocks: str) -> str:
    return f"sac2.apply_ac: blocks={blocks!r} is one name; pass a list of names, e.g. [{blocks!r}]."


APPLY_AC_PREDICATE_MATCHED_NOTHING = "sac2.apply_ac: the blocks predicate accepted no submodule of the model."


def apply_ac_no_such_submodule(fqn: str) -> str:
    return f"sac2.apply_ac: the model has no submodule named {fqn!r}."


APPLY_AC_NO_CONTAINER = (
    "sac2.apply_ac: found no nn.ModuleList/ModuleDict of blocks in the model; pass blocks= (a container, "
    "module names or a predicate)."
)


def apply_ac_several_containers(fqns: Sequence[str]) -> str:
    return f"sac2.apply_ac: several containers could hold the blocks: {fqns}; pass blocks=."


REGIONS_NOTHING_TO_SAVE = "sac2.apply_ac: mode='regions' needs at least one thing to save (save=...)."


def regions_bad_target(target: object) -> str:
    return (
        f"sac2.apply_ac: save={target!r} is neither a module class nor a string ('attention', 'linear', "
        f"'experts', or a glob over module names inside a block such as 'mlp.down_proj')."
    )


def pattern_matches_nothing(missed: Sequence[str | type], blocks: Sequence[tuple[str, nn.Module]]) -> str:
    """``save=`` targets that matched no module inside the blocks, with a sample of the names there."""
    sample = [n for n, _ in blocks[0][1].named_modules() if n][:6] if blocks else []
    return (
        f"sac2.apply_ac: save={missed} matches no module inside the blocks ({[b for b, _ in blocks][:3]}...); "
        f"module names there look like {sample}."
    )


NO_ATTENTION_CALL = (
    "sac2.apply_ac: save='attention' found no attention call to make a region: the model is not a "
    "transformers model (whose attention interface sac2 can wrap) and its blocks have no attention kernel "
    "module (a module without parameters whose class name ends in 'Attention', as torchtitan's). If the "
    "blocks call F.scaled_dot_product_attention inline, wrap that call with sac2.region(name='attention')."
)


def nested_regions(inner: str, outer: str) -> str:
    return (
        f"sac2.apply_ac: {inner!r} is inside {outer!r}, and both would be regions; a region is one op for the "
        f"policy, so one cannot hold another. Save one of them (narrow the module class or name pattern)."
    )


def region_is_checkpointed(name: str) -> str:
    return f"sac2.apply_ac: {name!r} is checkpointed itself; a checkpoint cannot be a region."


def region_holds_checkpoints(name: str, inner: Sequence[str]) -> str:
    return (
        f"sac2.apply_ac: {name!r} holds checkpointed modules ({inner}); a region's body runs once and is "
        f"kept or run again whole, so it cannot hold a checkpoint."
    )


def region_is_container(name: str, module: object) -> str:
    return (
        f"sac2.apply_ac: {name!r} is a {type(module).__name__}, which is never called; name the "
        f"modules inside it."
    )


def region_forward_on_instance(name: str) -> str:
    return (
        f"sac2.apply_ac: {name!r} has its own forward set on the instance, which a region cannot "
        f"wrap; make it a region by hand with sac2.region."
    )


def mode_above_sac2_modes(mode: object) -> str:
    """``sac2.compiled_region`` entered with another dispatch mode above sac2's."""
    kind = type(mode)
    return (
        f"sac2.compiled_region: {kind.__module__}.{kind.__qualname__} is on the dispatch-mode "
        f"stack above sac2's modes; sac2 pops only its own modes, which must be innermost. Enter that mode "
        f"outside the checkpointed function, or inside the region's body."
    )


# --- integrations, torch.distributed's wrappers, bench -----------------------------------------------------------


def not_an_op_path(path: str, found: object) -> str:
    """Unpickling a save list: the path names no op of this process's ``torch.ops``."""
    return f"sac2: torch.ops.{path} is {found!r}, not an op; the pickled save list names an op this torch lacks."



def not_a_wrap_policy(policy: object) -> str:
    return f"sac2: auto_wrap_policy {policy!r} is neither callable nor an FSDP wrap policy."


INSTALL_UNINSTALLED = "sac2.integrations.install: this installation was uninstalled."


def install_rebound(names: Sequence[str]) -> str:
    return (
        "sac2.integrations.install: these names still run torch's activation checkpointing, not sac2's: "
        f"{names}. Something rebound them after install(); call install() again."
    )


def torchtitan_blocks_unwrapped(ac: object, blocks: Sequence[str]) -> str:
    return (
        f"sac2.integrations.torchtitan.apply_ac: {type(ac).__name__} left these blocks without sac2's "
        f"checkpoint wrapper: {blocks}. MemoryBudgetAC leaves checkpointing to the compiler and has no sac2 form."
    )


def bench_memory_bad_device(device: object, supported: Iterable[str]) -> str:
    return (
        f"sac2.bench.memory: cannot measure memory on {device}; supported devices are {' and '.join(supported)}."
    )


# --- advise --------------------------------------------------------------------------------------------------------


def advise_nothing_fits(target: str, least: str, least_kept: str) -> str:
    return (
        f"recommended: nothing: no setup keeps at most {target}; the least is {least} ({least_kept} kept). "
        "Raise the target or try more setups (candidates=[...])."
    )


def advise_block_never_called(block: str) -> str:
    return f"sac2.advise: block {block!r} did not run when the model was called on example_inputs."


def advise_no_loss(output: object) -> str:
    return (
        f"sac2.advise: cannot make a scalar loss of the model's output ({type(output).__name__}: no .loss and no "
        "tensor in it); pass loss_fn=..."
    )


def advise_bad_target(target: object) -> str:
    return (
        f"sac2.advise: memory_target must be bytes (an int >= 0) or a fraction in (0, 1] of what no checkpointing "
        f"keeps (a float), got {target!r}."
    )


def advise_bad_steps(steps: object) -> str:
    return f"sac2.advise: steps must be a positive int, got {steps!r}."


def advise_unknown_candidate(name: str, known: Sequence[str]) -> str:
    return f"sac2.advise: no candidate setup {name!r}; the built-in ones are: {', '.join(known)}."


ADVISE_NO_TRANSFORMERS = "needs transformers (pip install transformers); or use --factory"


def advise_no_such_config(text: str, names: Sequence[str]) -> str:
    return (
        f"{text!r} is neither a config.json file on disk nor a built-in config "
        f"({', '.join(names)})"
    )


def advise_not_a_model_config(text: str, reason: str) -> str:
    return f"{text!r} is not a Hugging Face model config: {reason}"


def advise_config_not_json(text: str, error: Exception) -> str:
    return advise_not_a_model_config(text, f"not JSON ({error})")


def advise_config_without_model_type(text: str) -> str:
    return advise_not_a_model_config(text, "it has no 'model_type'")


def advise_no_causal_lm(model_type: str, reason: str) -> str:
    return f"argument --config: transformers builds no causal LM for model_type {model_type!r}: {reason}"


def advise_factory_bad_form(text: str) -> str:
    return f"must be module:function (e.g. mypkg.models:make), got {text!r}"


def advise_factory_import(module: str, error: Exception) -> str:
    return f"cannot import module {module!r}: {type(error).__name__}: {error}"


def advise_factory_no_function(module: str, name: str) -> str:
    return f"module {module!r} has no callable {name!r}"


def advise_factory_bad_return(text: str, result: object) -> str:
    return (
        f"argument --factory: {text} returned {type(result).__name__}; it must return an nn.Module or "
        "(model, example_inputs)"
    )


def advise_bad_memory_target(text: str) -> str:
    return (
        "must be a fraction in (0, 1] of what no checkpointing keeps (e.g. 0.5) or bytes "
        f"with a unit (e.g. 200MiB, 1.5GiB, 300MB, 4096B), got {text!r}"
    )


ADVISE_PLOT_NEEDS_MATPLOTLIB = "--plot needs matplotlib: pip install 'sac2[plot]'"
