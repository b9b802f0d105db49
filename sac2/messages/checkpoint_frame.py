"""The texts of ``sac2.checkpoint``'s arguments and of the checkpoint frame, most in torch's own words (code may
match them), autograd's errors for saved tensors written in place, ``debug=True``'s trace, and sac2's internal
errors with the invariants they name (``sac2.api.checkpointing``, the frame, ``sac2._compat.torch_checkpoint``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = [
    "unexpected_keyword_arguments", "REENTRANT_WITH_POLICY", "REENTRANT_OPTIONS", "HOOKS_BYPASSED", "unpacked_twice",
    "more_saved_in_recompute", "saved_count_differs", "metadata_differs", "CONTEXT_SUPPRESSED_ERROR",
    "DEVICE_INITIALIZED_IN_FORWARD", "bad_determinism_check", "FRAME_YIELDED_TWICE", "saved_tensor_modified",
    "internal_error", "not_a_generator", "TORCH_DEBUG_HEAD", "TORCH_DEBUG_NON_DETERMINISM", "debug_trace",
    "SLOT_UNFILLED", "NO_CONTEXTS", "NO_STOP_PENDING",
    "NEVER_PACKED", "NOT_OFFLOADED", "NOT_SAVED", "COMPOSE_EMPTY", "PROFILER_NOT_RUN", "COPY_BACK_NOT_STARTED",
    "NO_GRADIENT", "NOT_IN_FORWARD", "saved_tensor_written_after_forward", "unpack_hook_returned",
    "checkpoint_input_modified", "illegal_transition",
]


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


def checkpoint_input_modified(tensor: str, version: int, saved: int, index: int) -> str:
    """autograd's error (its words lead) for an input of a checkpointed call written in place after the call
    started: recompute runs the function again from it."""
    return (
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"{tensor} is at version {version}; expected version {saved} instead. sac2: it is input {index} of a "
        "checkpointed function, written in place after the checkpointed call started; recompute runs the function "
        "again from its inputs, so it would compute from another value than the forward used. Write into a copy "
        "(t = t.clone()) or after the backward."
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
NOT_IN_FORWARD = "a saved region was recorded while its record's forward was not running"


def illegal_transition(state: str, to: str) -> str:
    """A saved entry (``sac2.record.saved.Saved``) asked to go from ``state`` to ``to``, which its lifecycle has no step
    for."""
    return f"a saved entry in state {state} was moved to {to}, which its lifecycle does not allow"


#: torch's own words for a recompute that differs from its forward under ``debug=True`` (``torch.utils.checkpoint``'s
#: error template: its head, and its error section up to where it points at its stack traces, which sac2's op lists
#: replace), line breaks and all, for the tests and log searches that match them.
TORCH_DEBUG_HEAD = (
    "An error happened while unpacking tensors; dumping logs of latest computation\n"
    "because you passed `debug=True` to `torch.utils.checkpoint.checkpoint()`.\n"
)
TORCH_DEBUG_NON_DETERMINISM = (
    " ERROR: Detected non-determinism while running activation checkpointing\n"
    "\n"
    " You are seeing this error because you passed `debug=True` to checkpoint and\n"
    " tensors to be saved during the original forward and differ between those saved\n"
    " during recomputation. This can happen if different operators were ran in the\n"
    " original forward and in the recomputation.\n"
)


def debug_trace(
    error: str, forward: Sequence[str], recompute: Sequence[str], saved: Sequence[str], differs: bool
) -> str:
    """``debug=True``: ``error``, then the ops forward and recompute ran, side by side (the first difference
    marked ``<<``), then what sac2's selective modes saved. Where the recompute ``differs`` from the forward (what
    it saved: count, metadata; the ops it ran: divergence), torch's own debug wording leads."""
    width = max([len(op) for op in forward] + [len("forward")])
    shorter = min(len(forward), len(recompute))
    first = next((i for i in range(shorter) if forward[i] != recompute[i]), shorter)
    lines = [f"{'':>5}  {'forward':<{width}}  recompute"]
    for i in range(max(len(forward), len(recompute))):
        a = forward[i] if i < len(forward) else "-"
        b = recompute[i] if i < len(recompute) else "-"
        lines.append(f"{i:>5}  {a:<{width}}  {b}{'  <<' if i == first else ''}")
    kept = ", ".join(saved) if saved else "nothing (full activation checkpointing, or no selective policy)"
    head = f"{TORCH_DEBUG_HEAD}\n{TORCH_DEBUG_NON_DETERMINISM}\n" if differs else ""
    return (
        f"{head}{error.rstrip()}\n\nsac2 debug trace (debug=True): the ops the checkpointed function dispatched, "
        f"first difference marked <<\n" + "\n".join(lines) + f"\nsac2 saved: {kept}"
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
