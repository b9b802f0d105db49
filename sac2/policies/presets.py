"""The selective-checkpointing policies used in practice, as small pieces that compose.

Each function returns a policy callable for ``sac2.create_selective_checkpoint_contexts``. A piece answers
``MUST_*`` when it has a decision to make about an op and ``PREFER_RECOMPUTE`` when it has none, so
``compose(a, b, c)`` reads as "ask a, then b, then c; the first MUST_* answer wins".
``compose(recompute_linears(model, ["router.gate"]), every_other_matmul(), llm())`` is the idea of torchtitan's
default (``sac2.policies.torchtitan_sac``) over sac2's wider save list.

Every preset pickles (so does a ``functools.partial`` of ``create_selective_checkpoint_contexts`` over one), and
decides the same after loading: ops are stored by their path under ``torch.ops``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch
from torch import nn

from sac2 import _compat, messages
from sac2.core import pickling
from sac2.core.decisions import (
    CheckpointPolicy,
    PolicyFn,
    SelectiveCheckpointContext,
    forward_state,
    from_bool,
    op_name,
)
from sac2.core.keys import PolicyOp, Region
from sac2.core.module_names import names_module
from sac2.messages.internal import InternalError

__all__ = [
    "lookup",
    "llm_save_list",
    "llm",
    "every_other_matmul",
    "recompute_linears",
    "compose",
]

MUST_SAVE = CheckpointPolicy.MUST_SAVE
MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
PREFER_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
_MUST = frozenset({CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_CPU_OFFLOAD})

#: Every matmul torch 2.13-2.15 has (those the running torch lacks are left out): dense, batched, grouped (MoE
#: experts: transformers' grouped_mm experts, torchtitan's GroupedExperts), low-precision and weight-packed.
_MATMUL_PATHS = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten.linear.default",  # backends that register linear as a leaf op instead of decomposing it
    "aten._grouped_mm.default",
    "aten._scaled_mm.default",
    "aten._scaled_mm_v2.default",
    "aten._scaled_grouped_mm.default",
    "aten._scaled_grouped_mm_v2.default",
    "aten._int_mm.default",
    "aten._weight_int8pack_mm.default",
    "aten._weight_int4pack_mm.default",
)
# Expensive to recompute, cheap to keep: the products of linear layers and attention, and the reductions that
# low-precision training reads back (``max`` for scaling factors, ``topk`` for MoE routing).
_COMPUTE: tuple[str, ...] = _MATMUL_PATHS + (
    "aten.max.default",
    "aten.topk.default",
    # convolutions and bilinear upsampling (vision towers): compute intensive to torch's partitioner and torchtitan
    "aten.convolution.default",
    "aten.convolution_backward.default",
    "aten.upsample_bilinear2d.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_attention_math_for_mps.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
    "aten._cudnn_attention_forward.default",
    "torch_attn._varlen_attn.default",
)
# Re-running a collective in backward costs a network round trip and makes every rank wait on the slowest.
_COMMUNICATION = tuple(
    f"{ns}.{name}.default"
    for ns in ("_c10d_functional", "_c10d_functional_autograd")
    for name in (
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "all_to_all_single",
    )
)


def lookup(path: str) -> _compat.Op | None:
    """The op ``torch.ops.<path>``, or None when the running torch does not have it (presets list ops by path)."""
    obj: object = torch.ops
    for part in path.split("."):
        try:
            obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            return None
    return obj if isinstance(obj, (_compat.OpOverload, _compat.HigherOrderOperator)) else None


def llm_save_list() -> frozenset[_compat.Op]:
    """The ops an LLM block keeps: every matmul (grouped and low-precision ones too), every attention kernel,
    convolutions, max/topk and the functional collectives.

    Also flex_attention and compiled regions (``inductor_compiled_code``). Ops the running torch lacks are
    left out, so the same call works across torch versions and builds. Build a policy of your own on it:
    ``sac2.create_selective_checkpoint_contexts(sac2.policies.llm_save_list() | {op})``.

    Returns:
        The ops, as a frozenset of ``OpOverload``s and higher-order ops.
    """
    _compat.import_op_modules()
    ops = [lookup(path) for path in _COMPUTE + _COMMUNICATION]
    ops += [_compat.FLEX_ATTENTION, _compat.INDUCTOR_COMPILED_CODE]
    return frozenset(op for op in ops if op is not None)


class _LLM:
    """MUST_SAVE for the ops of ``llm_save_list()``, flash-attn style custom kernels (an op whose name contains
    ``flash_attn``, as TRL's policy matches them), every ``sac2.Region`` and device-to-host copies."""

    __slots__ = ("ops", "_known")

    def __init__(self, ops: frozenset[_compat.Op]) -> None:
        self.ops = ops
        # id(op) -> (op, saved?): runs once per op, and id() avoids OpOverload's Python __hash__; holding the op
        # keeps its id from being reused.
        self._known: dict[int, tuple[PolicyOp, bool]] = {id(op): (op, True) for op in ops}

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: PolicyOp, *args: Any, **kwargs: Any  # noqa: ARG002 (policy's)
    ) -> CheckpointPolicy:
        if type(op) is Region:
            return MUST_SAVE
        known = self._known.get(id(op))
        if known is None:
            known = self._known[id(op)] = (op, isinstance(op, _compat.OpOverload) and "flash_attn" in op_name(op))
        if known[1] or _is_device_to_host(op, args, kwargs):
            return MUST_SAVE
        return PREFER_RECOMPUTE

    def __reduce__(self) -> tuple[type[_LLM], tuple[frozenset[_compat.Op]]]:
        pickling.register_op_pickling(self.ops)
        return _LLM, (self.ops,)

    def __repr__(self) -> str:
        return "sac2.policies.llm()"


