"""Running one fuzz case in every variant and judging sac2 against the un-checkpointed run.

Variants: ``oracle`` (no checkpoint, run twice to prove the program deterministic), ``sac2`` (sac2.checkpoint with
the case's policy), ``stock`` (torch's non-reentrant checkpoint with torch's own selective contexts and the same
policy) and ``plain`` (torch's checkpoint, no policy). Each run records its outputs, input gradients, outputs
after backward and the global generator's state, and whether it left a dispatch mode or torch's "in a dispatch
mode" flags behind. Comparisons are bitwise (NaN equals NaN at the same place).

The reference is training without checkpointing. A case *passes* when sac2 is exact against it; where the
un-checkpointed run raises (autograd's "one of the variables needed for gradient computation has been modified by
an inplace operation" when a saved tensor is written in place), when sac2 raises too, in that error's words; where
it succeeds, when sac2 raises an error docs/concepts.md documents on purpose and the case did what earns it
(``_DOCUMENTED``). Every other outcome *fails*: silently wrong (whatever torch's plain checkpoint or stock SAC do:
they are recorded beside sac2, never an excuse), accepting what the un-checkpointed run rejects, an error without
its words, any error where it succeeds, a reported divergence (the program is proven deterministic), a dispatch
mode left behind. It is *reported*, not failed, only when the un-checkpointed program run under a do-nothing
dispatch mode behaves differently as well (torch computing differently under any mode, e.g. matmul decomposing
another way: every mode-based SAC inherits that). Stock SAC and plain checkpoint are recorded, never judged.
The global generator and, where the program makes one, its explicit generator after the case are compared with
the oracle's too: with ``preserve_rng_state=False`` a recompute that re-runs a random op draws from the live
generator, which training without checkpointing never does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import random
import re
import warnings
from typing import Any, Callable

import torch
import torch.utils._python_dispatch as _pd
import torch.utils.checkpoint as tuc
from torch.utils._python_dispatch import TorchDispatchMode

import sac2
from tests.fuzz.programs import ANSWERS, PolicySpec, Program, generate, hooks_context, op_key

__all__ = [
    "Outcome", "CaseResult", "run_variant", "run_case", "VARIANTS", "mode_state", "CLASSES", "PASSING",
    "summary_class", "oracle_words",
]  # fmt: skip

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
    gen: torch.Tensor | None = None  # the explicit generator's state after the case (programs that make one)
    leaked: str | None = None


@dataclasses.dataclass
class CaseResult:
    seed: int
    program: Program
    status: str  # "pass", "fail", "reported", "invalid"
    sac2: str = ""  # the verdict (``_verdict``): "exact", "same_error", "documented_error", or a failure
    stock: str = ""  # stock SAC's summary class (``CLASSES``), recorded, never judged
    plain: str = ""  # plain checkpoint's summary class (``CLASSES``), recorded, never judged
    detail: str = ""  # what differed, or the error
    sac2_class: str = ""  # sac2's summary class (``CLASSES``)
    oracle_error: str = ""  # the un-checkpointed run's error, where it raises
    reason: str = ""  # why a failure is reported instead (status "reported")

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
            # a jagged NestedTensor's offsets: torch's Tensor stubs lack the method
            return [x.values().detach().clone(), x.offsets().clone()]  # type: ignore[attr-defined]
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
    # HOPs pass through too (run again with the mode popped): without this every case with the fuzzer's HOP
    # "differed under any dispatch mode" by raising, and its sac2 failures were reported instead of failed.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*args, **(kwargs or {}))


def _under_do_nothing_mode(fn: Callable[..., Any], *args: Any) -> Any:
    with _DoNothing():
        return fn(*args)


#: torch 2.14+ takes ``respect_saved_tensors_hooks``; on 2.13 stock and plain checkpoint run without it.
_TORCH_TAKES_HOOKS_FLAG = "respect_saved_tensors_hooks" in inspect.signature(tuc.checkpoint).parameters


def _checkpointer(variant: str, program: Program) -> Callable[..., Any]:
    prs = program.preserve_rng_state
    spec = program.policy
    hooks: dict[str, Any] = {}
    if program.hooks:
        hooks["respect_saved_tensors_hooks"] = program.respect_hooks
    torch_hooks = hooks if _TORCH_TAKES_HOOKS_FLAG else {}
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
            **hooks,
        )
    if variant == "stock":
        return lambda fn, *args: tuc.checkpoint(
            fn,
            *args,
            use_reentrant=False,
            context_fn=functools.partial(tuc.create_selective_checkpoint_contexts, spec.build(stock=True)),
            preserve_rng_state=prs,
            **torch_hooks,
        )
    return lambda fn, *args: tuc.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=prs, **torch_hooks)


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
            sum(again[1:], again[0]).backward()  # a tensor's sum: no int 0 to start from
            return list(grads) + [i.grad for i in inputs]
        return list(grads) + list(torch.autograd.grad(sum(again[1:], again[0]), inputs, allow_unused=True))
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
    scope: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scope = program.compile_scope(ckpt)
            fn = scope["program"]
            inputs = program.make_inputs()
            torch.manual_seed(program.seed)
            hooks = hooks_context(program.hooks) if program.hooks else contextlib.nullcontext()
            with torch.set_grad_enabled(program.backward != "no_grad"), hooks, _generators(variant, program, scope):
                raw = ckpt(fn, *inputs)
            result.outputs = _flat(raw)
            if "epilogue" in scope:  # writes after the forward ended, before backward
                scope["epilogue"](raw)
            outs = [o for o in raw if isinstance(o, torch.Tensor) and o.requires_grad]
            if program.backward != "no_grad":
                result.grads = _flat(_backward(program, outs, [i for i in inputs if i.requires_grad]))
            result.after = _flat(raw)
    except Exception as e:  # noqa: BLE001 - every failure is data here
        result.error = f"{type(e).__name__}: {e}"
    if "gen" in scope:
        result.gen = scope["gen"].get_state()
    result.rng = torch.get_rng_state()
    result.leaked = mode_state()
    if result.leaked:
        _reset_modes()
    return result


def _generators(variant: str, program: Program, scope: dict[str, Any]) -> Any:
    """What docs/concepts.md tells a user whose random ops draw from their own generator where no mode sees them
    (the ops between one-line regions): ``sac2.preserve_generators(g)`` around the forward."""
    spec = program.policy
    regions_only = spec.kind == "list" and bool(spec.ops) and all(n.startswith("region ") for n in spec.ops)
    if variant == "sac2" and regions_only and "gen" in scope:
        return sac2.preserve_generators(scope["gen"])
    return contextlib.nullcontext()


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


def _close(a: Any, b: Any) -> bool:
    """``_same``, or within a few ulps for floating tensors (see ``diff``'s ``close``)."""
    if _same(a, b):
        return True
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or not a.dtype.is_floating_point:
        return False
    tol = 1e-12 if a.dtype == torch.float64 else 1e-5
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True)


