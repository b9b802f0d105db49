"""Running one fuzz case in every variant and judging sac2 against the un-checkpointed run.

Variants: ``oracle`` (no checkpoint, run twice to prove the program deterministic), ``sac2`` (sac2.checkpoint with
the case's policy), ``stock`` (torch's non-reentrant checkpoint with torch's own selective contexts and the same
policy) and ``plain`` (torch's checkpoint, no policy). Each run records its outputs, input gradients, outputs
after backward and the global generator's state, and whether it left a dispatch mode or torch's "in a dispatch
mode" flags behind. Comparisons are bitwise (NaN equals NaN at the same place).

A case *passes* when sac2 is exact, or fails with an error naming the op while neither stock SAC nor plain
checkpoint gets the case right; it *fails* when sac2 is silently wrong, raises an error that does not name the op,
reports a divergence (the program is proven deterministic), leaves a dispatch mode behind, or raises at all
(``needless_error``, however clear the error) where stock SAC or plain checkpoint is right, unless the error is
one docs/concepts.md documents on purpose and the case did what earns it (``_DOCUMENTED``). It is *reported*, not
failed, when torch's plain checkpoint is itself wrong or fails (and stock SAC is not right where sac2 raises), or
when sac2 is wrong or raises and so does the un-checkpointed program run under a do-nothing dispatch mode (torch
computing differently under any mode, e.g. matmul decomposing another way: every mode-based SAC inherits that).
Stock SAC is recorded beside sac2, judged never, only used as evidence that a case can be done.
The generator after the case is compared with the oracle's too: with ``preserve_rng_state=False`` a recompute that
re-runs a random op draws from the live generator, so plain checkpoint is wrong there (reported), while sac2,
serving saved random ops without touching the generator, can still be exact.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
import warnings
from typing import Any, Callable

import torch
import torch.utils._python_dispatch as _pd
import torch.utils.checkpoint as tuc
from torch.utils._python_dispatch import TorchDispatchMode

import sac2
from tests.fuzz.programs import ANSWERS, PolicySpec, Program, generate, op_key

__all__ = ["Outcome", "CaseResult", "run_variant", "run_case", "VARIANTS", "mode_state"]

VARIANTS = ("oracle", "sac2", "stock", "plain", "mode")
_DIVERGED = re.compile(r"recompute diverged|recompute ran")
_NAMES_AN_OP = re.compile(r"\b(aten|prims?|sac2_fuzz)\.\w+|region '|sac2_fuzz_apply_twice")


@dataclasses.dataclass
class Outcome:
    """What one variant's run of a program produced (tensors are detached copies)."""

    error: str | None = None
    outputs: list[Any] = dataclasses.field(default_factory=list)
    grads: list[Any] = dataclasses.field(default_factory=list)
    after: list[Any] = dataclasses.field(default_factory=list)
    rng: torch.Tensor | None = None
    leaked: str | None = None


@dataclasses.dataclass
class CaseResult:
    seed: int
    program: Program
    status: str  # "pass", "fail", "reported", "invalid"
    sac2: str = ""  # "exact", "clear_error", "needless_error", "wrong", "unclear_error", "false_divergence"
    stock: str = ""
    plain: str = ""  # "exact", "wrong", "error"
    detail: str = ""  # what differed, or the error

    def line(self) -> str:
        """A one-line reproducer."""
        return (
            f"seed {self.seed}: sac2 {self.sac2} ({self.detail}); kinds {','.join(self.program.kinds)}; "
            f"reproduce: python -m tests.fuzz --only {self.seed} --verbose"
        )


def mode_state() -> str | None:
    """None when no dispatch mode is active and torch's mode flags are clear, else what is wrong."""
    stack = _pd._get_current_dispatch_mode_stack()
    flags = [
        name
        for name in (
            "_is_in_torch_dispatch_mode",
            "_is_in_non_infra_torch_dispatch_mode",
            "_is_in_any_mode_without_ignore_compile_internals",
        )
        if getattr(_pd, name)
    ]
    if not stack and not flags:
        return None
    return f"left behind: modes {[type(m).__name__ for m in stack]}, flags {flags}"


def _reset_modes() -> None:
    """Clear what a broken run left, so that it does not poison the next case."""
    while _pd._get_current_dispatch_mode_stack():
        _pd._pop_mode()
    for name in (
        "_is_in_torch_dispatch_mode",
        "_is_in_non_infra_torch_dispatch_mode",
        "_is_in_any_mode_without_ignore_compile_internals",
    ):
        setattr(_pd, name, False)
    torch.set_grad_enabled(True)


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _flat(item)]
    if isinstance(x, torch.Tensor):
        if x.is_nested:
            return [x.values().detach().clone(), x.offsets().clone()]
        return [x.detach().clone()]
    return [x]


def _loss(outs: list[torch.Tensor]) -> torch.Tensor:
    """A fixed, output-dependent weighting of every output, so each gradient entry is distinct."""
    total = torch.zeros((), dtype=torch.float64)
    for i, o in enumerate(outs):
        v = o.values() if o.is_nested else o
        w = torch.linspace(0.5, 1.5 + i, v.numel(), dtype=torch.float64).reshape(v.shape)
        total = total + (v.double() * w).sum()
    return total


