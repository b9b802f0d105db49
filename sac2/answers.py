"""What a policy may answer, how an answer becomes a decision, and how a list of ops becomes a policy.

sac2 re-exports torch's ``CheckpointPolicy`` and ``SelectiveCheckpointContext`` rather than defining look-alikes,
so a policy written for either library returns values the other understands, and comparisons such as
``policy is CheckpointPolicy.MUST_SAVE`` mean the same thing everywhere.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Union

from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from sac2 import _compat, pickling
from sac2.keys import KEYED_OPS, Region, region_of

__all__ = [
    "CheckpointPolicy",
    "SelectiveCheckpointContext",
    "PolicyFn",
    "ForwardContext",
    "forward_state",
    "OFFLOADING",
    "SAVING",
    "SaveList",
    "as_policy",
    "decide",
    "is_save",
    "op_name",
]

PolicyFn = Callable[..., Union[CheckpointPolicy, bool]]

#: The answers that keep the output in host memory until backward (on CPU tensors: an ordinary save).
OFFLOADING = frozenset({CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD})
#: The answers that keep the output for backward.
SAVING = frozenset({CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE}) | OFFLOADING


class ForwardContext(SelectiveCheckpointContext):
    """The context sac2's forward mode passes to a policy: one per checkpointed forward (torch makes one per op),
    with ``state`` for policies that count calls within a forward (see ``forward_state``)."""

    def __init__(self) -> None:
        super().__init__(is_recompute=False)
        self.state: dict[Any, dict] = {}


def forward_state(ctx: SelectiveCheckpointContext, owner: Any) -> dict:
    """The state ``owner`` (a policy) keeps for the checkpointed forward ``ctx`` belongs to, new each forward.

    Nested checkpoints have separate contexts, so separate state. Under torch's own SAC modes there is no
    per-forward context (torch makes a new one per op), so a policy that needs one raises instead of deciding
    wrongly.
    """
    if type(ctx) is not ForwardContext:
        raise RuntimeError(
            f"sac2: the policy {owner!r} counts op calls within each checkpointed forward, which needs sac2's "
            f"modes: build the context_fn with sac2.create_selective_checkpoint_contexts (it works with "
            f"torch.utils.checkpoint.checkpoint too), not torch's create_selective_checkpoint_contexts."
        )
    state = ctx.state.get(owner)
    if state is None:
        state = ctx.state[owner] = {}
    return state


def op_name(op: Any) -> str:
    """A short readable name of an op or a replay key: ``aten.mm.default``, ``flex_attention``,
    ``region 'attn'``, ``inductor_compiled_code[attn]`` (a compiled callable, by its torch.compile name)."""
    if type(op) is Region:
        return f"region {op.name!r}"
    if isinstance(op, _compat.OpOverload):
        return str(op)
    if isinstance(op, _compat.HigherOrderOperator):
        return op.name()
    if type(op) is tuple:  # a compiled callable's replay key: (hop, idx, name)
        return f"{op_name(op[0])}[{op[2] or 'callable ' + str(op[1])}]"
    return str(op)


def decide(value: Any, op: Any, call_index: int) -> CheckpointPolicy:
    """Normalise what a policy returned: a ``CheckpointPolicy`` or a bool (True saves), else TypeError."""
    if type(value) is CheckpointPolicy:
        return value
    if type(value) is bool:
        return CheckpointPolicy.MUST_SAVE if value else CheckpointPolicy.PREFER_RECOMPUTE
    raise TypeError(
        f"sac2: the policy returned {value!r} (type {type(value).__name__}) for {op_name(op)} "
        f"(call {call_index}); a policy must return a CheckpointPolicy member or a bool (True saves)."
    )


def is_save(policy: CheckpointPolicy) -> bool:
    """Whether a policy keeps the op's output (SAVE and CPU_OFFLOAD do, RECOMPUTE does not)."""
    return policy in SAVING


class SaveList:
    """The policy a list of ops stands for: MUST_SAVE for those ops, PREFER_RECOMPUTE for all others.

    The modes read ``ops`` directly (a set lookup per op), so a list policy costs no Python call per op.
    """

    __slots__ = ("ops",)

    def __init__(self, ops: Iterable[Any]) -> None:
        ops = list(ops)
        for op in ops:
            if isinstance(op, _compat.OpOverloadPacket):
                raise ValueError(  # torch's own words for this error lead, which code may match
                    f"Expected op in `op_list` to be an OpOverload but got {op} of type {type(op)}. Please update "
                    f"the OpOverloadPacket to a specific OpOverload: an OpOverloadPacket names every overload of the "
                    f"op; list the overload the op runs as, e.g. {op}.default."
                )
            if not isinstance(op, (_compat.OpOverload, _compat.HigherOrderOperator, Region)):
                raise ValueError(  # led by torch's own words for this error, which code may match
                    f"Expected op in `op_list` to be an OpOverload, a higher-order op or a sac2.Region, but got "
                    f"{op!r} (type {type(op).__name__}); list OpOverloads such as torch.ops.aten.mm.default, "
                    f"higher-order ops such as torch.ops.higher_order.flex_attention, or regions such as "
                    f"sac2.Region('attn')."
                )
        self.ops = frozenset(ops)

    def __call__(self, ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        # As the modes' own lookup: a compiled callable given a name matches a Region of that name too.
        saved = op in self.ops or (op in KEYED_OPS and region_of(op, args) in self.ops)
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"SaveList({sorted(map(op_name, self.ops))})"

    def __reduce__(self) -> tuple:
        # Ops pickle by their path under torch.ops (sac2._compat's reducer), also HOPs made after sac2's import.
        pickling.register_op_pickling(self.ops)
        return SaveList, (list(self.ops),)


def as_policy(policy_fn_or_list: Any) -> PolicyFn:
    """A policy callable from a policy function or a list/tuple/set of ops."""
    if isinstance(policy_fn_or_list, (list, tuple, set, frozenset)):
        return SaveList(policy_fn_or_list)
    if callable(policy_fn_or_list):
        return policy_fn_or_list
    raise TypeError(
        f"sac2: expected a policy function or a list of ops, got {type(policy_fn_or_list).__name__}."
    )