def diff(ref: Outcome, got: Outcome, rng: torch.Tensor, close: bool = False) -> str | None:
    """The first thing ``got`` does differently from ``ref`` (``rng``: the generator state expected after).
    ``close``: compare floats within a few ulps, for programs under the user's saved-tensor hooks, which hand
    backward copies with other strides, so a backward matmul sums in another order than on the recomputed tensor."""
    same = _close if close else _same
    if got.leaked:
        return got.leaked
    if got.error:
        return got.error
    for what in ("outputs", "grads", "after"):
        mine, theirs = getattr(ref, what), getattr(got, what)
        if len(mine) != len(theirs):
            return f"{what}: {len(theirs)} tensors, expected {len(mine)}"
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if not same(a, b):
                return f"{what}[{i}] differs" + (
                    ""
                    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    else f" ({type(a).__name__} vs {type(b).__name__})"
                )
    if not torch.equal(rng, got.rng):
        return "generator state after the case differs"
    if (ref.gen is None) != (got.gen is None) or ref.gen is not None and not torch.equal(ref.gen, got.gen):
        return "explicit generator's state after the case differs"
    return None


#: sac2 errors that docs/concepts.md documents on purpose, each with the condition under which a case has earned it
#: (then it is a ``documented_error``, not a ``needless_error``, where the un-checkpointed run succeeds). A policy
#: answering something that is not a CheckpointPolicy or a bool is the policy's fault; a saved output modified in
#: place after the checkpointed forward ended (docs/concepts.md) is earned by a case whose epilogue writes after
#: the forward, and so is a nested checkpoint's input written then. Not listed, so never excused: "recompute
#: diverged" (no case is nondeterministic: the oracle runs it twice first).
_DOCUMENTED: tuple[tuple[re.Pattern, Callable[[Program], bool]], ...] = (
    (re.compile(r"a policy must return a CheckpointPolicy member or a bool"), lambda _program: True),
    (re.compile(r"modified in place after the checkpointed forward ended"), lambda program: bool(program.epilogue)),
    # A checkpoint's input written after the forward: recompute reads it again (docs/concepts.md); the programs'
    # own checkpoints take leaves, so it is earned by a nested checkpoint and a write after the forward.
    (re.compile(r"sac2: it is input \d+ of a checkpointed function, written in place after the checkpointed call"),
     lambda program: bool(program.epilogue) and "nested" in program.kinds),
)