class _DoNothing(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*args, **(kwargs or {}))


def _under_do_nothing_mode(fn: Callable[..., Any], *args: Any) -> Any:
    with _DoNothing():
        return fn(*args)


def _checkpointer(variant: str, program: Program) -> Callable[..., Any]:
    prs = program.preserve_rng_state
    spec = program.policy
    if variant == "oracle":
        return lambda fn, *args: fn(*args)
    if variant == "mode":  # no checkpoint, under a dispatch mode that does nothing
        return lambda fn, *args: _under_do_nothing_mode(fn, *args)
    if variant == "sac2":
        return lambda fn, *args: sac2.checkpoint(
            fn,
            *args,
            context_fn=functools.partial(sac2.create_selective_checkpoint_contexts, spec.build()),
            preserve_rng_state=prs,
        )
    if variant == "stock":
        return lambda fn, *args: tuc.checkpoint(
            fn,
            *args,
            use_reentrant=False,
            context_fn=functools.partial(tuc.create_selective_checkpoint_contexts, spec.build(stock=True)),
            preserve_rng_state=prs,
        )
    return lambda fn, *args: tuc.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=prs)


def _backward(program: Program, outs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[Any]:
    style = program.backward
    if not outs or not inputs:
        return []
    if style == "backward" or style == "twice":
        loss = _loss(outs)
        if style == "twice":
            loss.backward(retain_graph=True)
        loss.backward()
        return [i.grad for i in inputs]
    if style == "split" and len(outs) > 1:
        split = min(program.split, len(outs) - 1)  # outputs that do not require grad are not in outs
        first = torch.autograd.grad(_loss(outs[:split]), inputs, retain_graph=program.retain_first, allow_unused=True)
        return list(first) + list(torch.autograd.grad(_loss(outs[split:]), inputs, allow_unused=True))
    if style in ("double", "double_backward"):
        grads = torch.autograd.grad(_loss(outs), inputs, create_graph=True, allow_unused=True)
        again = [(g * g).sum() for g in grads if g is not None and g.requires_grad]
        if not again:
            return list(grads)
        if style == "double_backward":
            sum(again).backward()
            return list(grads) + [i.grad for i in inputs]
        return list(grads) + list(torch.autograd.grad(sum(again), inputs, allow_unused=True))
    if style == "grad_subset":
        return list(torch.autograd.grad(_loss(_masked(outs, program.out_mask)), inputs, allow_unused=True))
    if style == "inputs_subset":
        _loss(outs).backward(inputs=_masked(inputs, program.in_mask))
        return [i.grad for i in inputs]
    return list(torch.autograd.grad(_loss(outs), inputs, allow_unused=True))


def _masked(items: list[Any], mask: int) -> list[Any]:
    """The items whose bit is set in ``mask`` (the last one when none is)."""
    return [x for j, x in enumerate(items) if mask >> j & 1] or items[-1:]


def run_variant(program: Program, variant: str) -> Outcome:
    """Run ``program`` once as ``variant``; never raises for what the program or a library does."""
    result = Outcome()
    ckpt = _checkpointer(variant, program)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn = program.compile(ckpt)
            inputs = program.make_inputs()
            torch.manual_seed(program.seed)
            with torch.set_grad_enabled(program.backward != "no_grad"):
                raw = ckpt(fn, *inputs)
            result.outputs = _flat(raw)
            outs = [o for o in raw if isinstance(o, torch.Tensor) and o.requires_grad]
            if program.backward != "no_grad":
                result.grads = _flat(_backward(program, outs, [i for i in inputs if i.requires_grad]))
            result.after = _flat(raw)
    except Exception as e:  # noqa: BLE001 - every failure is data here
        result.error = f"{type(e).__name__}: {e}"
    result.rng = torch.get_rng_state()
    result.leaked = mode_state()
    if result.leaked:
        _reset_modes()
    return result


def _same(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a is None and b is None or (type(a) is type(b) and a == b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if not a.dtype.is_floating_point:
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def diff(ref: Outcome, got: Outcome, rng: torch.Tensor) -> str | None:
    """The first thing ``got`` does differently from ``ref`` (``rng``: the generator state expected after)."""
    if got.leaked:
        return got.leaked
    if got.error:
        return got.error
    for what in ("outputs", "grads", "after"):
        mine, theirs = getattr(ref, what), getattr(got, what)
        if len(mine) != len(theirs):
            return f"{what}: {len(theirs)} tensors, expected {len(mine)}"
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if not _same(a, b):
                return f"{what}[{i}] differs" + (
                    ""
                    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    else f" ({type(a).__name__} vs {type(b).__name__})"
                )
    if not torch.equal(rng, got.rng):
        return "generator state after the case differs"
    return None


#: sac2 errors that docs/concepts.md documents on purpose, each with the condition under which a case has earned it
#: (then it is a ``clear_error``, not a ``needless_error``, even where stock SAC or plain checkpoint is right).
#: A policy answering something that is not a CheckpointPolicy or a bool is the policy's fault. Not listed, so never
#: excused: "modified in place after the checkpointed forward ended" (documented for a saved output the caller
#: modifies after the forward; no case does: every backward style only reads the outputs) and "recompute diverged"
#: (no case is nondeterministic: the oracle runs it twice first).
_DOCUMENTED: tuple[tuple[re.Pattern, Callable[[Program], bool]], ...] = (
    (re.compile(r"a policy must return a CheckpointPolicy member or a bool"), lambda program: True),
)


def _documented(error: str, program: Program) -> bool:
    return any(pattern.search(error) and earned(program) for pattern, earned in _DOCUMENTED)


def _category(d: str | None, outcome: Outcome) -> str:
    if d is None:
        return "exact"
    if outcome.error and not outcome.leaked:
        if _DIVERGED.search(outcome.error):
            return "false_divergence"  # the oracle ran the program twice alike: recompute cannot diverge
        return "clear_error" if "sac2" in outcome.error and _NAMES_AN_OP.search(outcome.error) else "unclear_error"
    return "wrong"


def resolve_policy(program: Program) -> Program:
    """A list (or answers) policy names a random subset of the ops the program really runs: record them with a
    probe, and draw an answer for each op an answers policy names."""
    spec = program.policy
    if spec.kind not in ("list", "answers") or not spec.pick:
        return program
    seen: list[str] = []

    def probe(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        key = op_key(op)
        if key not in seen:
            seen.append(key)
        return sac2.CheckpointPolicy.PREFER_RECOMPUTE

    probing = dataclasses.replace(program, policy=PolicySpec("hash"))
    probing_ckpt = lambda fn, *args: sac2.checkpoint(  # noqa: E731
        fn, *args, context_fn=functools.partial(sac2.create_selective_checkpoint_contexts, probe)
    )
    try:
        # Grad enabled: under no_grad a checkpoint runs the function without its contexts, and the probe would see
        # no op at all (every list policy was empty while the probe ran under no_grad).
        with warnings.catch_warnings(), torch.enable_grad():
            warnings.simplefilter("ignore")
            torch.manual_seed(program.seed)
            probing_ckpt(probing.compile(probing_ckpt), *program.make_inputs())
    except Exception:  # noqa: BLE001 - sac2 failing here fails again in the sac2 variant
        pass
    if mode_state():
        _reset_modes()
    rng = random.Random(spec.salt)
    ops = tuple(k for k in seen if rng.random() < spec.pick)
    answers: tuple[str, ...] = ()
    if spec.kind == "answers":
        names, weights = zip(*ANSWERS.items(), strict=True)
        draw = lambda: rng.choices(names, weights)[0]  # noqa: E731
        one = draw()
        answers = tuple(one if spec.same else draw() for _ in ops)
    return dataclasses.replace(program, policy=dataclasses.replace(spec, ops=ops, answers=answers, pick=0.0))


def run_case(case: int | Program) -> CaseResult:
    """Generate (or take) a program, run every variant, judge sac2."""
    program = generate(case) if isinstance(case, int) else case
    first = run_variant(program, "oracle")
    if first.error or first.leaked:
        return CaseResult(program.seed, program, "invalid", detail=first.error or first.leaked or "")
    if diff(first, run_variant(program, "oracle"), first.rng):
        return CaseResult(program.seed, program, "invalid", detail="not deterministic")
    program = resolve_policy(program)
    plain = run_variant(program, "plain")
    expected_rng = first.rng
    plain_diff = diff(first, plain, expected_rng)
    results = {}
    outcomes = {}
    for variant in ("sac2", "stock"):
        outcome = outcomes[variant] = run_variant(program, variant)
        d = diff(first, outcome, expected_rng)
        results[variant] = (_category(d, outcome), d or "")
    (sac2_cat, detail), (stock_cat, _) = results["sac2"], results["stock"]
    plain_cat = "exact" if plain_diff is None else ("error" if plain.error else "wrong")
    sac2_error = outcomes["sac2"].error or ""
    if sac2_cat == "clear_error" and "exact" in (plain_cat, stock_cat) and not _documented(sac2_error, program):
        sac2_cat = "needless_error"  # torch's own checkpoint (full or selective) does this case right
    if plain_cat != "exact" and sac2_cat != "needless_error":
        status = "reported"
    else:
        status = "pass" if sac2_cat in ("exact", "clear_error") else "fail"
        if sac2_cat in ("wrong", "needless_error") and diff(first, run_variant(program, "mode"), expected_rng):
            # torch itself computes differently (or fails) under any dispatch mode (e.g. matmul decomposes
            # another way): every mode-based SAC inherits it. Reported, as plain checkpoint's own errors are.
            status, plain_cat = "reported", "differs under any dispatch mode"
    return CaseResult(
        program.seed, program, status, sac2_cat, stock_cat, plain_cat, detail.splitlines()[0][:300] if detail else ""
    )
