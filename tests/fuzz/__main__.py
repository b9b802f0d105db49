"""The fuzzer's long mode: ``python -m tests.fuzz --cases N --seed S [--report FILE]``.

Runs seeds S .. S+N-1, prints a summary table, the failure classes (with the smallest case of each) and one
reproducer line per failing case; exits 1 when any case fails. The table counts sac2's, stock SAC's and plain
checkpoint's runs by class against training without checkpointing (``oracle.CLASSES``). A failure class is sac2's
verdict (``wrong``, ``accepts_rejected``, ``other_error``, ``needless_error``, ``unclear_error``,
``false_divergence``, ``leaked``: see ``oracle._verdict``) and the first difference. ``--only SEED --verbose``
runs one case and prints its program as Python source;
``--shrink`` also deletes statements, outputs and saved ops while the same failure remains, and prints the
smallest program found.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
import time

import torch

from tests.fuzz.oracle import CLASSES, CaseResult, run_case
from tests.fuzz.programs import Program, generate

__all__ = ["main", "summarize", "shrink", "failure_class"]


def failure_class(result: CaseResult) -> str:
    """What kind of failure: sac2's verdict and the first difference, with numbers and names blurred."""
    detail = re.sub(r"\d+", "N", result.detail)
    detail = re.sub(r"'[^']*'", "'...'", detail)
    return f"{result.sac2}: {detail[:90]}"


def shrink(result: CaseResult, budget: int = 300) -> CaseResult:
    """The smallest variant of a failing case that still fails the same way (greedy, one deletion at a time)."""
    target = failure_class(result)
    best = result
    tries = 0

    def attempt(program: Program) -> bool:
        nonlocal best, tries
        tries += 1
        got = run_case(program)
        if got.status == "fail" and failure_class(got) == target:
            best = got
            return True
        return False

    changed = True
    while changed and tries < budget:
        changed = False
        p = best.program
        for simpler in (
            dataclasses.replace(p, backward="grad"),
            dataclasses.replace(p, preserve_rng_state=True),
            dataclasses.replace(p, hooks=""),
            dataclasses.replace(p, epilogue=[]),
        ):
            if simpler != p and attempt(simpler):
                changed = True
                p = best.program
        for i in reversed(range(len(p.statements))):
            p = best.program
            if i < len(p.statements):
                changed |= attempt(dataclasses.replace(p, statements=p.statements[:i] + p.statements[i + 1 :]))
        for i in reversed(range(len(best.program.outputs))):
            p = best.program
            if len(p.outputs) > 1 and i < len(p.outputs):
                changed |= attempt(dataclasses.replace(p, outputs=p.outputs[:i] + p.outputs[i + 1 :]))
        for i in reversed(range(len(best.program.policy.ops))):
            p = best.program
            if i < len(p.policy.ops):
                ops = p.policy.ops[:i] + p.policy.ops[i + 1 :]
                answers = p.policy.answers[:i] + p.policy.answers[i + 1 :]  # "answers" policies: one per op
                policy = dataclasses.replace(p.policy, ops=ops, answers=answers)
                changed |= attempt(dataclasses.replace(p, policy=policy))
    return best


def _pct(n: int, d: int) -> str:
    return f"{100 * n / d:.1f}%" if d else "-"


def _counts(results: list[CaseResult], attr: str) -> str:
    counts = collections.Counter(getattr(r, attr) for r in results)
    return " | ".join(str(counts[c]) for c in CLASSES)


def summarize(results: list[CaseResult], seconds: float) -> str:
    """The summary table, the failure classes and the failing cases' reproducers, as Markdown."""
    valid = [r for r in results if r.status != "invalid"]
    failing = [r for r in results if r.status == "fail"]
    reported = [r for r in results if r.status == "reported"]
    verdicts = collections.Counter(r.sac2 for r in valid)
    lines = [
        f"sac2 differential fuzz: {len(results)} cases in {seconds:.0f} s; {len(valid)} valid, "
        f"{sum(bool(r.oracle_error) for r in valid)} of them rejected by the un-checkpointed run; "
        f"{len(failing)} failing, {len(reported)} reported, {len(results) - len(valid)} invalid (not deterministic)",
        "",
        "| | " + " | ".join(CLASSES.values()) + " |",
        "| --- |" + " --- |" * len(CLASSES),
        f"| sac2 | {_counts(valid, 'sac2_class')} |",
        f"| stock SAC (recorded, not judged) | {_counts(valid, 'stock')} |",
        f"| plain checkpoint (recorded, not judged) | {_counts(valid, 'plain')} |",
        "",
        "sac2 verdicts: " + ", ".join(f"{v} {n}" for v, n in sorted(verdicts.items(), key=lambda kv: -kv[1])) + ".",
    ]
    if reported:
        reasons = collections.Counter(r.reason for r in reported)
        lines.append("Reported, not failed: " + "; ".join(f"{why} {n}" for why, n in reasons.most_common()) + ".")
    if failing:
        classes: dict[str, list[CaseResult]] = collections.defaultdict(list)
        for r in failing:
            classes[failure_class(r)].append(r)
        lines += [
            "",
            "| failure class | cases | % of valid | stock exact on them | smallest seed |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, rs in sorted(classes.items(), key=lambda kv: -len(kv[1])):
            small = min(rs, key=lambda r: len(r.program.source()))
            lines.append(
                f"| {name.replace('|', '/')} | {len(rs)} | {_pct(len(rs), len(valid))} "
                f"| {sum(r.stock == 'exact' for r in rs)} | {small.seed} |"
            )
        lines += ["", "Failing cases:"] + [r.line() for r in failing]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000, help="how many seeds to run")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--report", help="also write the summary (Markdown) to this file")
    parser.add_argument("--only", type=int, help="run this one seed")
    parser.add_argument("--verbose", action="store_true", help="print each case's program as Python source")
    parser.add_argument("--shrink", action="store_true", help="shrink each failing case to a smaller one")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [args.only] if args.only is not None else range(args.seed, args.seed + args.cases)
    results = []
    start = time.perf_counter()
    for seed in seeds:
        result = run_case(generate(seed))
        if args.shrink and result.status == "fail":
            result = shrink(result)
        results.append(result)
        if args.verbose:
            print(result.program.source())
            print(
                f"# -> {result.status}: sac2 {result.sac2}, stock {result.stock}, plain {result.plain}; "
                f"{result.detail}"
                + (f"\n# the un-checkpointed run raises: {result.oracle_error}" if result.oracle_error else "")
                + (f"\n# reported, not failed: {result.reason}" if result.reason else "")
                + "\n"
            )
    text = summarize(results, time.perf_counter() - start)
    print(text)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text + "\n")
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