def _documented(error: str, program: Program) -> bool:
    return any(pattern.search(error) and earned(program) for pattern, earned in _DOCUMENTED)


def oracle_words(error: str) -> str:
    """What an error of the un-checkpointed run says, without its particulars: the first line of the message, up
    to the first ``:`` or ``[`` (autograd's "one of the variables needed for gradient computation has been
    modified by an inplace operation"). A checkpoint that must fail as the program does must say this."""
    message = error.split(": ", 1)[-1].splitlines()[0] if error else ""
    return re.split(r"[:\[]", message, maxsplit=1)[0].strip()


#: The summary's categories, for sac2 and for stock SAC alike.
CLASSES = {
    "exact": "exact",
    "wrong": "silently wrong",
    "error_oracle_ok": "loud error where the oracle succeeds",
    "error_oracle_fails": "loud error where the oracle fails",
    "accepts_rejected": "accepts what the oracle rejects",
    "leaked": "leaked a dispatch mode",
}


def summary_class(oracle: Outcome, got: Outcome, d: str | None) -> str:
    """Which of ``CLASSES`` a variant's run falls in, against the oracle's run."""
    if got.leaked:
        return "leaked"
    if oracle.error:
        return "error_oracle_fails" if got.error else "accepts_rejected"
    if got.error:
        return "error_oracle_ok"
    return "exact" if d is None else "wrong"


def _verdict(oracle: Outcome, got: Outcome, d: str | None, program: Program) -> str:
    """sac2's verdict: ``exact``, ``same_error`` (fails as the un-checkpointed program does, in its words),
    ``documented_error`` (an error docs/concepts.md documents, earned, also where the un-checkpointed program
    fails for another reason first) pass; ``wrong``, ``leaked``,
    ``accepts_rejected`` (no error where the un-checkpointed program raises), ``other_error`` (an error without
    the un-checkpointed program's words where it raises), ``false_divergence``, ``unclear_error`` (does not name
    the op) and ``needless_error`` (any other error where the un-checkpointed program succeeds) fail."""
    if got.leaked:
        return "leaked"
    if oracle.error:
        if not got.error:
            return "accepts_rejected"
        if oracle_words(oracle.error) in got.error:
            return "same_error"
        return "documented_error" if _documented(got.error, program) else "other_error"
    if d is None:
        return "exact"
    if not got.error:
        return "wrong"
    if _DIVERGED.search(got.error):
        return "false_divergence"  # the oracle ran the program twice alike: recompute cannot diverge
    if _documented(got.error, program):
        return "documented_error"
    return "needless_error" if "sac2" in got.error and _NAMES_AN_OP.search(got.error) else "unclear_error"


PASSING = ("exact", "same_error", "documented_error")


