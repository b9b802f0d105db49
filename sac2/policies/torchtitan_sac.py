"""torchtitan 0.3.0's default selective activation checkpointing (``SelectiveAC``), decision for decision.

Its save list (``_get_default_save_ops``), every second mm/linear of each block's forward recomputed,
all-gathers and all-reduces recomputed, CUDA-to-CPU copies saved, and the mms shaped like the router's Linear
(``force_recompute_mm_shapes_by_fqns``) recomputed. It pickles like every preset.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from sac2 import _compat, messages
from sac2.core import pickling
from sac2.core.decisions import CheckpointPolicy, SelectiveCheckpointContext, forward_state
from sac2.core.keys import PolicyOp
from sac2.core.module_names import torchtitan_names_module
from sac2.policies.presets import MUST_SAVE, PREFER_RECOMPUTE, lookup

__all__ = ["torchtitan_save_list", "torchtitan"]

_TO_COPY = _compat.TO_COPY
_TITAN_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
_TITAN_COMPUTE = (
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten.max.default",
    "aten.linear.default",
    "aten.topk.default",
    "torch_attn._varlen_attn.default",
)
# all_gather_into_tensor and all_reduce are not in the list: torchtitan recomputes them.
_TITAN_COMMUNICATION = (
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
    "deepep.dispatch.default",
    "deepep.combine.default",
    "hybridep.dispatch.default",
    "hybridep.combine.default",
)


def torchtitan_save_list() -> frozenset[_compat.Op]:
    """torchtitan 0.3.0's default save list (``_get_default_save_ops``): the partitioner's compute-intensive ops,
    SDPA, max, linear, topk, flex_attention, compiled regions, reduce-scatter and all-to-all, and the DeepEP and
    HybridEP dispatch/combine ops. Optional ops are in only when registered at the time of the call.

    Returns:
        The ops, as a frozenset of ``OpOverload``s and higher-order ops.
    """
    _compat.import_op_modules()
    ops: list[_compat.Op | None] = [*_compat.partitioner_compute_intensive_ops()]
    ops += [lookup(path) for path in _TITAN_COMPUTE + _TITAN_COMMUNICATION]
    ops += [_compat.FLEX_ATTENTION, _compat.INDUCTOR_COMPILED_CODE]
    return frozenset(op for op in ops if op is not None)


class _Torchtitan:
    """torchtitan 0.3.0's ``SelectiveAC`` policy, answer for answer (PREFER_RECOMPUTE where it answers that)."""

    __slots__ = ("ops", "shapes", "_ids")

    def __init__(self, ops: frozenset[_compat.Op], shapes: frozenset[tuple[int, int]]) -> None:
        self.ops = ops
        self.shapes = shapes  # (in_features, out_features): the right-hand side of the mm
        self._ids = frozenset(map(id, ops))

    def __call__(self, ctx: SelectiveCheckpointContext, op: PolicyOp, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is _TO_COPY and "cuda" in str(args[0].device) and str(kwargs.get("device")) == "cpu":
            return MUST_SAVE  # "device" absent reads as "None", which is not "cpu"
        if op in _TITAN_MATMULS:
            rhs = tuple(args[1].shape)
            if (rhs[::-1] if op is torch.ops.aten.linear.default else rhs) in self.shapes:
                return PREFER_RECOMPUTE
            state = forward_state(ctx, self)
            n = state["mm"] = state.get("mm", 0) + 1
            if id(op) in self._ids:
                return MUST_SAVE if n % 2 else PREFER_RECOMPUTE
            return PREFER_RECOMPUTE
        return MUST_SAVE if id(op) in self._ids else PREFER_RECOMPUTE

    def __reduce__(self) -> tuple[type[_Torchtitan], tuple[frozenset[_compat.Op], frozenset[tuple[int, int]]]]:
        pickling.register_op_pickling(self.ops)
        return _Torchtitan, (self.ops, self.shapes)

    def __repr__(self) -> str:
        shapes = f"force_recompute_mm_shapes={sorted(self.shapes)}" if self.shapes else ""
        return f"sac2.policies.torchtitan({shapes})"


def torchtitan(
    model: nn.Module | None = None, force_recompute_mm_shapes_by_fqns: Iterable[str] = ("moe.router.gate",)
) -> Callable[..., CheckpointPolicy]:
    """torchtitan 0.3.0's default selective AC (``SelectiveAC``), decision for decision.

    Saves ``torchtitan_save_list()`` and CUDA-to-CPU copies, except every second mm/linear of each forward of a
    block; all-gathers and all-reduces are recomputed. The mms whose right-hand side has the shape of an
    ``nn.Linear`` of ``model`` whose qualified name contains one of ``force_recompute_mm_shapes_by_fqns`` are
    recomputed and not counted; a name matching nothing forces nothing, silently, as in torchtitan. Counting
    needs sac2's modes (one context per forward), as ``every_other_matmul`` does.

    Args:
        model: the model whose ``nn.Linear`` shapes ``force_recompute_mm_shapes_by_fqns`` picks; default (None)
            forces no shape.
        force_recompute_mm_shapes_by_fqns: substrings of qualified module names whose matmuls are always
            recomputed (torchtitan's rule, ``sac2.core.module_names.torchtitan_names_module``); default torchtitan's
            ``("moe.router.gate",)``.

    Returns:
        The policy, answer for answer torchtitan's. It pickles.

    Raises:
        ValueError: a module whose name contains one of ``force_recompute_mm_shapes_by_fqns`` is not an
            ``nn.Linear``.
    """
    fqns = list(force_recompute_mm_shapes_by_fqns)
    shapes: set[tuple[int, int]] = set()
    for fqn, m in model.named_modules() if model is not None else ():
        if not any(torchtitan_names_module(f, fqn) for f in fqns):
            continue
        if not isinstance(m, nn.Linear):
            raise ValueError(messages.torchtitan_not_linear(fqn, m))
        out_features, in_features = m.weight.shape
        shapes.add((in_features, out_features))
    return _Torchtitan(torchtitan_save_list(), frozenset(shapes))
