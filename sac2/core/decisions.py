"""What a policy may answer, how an answer becomes a decision, and how a list of ops becomes a policy.

sac2 re-exports torch's ``CheckpointPolicy`` and ``SelectiveCheckpointContext`` rather than defining look-alikes,
so a policy written for either library returns values the other understands, and comparisons such as
``policy is CheckpointPolicy.MUST_SAVE`` mean the same thing everywhere.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable, TypeAlias, Union

from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from sac2 import _compat, messages
from sac2.core import pickling
from sac2.core.keys import KEYED_OPS, PolicyOp, Region, region_of

__all__ = [
    "CheckpointPolicy",
    "SelectiveCheckpointContext",
    "PolicyFn",
    "Policy",
    "ForwardContext",
    "forward_state",
    "OFFLOADING",
    "SAVE_OFFLOAD",
    "from_bool",
    "SAVING",
    "SaveList",
    "Offloading",
    "as_policy",
    "decide",
    "is_save",
    "op_name",
]

#: A policy callable: ``policy(ctx, op, *args, **kwargs)`` answers a ``CheckpointPolicy`` or a bool (True saves).
PolicyFn: TypeAlias = Callable[..., Union[CheckpointPolicy, bool]]
#: What the API takes as a policy: a policy callable, or a list (tuple, set) of ops and regions to save.
Policy: TypeAlias = Union[PolicyFn, Collection[PolicyOp]]

#: The answers that keep the output in host memory until backward (on CPU tensors: an ordinary save).
OFFLOADING = frozenset({CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD})
#: The answers that keep the output for backward.
SAVING = frozenset({CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE}) | OFFLOADING


class ForwardContext(SelectiveCheckpointContext):
    """The context sac2's forward mode passes to a policy: one per checkpointed forward (torch makes one per op),
    with ``state`` for policies that count calls within a forward (see ``forward_state``)."""

    def __init__(self) -> None:
        super().__init__(is_recompute=False)
        self.state: dict[object, dict[Any, Any]] = {}


def forward_state(ctx: SelectiveCheckpointContext, owner: object) -> dict[Any, Any]:
    """The state ``owner`` (a policy) keeps for the checkpointed forward ``ctx`` belongs to, new each forward.

    Nested checkpoints have separate contexts, so separate state. Under torch's own SAC modes there is no
    per-forward context (torch makes a new one per op), so a policy that needs one raises instead of deciding
    wrongly.
    """
    if type(ctx) is not ForwardContext:
        raise RuntimeError(messages.forward_state_needs_sac2(owner))
    state = ctx.state.get(owner)
    if state is None:
        state = ctx.state[owner] = {}
    return state


def op_name(op: object) -> str:
    """A short readable name of an op or a replay key: ``aten.mm.default``, ``flex_attention``,
    ``region 'attn'``, ``inductor_compiled_code[attn]`` (a compiled callable, by its torch.compile name)."""
    if type(op) is Region:
        return f"region {op.name!r}"
    if isinstance(op, _compat.OpOverload):
        return str(op)
    if isinstance(op, _compat.HigherOrderOperator):
        name: str = op.name()
        return name
    if type(op) is tuple:  # a compiled callable's replay key: (hop, idx, name)
        return f"{op_name(op[0])}[{op[2] or 'callable ' + str(op[1])}]"
    return str(op)


#: What each answer asks of the op: (keep its output, keep it on the host).
SAVE_OFFLOAD: dict[CheckpointPolicy, tuple[bool, bool]] = {p: (p in SAVING, p in OFFLOADING) for p in CheckpointPolicy}


def from_bool(save: bool) -> CheckpointPolicy:
    """A bool answer as a policy: True saves (MUST_SAVE), False recomputes (PREFER_RECOMPUTE), as torch reads it."""
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def decide(value: object, op: object, call_index: int) -> CheckpointPolicy:
    """Normalise what a policy returned: a ``CheckpointPolicy`` or a bool (True saves), else TypeError."""
    if type(value) is CheckpointPolicy:
        return value
    if type(value) is bool:
        return from_bool(value)
    raise TypeError(messages.bad_policy_answer(value, op_name(op), call_index))


def is_save(policy: CheckpointPolicy) -> bool:
    """Whether a policy keeps the op's output (SAVE and CPU_OFFLOAD do, RECOMPUTE does not)."""
    return policy in SAVING