def resolve_policy(program: Program) -> Program:
    """A list (or answers) policy names a random subset of the ops the program really runs: record them with a
    probe, and draw an answer for each op an answers policy names."""
    spec = program.policy
    if spec.kind not in ("list", "answers") or not spec.pick:
        return program
    seen: list[str] = []

    def probe(_ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
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


def _draws(program: Program, oracle: Outcome) -> bool:
    """Whether the program draws random numbers: it moves the global generator or makes an explicit one."""
    assert oracle.rng is not None
    return program.gen_seed is not None or not torch.equal(torch.manual_seed(program.seed).get_state(), oracle.rng)


def _hooks_change_torchs_result(program: Program, outcomes: dict[str, Outcome]) -> bool:
    """Whether sac2 equals the program run without checkpointing under hooks that copy as the user's do but keep
    the tensor as it lies in memory (``programs.replica``), where the user's restrided copies give another
    result."""
    if program.hooks != "user":
        return False
    bare = dataclasses.replace(program, hooks="replica")
    without = run_variant(bare, "oracle")
    return not without.error and diff(without, outcomes["sac2"], without.rng, True) is None


def run_case(case: int | Program) -> CaseResult:
    """Generate (or take) a program, run every variant, judge sac2 against the un-checkpointed run."""
    program = generate(case) if isinstance(case, int) else case
    first = run_variant(program, "oracle")
    if first.leaked:
        return CaseResult(program.seed, program, "invalid", detail=first.leaked)
    again = run_variant(program, "oracle")
    if first.error != again.error or not first.error and diff(first, again, first.rng):
        return CaseResult(program.seed, program, "invalid", detail="not deterministic")
    program = resolve_policy(program)
    expected_rng = first.rng
    assert expected_rng is not None
    plain = run_variant(program, "plain")
    close = bool(program.hooks)
    plain_diff = diff(first, plain, expected_rng, close)
    plain_cat = summary_class(first, plain, plain_diff)
    outcomes = {v: run_variant(program, v) for v in ("sac2", "stock")}
    diffs = {v: (None if first.error else diff(first, o, expected_rng, close)) for v, o in outcomes.items()}
    classes = {v: summary_class(first, o, diffs[v]) for v, o in outcomes.items()}
    verdict = _verdict(first, outcomes["sac2"], diffs["sac2"], program)
    status = "pass" if verdict in PASSING else "fail"
    reason = ""
    if verdict in ("wrong", "needless_error", "unclear_error", "accepts_rejected"):
        # torch itself computes differently (or fails, or stops failing) under any dispatch mode (e.g. matmul
        # decomposes another way): every mode-based SAC inherits it. Reported, not failed.
        mode = run_variant(program, "mode")
        if first.error:
            differs = not mode.error or oracle_words(first.error) not in mode.error
        else:
            differs = diff(first, mode, expected_rng) is not None
        if differs:
            status, reason = "reported", "torch differs under any dispatch mode"
    if status == "fail" and verdict in ("wrong", "accepts_rejected") and _hooks_change_torchs_result(program, outcomes):
        # The user's hook hands backward a restrided copy and torch's backward computes another result from it
        # (layer_norm's CPU backward; batch_norm's from a strided weight the hook made contiguous) or fails on it
        # (a view of it): sac2's recompute hands back the forward's tensors, as hooks that copy the memory they
        # lie in do. Reported, not failed.
        status, reason = "reported", "torch computes differently from the hook's restrided copy"
    if status == "fail" and verdict == "wrong" and not program.preserve_rng_state and _draws(program, first):
        # preserve_rng_state=False asks a recompute to draw from the live generator: what it draws differs from
        # the forward by request. Reported (the lead reads them), not failed.
        status, reason = "reported", "preserve_rng_state=False draws from the live generator"
    if first.error:
        detail = outcomes["sac2"].error or f"no error where the oracle raises: {first.error}"
    else:
        detail = diffs["sac2"] or ""
    return CaseResult(
        program.seed,
        program,
        status,
        verdict,
        classes["stock"],
        plain_cat,
        detail.splitlines()[0][:300] if detail else "",
        sac2_class=classes["sac2"],
        reason=reason,
        oracle_error=(first.error or "").splitlines()[0][:300] if first.error else "",
    )
