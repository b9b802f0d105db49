"""The texts of wrapping a model: the module wrappers, ``apply_ac`` and the regions it makes,
``compiled_region``; and of the integrations, torch.distributed's wrappers and the bench.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "no_attribute",
    "WRAPPER_REENTRANT_WITH_POLICY", "nested_checkpoint", "already_checkpointed", "CHECKPOINT_MODULE_REENTRANT",
    "apply_ac_bad_mode", "apply_ac_policy_needs_selective", "apply_ac_save_needs_regions", "apply_ac_bad_every",
    "apply_ac_checkpointed_twice", "APPLY_AC_CONTAINER_NOT_SUBMODULE", "apply_ac_blocks_is_one_name",
    "APPLY_AC_PREDICATE_MATCHED_NOTHING", "apply_ac_no_such_submodule", "APPLY_AC_NO_CONTAINER",
    "apply_ac_several_containers", "apply_ac_unknown_keywords", "apply_ac_budget_with",
    "APPLY_AC_EXAMPLE_INPUTS_ALONE", "apply_ac_budget_keeps_full_ac", "apply_ac_block_not_called",
    "REGIONS_NOTHING_TO_SAVE", "regions_bad_target", "pattern_matches_nothing",
    "NO_ATTENTION_CALL", "nested_regions", "region_is_checkpointed", "region_holds_checkpoints",
    "region_is_container", "region_forward_on_instance", "mode_above_sac2_modes", "not_an_op_path",
    "not_a_wrap_policy", "INSTALL_UNINSTALLED", "install_rebound", "torchtitan_blocks_unwrapped",
    "bench_memory_bad_device", "block_label", "eager_fallback",
]


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


def apply_ac_unknown_keywords(names: Sequence[str], known: Sequence[str]) -> str:
    """Led by Python's own words for an unexpected keyword argument."""
    return (
        f"sac2.apply_ac() got unexpected keyword arguments {list(names)}: besides its own arguments it takes "
        f"sac2.checkpoint's options only ({', '.join(known)}), never the blocks' forward arguments."
    )


def apply_ac_budget_with(what: str) -> str:
    return (
        f"sac2.apply_ac: memory_budget= chooses what each block keeps, so it takes no {what}; drop one of them."
    )


APPLY_AC_EXAMPLE_INPUTS_ALONE = (
    "sac2.apply_ac: example_inputs= are what a memory_budget= is profiled on; pass memory_budget= too, or drop "
    "example_inputs=."
)


def apply_ac_budget_keeps_full_ac(budget: float | int, device: str) -> str:
    return (
        f"sac2.apply_ac: memory_budget={budget}: nothing a budget could keep pays on this {device} (keeping it costs "
        f"more on sac2's path than recomputing it saves), so every block runs full AC and keeps only its inputs."
    )


def apply_ac_block_not_called(block: str) -> str:
    return (
        f"sac2.apply_ac: block {block!r} did not run when the model was called on the inputs a memory_budget is "
        f"profiled on; pass example_inputs= that run every block, or blocks= that run."
    )


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


# --- a checkpointed block under torch.compile -----------------------------------------------------------------------


def block_label(block: object) -> str:
    """How a warning names a checkpointed block: a function's (a partial's, a bound method's) qualified name, else
    the class of the object checkpointed (a module)."""
    while isinstance(block, functools.partial):
        block = block.func
    qualname = getattr(block, "__qualname__", None)
    return qualname if isinstance(qualname, str) else type(block).__name__


def _graph_break(graph_break: tuple[str, str] | None) -> str:
    """dynamo's graph break, reason and place, in a line: its kind (the reason's first line) and its debug context."""
    if graph_break is None:
        return "dynamo recorded no graph break since torch._dynamo.reset() (it may have skipped the frame)"
    reason, where = graph_break
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    context = [line for line in lines if line.startswith("Developer debug context:")]
    kind = "; ".join(lines[:1] + [c.removeprefix("Developer debug context:").strip() for c in context])
    return f"dynamo's last graph break: {kind} (at {where})"


def eager_fallback(block: str | None, graph_break: tuple[str, str] | None) -> str:
    """A checkpointed block (``block``: its label; None where only sac2's contexts know it ran: torch's checkpoint
    called with sac2's ``context_fn``) runs eagerly under torch.compile; ``graph_break``: dynamo's last one."""
    what = f"the checkpointed block {block}" if block else "a block torch's checkpoint runs with sac2's context_fn"
    return (
        f"sac2: {what} ran eagerly under torch.compile: dynamo could not trace its checkpoint, so the block and its "
        f"recompute run outside the compiled graph. {_graph_break(graph_break)}. TORCH_LOGS=graph_breaks shows "
        f"every graph break; warnings.simplefilter('error', sac2.EagerFallbackWarning) makes this an error."
    )


def torchtitan_blocks_unwrapped(ac: object, blocks: Sequence[str]) -> str:
    return (
        f"sac2.integrations.torchtitan.apply_ac: {type(ac).__name__} left these blocks without sac2's "
        f"checkpoint wrapper: {blocks}. MemoryBudgetAC leaves checkpointing to the compiler and has no sac2 form."
    )


def bench_memory_bad_device(device: object, supported: Iterable[str]) -> str:
    return (
        f"sac2.measure.memory: cannot measure memory on {device}; supported devices are {' and '.join(supported)}."
    )


def no_attribute(module: str, name: str) -> str:
    """Python's own wording for a module attribute that does not exist."""
    return f"module {module!r} has no attribute {name!r}"