def _checked(ops: Iterable[object]) -> frozenset[PolicyOp]:
    """``ops`` as a save list holds them: op overloads, higher-order ops and ``Region``s, else ValueError."""
    checked: list[PolicyOp] = []
    for op in ops:
        if isinstance(op, _compat.OpOverloadPacket):
            raise ValueError(messages.op_list_packet(op))
        if not isinstance(op, (_compat.OpOverload, _compat.HigherOrderOperator, Region)):
            raise ValueError(messages.op_list_bad_item(op))
        checked.append(op)
    return frozenset(checked)


def _matches(op: PolicyOp, args: tuple[Any, ...], ops: frozenset[PolicyOp]) -> bool:
    """As the modes' own lookup: a compiled callable given a name matches a Region of that name too."""
    return op in ops or (op in KEYED_OPS and region_of(op, args) in ops)


class SaveList:
    """The policy a list of ops stands for: MUST_SAVE for those ops, PREFER_RECOMPUTE for all others.

    The modes read ``ops`` directly (a set lookup per op), so a list policy costs no Python call per op.
    ``keep_inputs``: its saved regions keep for real what their bodies save of their own inputs (else rebuilt in
    recompute, unless the region's name keeps them: ``sac2.record.region_saves.keep_inputs``). A property of the policy,
    so of the model ``apply_ac`` made it for, not of region names other models share. ``offload``: those of ``ops``
    kept in host memory (MUST_CPU_OFFLOAD, ``sac2.offload``); ``offload_inputs``: each checkpoint's inputs too.
    """

    __slots__ = ("ops", "keep_inputs", "offload", "offload_inputs")

    def __init__(self, ops: Iterable[object], keep_inputs: bool = False, offload: Iterable[object] = (),
                 offload_inputs: bool = False) -> None:
        self.keep_inputs = keep_inputs
        self.offload = _checked(offload)
        self.ops = _checked(ops) | self.offload
        self.offload_inputs = offload_inputs

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: PolicyOp, *args: Any, **kwargs: Any  # noqa: ARG002 (policy's)
    ) -> CheckpointPolicy:
        if self.offload and _matches(op, args, self.offload):
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        return from_bool(_matches(op, args, self.ops))

    def __repr__(self) -> str:
        keep = ", keep_inputs=True" if self.keep_inputs else ""
        offload = f", offload={sorted(map(op_name, self.offload))}" if self.offload else ""
        inputs = ", offload_inputs=True" if self.offload_inputs else ""
        return f"SaveList({sorted(map(op_name, self.ops - self.offload))}{keep}{offload}{inputs})"

    def __reduce__(self) -> tuple[type[SaveList], tuple[list[PolicyOp], bool, list[PolicyOp], bool]]:
        # Ops pickle by their path under torch.ops (sac2._compat's reducer), also HOPs made after sac2's import.
        pickling.register_op_pickling(self.ops)
        return SaveList, (list(self.ops - self.offload), self.keep_inputs, list(self.offload), self.offload_inputs)


class Offloading:
    """A policy with some of its answers moved to host memory: ``offload`` (ops and ``Region``s) answer
    MUST_CPU_OFFLOAD, every other op what ``policy`` answers; ``offload_inputs``: each checkpoint's inputs go to
    host memory too (``sac2.offload``). What ``apply_ac(offload=...)`` makes of a policy callable."""

    __slots__ = ("policy", "offload", "offload_inputs")

    def __init__(self, policy: PolicyFn, offload: Iterable[object] = (), offload_inputs: bool = False) -> None:
        self.policy = policy
        self.offload = _checked(offload)
        self.offload_inputs = offload_inputs

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: PolicyOp, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy | bool:
        if self.offload and _matches(op, args, self.offload):
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        return self.policy(ctx, op, *args, **kwargs)

    def __repr__(self) -> str:
        inputs = ", offload_inputs=True" if self.offload_inputs else ""
        return f"Offloading({self.policy!r}, {sorted(map(op_name, self.offload))}{inputs})"

    def __reduce__(self) -> tuple[type[Offloading], tuple[PolicyFn, list[PolicyOp], bool]]:
        pickling.register_op_pickling(self.offload)
        return Offloading, (self.policy, list(self.offload), self.offload_inputs)


def as_policy(policy_fn_or_list: Policy) -> PolicyFn:
    """A policy callable from a policy function or a list/tuple/set of ops."""
    if isinstance(policy_fn_or_list, (list, tuple, set, frozenset)):
        return SaveList(policy_fn_or_list)
    if callable(policy_fn_or_list):
        return policy_fn_or_list
    raise TypeError(messages.not_a_policy(policy_fn_or_list))
