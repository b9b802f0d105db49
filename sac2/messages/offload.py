"""The texts of offload: ``apply_ac``'s ``offload=``, its limits, what it cannot do where it runs, and its internal
errors."""

from __future__ import annotations

__all__ = [
    "apply_ac_offload_with_none", "APPLY_AC_OFFLOAD_EMPTY", "apply_ac_offload_is_one_name",
    "apply_ac_bad_offload_target", "OFFLOAD_WITHOUT_ACCELERATOR", "offload_host_memory_full", "bad_offload_limit",
    "OFFLOAD_NEEDS_SAC2_FRAME", "OFFLOAD_UNDER_COMPILE", "PARCEL_RELEASED", "APPLY_AC_BUDGET_WITH_OFFLOAD",
]


def apply_ac_offload_with_none(offload: object) -> str:
    return f"sac2.apply_ac: offload={offload!r} with mode='none', which checkpoints nothing and so saves nothing."


APPLY_AC_OFFLOAD_EMPTY = (
    "sac2.apply_ac: offload= names nothing; name what to keep in host memory (\"inputs\", \"attention\", "
    "\"linear\", a module class or name, an op) or leave it out."
)


def apply_ac_offload_is_one_name(offload: str) -> str:
    return f"sac2.apply_ac: offload={offload!r} is one name; pass a list of names, e.g. [{offload!r}]."


def apply_ac_bad_offload_target(target: object) -> str:
    return (
        f"sac2.apply_ac: offload= holds {target!r} ({type(target).__name__}); expected \"inputs\", a region name "
        f"(\"attention\", \"linear\", \"experts\", a module name glob), an nn.Module class, or an op overload such "
        f"as torch.ops.aten.mm.default."
    )


APPLY_AC_BUDGET_WITH_OFFLOAD = (
    "sac2.apply_ac: memory_budget= takes no offload=: a budget is a share of what the blocks keep on the device and "
    "prices keeping against recomputing there, not against the host link offload= pays. Drop one of them, or let "
    "sac2.advise measure both side by side (on a CUDA device it adds offload rows beside its budget row)."
)


OFFLOAD_WITHOUT_ACCELERATOR = (
    "sac2.apply_ac: offload= changes nothing on this machine: it has no CUDA device, so there is no device memory to "
    "free. The blocks are checkpointed as they would be without offload=."
)


def offload_host_memory_full(cap: int) -> str:
    return (
        f"sac2 offload: the pinned host memory offload may hold ({cap} bytes) is in use, so some offloaded tensors "
        f"stay in device memory. Raise it with sac2.offload_limits(host_memory=...), or offload less."
    )


def bad_offload_limit(name: str, value: object) -> str:
    return f"sac2.offload_limits: {name}={value!r}; expected a number of bytes (an int >= 0) or None (the default)."


OFFLOAD_NEEDS_SAC2_FRAME = (
    "sac2 offload: this checkpoint runs on torch's frame (torch's checkpoint without sac2.install(), or "
    "sac2.use_torch_frame()), so what its policy offloads stays in device memory: offload's schedule runs on "
    "sac2's frame. Checkpoint with sac2.checkpoint, its wrappers or apply_ac, or call sac2.install()."
)
OFFLOAD_UNDER_COMPILE = (
    "sac2 offload: under torch.compile what a policy offloads stays in device memory (torch's partitioner saves "
    "CPU_OFFLOAD outputs; checkpoint inputs stay where they are): sac2's offload schedule runs in eager."
)
PARCEL_RELEASED = "an offloaded tensor was read after its last reader let it go"