def _is_device_to_host(op: PolicyOp, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # Recomputing an offload would copy to the host again in backward: exactly the transfer it was meant to pay once.
    if op is not _compat.TO_COPY or not args:
        return False
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"


def llm() -> Callable[..., CheckpointPolicy]:
    """The default policy for transformer blocks: save ``llm_save_list()``, flash-attn custom ops, regions and D2H
    copies; recompute the cheap rest (norms, activations, residual adds, RoPE).

    torchtitan-like, with a wider list than ``torchtitan()``: every matmul (not every other), every attention
    kernel, and every functional collective (all-gather and all-reduce too). ``sac2.apply_ac``'s default.

    Returns:
        The policy: MUST_SAVE for those, PREFER_RECOMPUTE for everything else. It pickles.
    """
    return _LLM(llm_save_list())


_MATMULS = tuple(op for op in map(lookup, _MATMUL_PATHS) if op is not None)
#: The matmuls an ``nn.Linear`` runs as, whose right-hand side is its weight (``recompute_linears`` reads it).
_LINEAR_MATMULS = tuple(
    op
    for op in map(lookup, ("aten.mm.default", "aten.addmm.default", "aten.linear.default", "aten._scaled_mm.default"))
    if op is not None
)


class _EveryOtherMatmul:
    """Counts the matmuls of each forward; keeps the 1st, 3rd, 5th..., recomputes the 2nd, 4th...

    The count lives in the forward's context (``sac2.core.decisions.forward_state``), which sac2 creates once per
    forward of a checkpointed block, so one policy object serves every block, nested ones included, and every step; it
    holds no state of its own.
    """

    __slots__ = ()

    def __call__(self, ctx: SelectiveCheckpointContext, op: PolicyOp, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op not in _MATMULS:
            return PREFER_RECOMPUTE
        state = forward_state(ctx, _EveryOtherMatmul)
        n = state["matmuls"] = state.get("matmuls", 0) + 1
        return MUST_SAVE if n % 2 else MUST_RECOMPUTE

    def __repr__(self) -> str:
        return "sac2.policies.every_other_matmul()"


def every_other_matmul() -> Callable[..., CheckpointPolicy]:
    """Save every other matmul (every matmul ``llm()`` saves: dense, batched, grouped, low-precision) of each
    forward of a block, recompute the others.

    Halves what the matmuls keep at the cost of recomputing half of them. Counts need sac2's own modes, which give
    the policy one context per forward; under torch's stock modes (a new context per op) it raises.

    Returns:
        The policy: MUST_SAVE for the 1st, 3rd, ... matmul of a forward, MUST_RECOMPUTE for the 2nd, 4th, ...,
        PREFER_RECOMPUTE for other ops. It holds no state of its own and pickles.
    """
    return _EveryOtherMatmul()


def _weight_shape(op: PolicyOp, args: tuple[Any, ...]) -> tuple[int, ...] | None:
    """The ``(out_features, in_features)`` shape of the weight a matmul multiplies by, as ``nn.Linear`` passes it."""
    if op is torch.ops.aten.linear.default:
        return tuple(args[1].shape)
    rhs = args[2] if op is torch.ops.aten.addmm.default else args[1]
    return tuple(rhs.shape)[::-1] if rhs.dim() == 2 else None


class _RecomputeLinears:
    __slots__ = ("shapes",)

    def __init__(self, shapes: frozenset[tuple[int, ...]]) -> None:
        self.shapes = shapes

    def __call__(
        self, ctx: SelectiveCheckpointContext, op: PolicyOp, *args: Any, **kwargs: Any  # noqa: ARG002 (policy's)
    ) -> CheckpointPolicy:
        if op in _LINEAR_MATMULS and _weight_shape(op, args) in self.shapes:
            return MUST_RECOMPUTE
        return PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"sac2.policies.recompute_linears(shapes={sorted(self.shapes)})"


def recompute_linears(model: nn.Module, names: Iterable[str]) -> Callable[..., CheckpointPolicy]:
    """Always recompute the matmuls of the ``nn.Linear`` modules of ``model`` named by ``names``.

    A name's dot-separated parts (globs) match the last parts of a module's qualified name (``"router.gate"``
    and ``"*.gate"`` match ``layers.3.moe.router.gate``; the rule of ``sac2.core.module_names``). Matmuls are
    recognised by the weight's shape, which is what a dispatch mode can see: another Linear of the same shape is
    recomputed too, and a warning names it. Use it for small,
    cheap matmuls whose outputs are large or that run with dynamic shapes, such as an MoE router. A name that
    matches no module warns once and forces nothing, so one config serves dense and MoE models alike.
    Combine it with another policy: ``compose(recompute_linears(model, ["router.gate"]), llm())``.

    Args:
        model: the model whose modules ``names`` names (read once, here).
        names: qualified module names, or their trailing parts.

    Returns:
        The policy: MUST_RECOMPUTE for the matmuls with those weights' shapes, PREFER_RECOMPUTE for all else.

    Raises:
        ValueError: a name matches a module that is not an ``nn.Linear``.
    """
    names = list(names)
    shapes: set[tuple[int, ...]] = set()
    chosen: set[str] = set()
    unmatched = []
    for name in names:
        found = [(fqn, m) for fqn, m in model.named_modules() if names_module(name, fqn)]
        if not found:
            unmatched.append(name)
        for fqn, m in found:
            if not isinstance(m, nn.Linear):
                raise ValueError(messages.recompute_linears_not_linear(fqn, name, m))
            shapes.add(tuple(m.weight.shape))
            chosen.add(fqn)
    if unmatched:
        warnings.warn(messages.recompute_linears_unmatched(unmatched), stacklevel=2)
    twins = [
        fqn
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear) and fqn not in chosen and tuple(m.weight.shape) in shapes
    ]
    if twins:
        warnings.warn(messages.recompute_linears_twins(twins, sorted(chosen)), stacklevel=2)
    return _RecomputeLinears(frozenset(shapes))


class _Compose:
    __slots__ = ("policies",)

    def __init__(self, policies: tuple[PolicyFn, ...]) -> None:
        self.policies = policies

    def __call__(self, ctx: SelectiveCheckpointContext, op: PolicyOp, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        first: CheckpointPolicy | None = None
        for policy in self.policies:
            answer = policy(ctx, op, *args, **kwargs)
            if type(answer) is bool:
                answer = from_bool(answer)
            elif type(answer) is not CheckpointPolicy:
                raise TypeError(messages.compose_bad_answer(policy, answer, op_name(op)))
            if answer in _MUST:
                return answer
            if first is None:
                first = answer
        if first is None:
            raise InternalError(messages.internal_error(messages.COMPOSE_EMPTY))
        return first

    def __repr__(self) -> str:
        return f"sac2.policies.compose({', '.join(map(repr, self.policies))})"


def compose(*policies: PolicyFn) -> Callable[..., CheckpointPolicy]:
    """Ask ``policies`` in order: the first MUST_* answer wins and later policies are not asked about that op;
    with no MUST_* answer, the first policy's PREFER_* answer stands.

    Bool answers count as in sac2 (True is MUST_SAVE, False PREFER_RECOMPUTE). Stateful pieces such as
    ``every_other_matmul`` only see the ops no earlier policy decided, so put forced decisions first.

    Args:
        *policies: the policy callables to ask, in order (at least one).

    Returns:
        The combined policy; it pickles when its pieces do.

    Raises:
        ValueError: no policy given.
        TypeError: one of ``policies`` is not callable. In forward, a piece that answers something other than a
            ``CheckpointPolicy`` or a bool raises TypeError naming it and the op.
    """
    if not policies:
        raise ValueError(messages.COMPOSE_NO_POLICY)
    for p in policies:
        if not callable(p):
            raise TypeError(messages.compose_not_callable(p))
    return _Compose(policies)
