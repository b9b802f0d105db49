"""Memory budgets against every other setup, side by side: what ``sac2.apply_ac(model, memory_budget=f)`` keeps and
what it costs, for f = 0.1 ... 0.9, next to no checkpointing, full AC, ``llm()`` and the one-line regions choices.

Models (one copy per row, same weights): the bench's ``tiny`` and ``small`` configs, a small Hugging Face Llama
(hidden 128, 4 layers, seq 128, batch 2) and a Qwen3-MoE (the same, 8 experts, top 2) when transformers is installed.
Rows: ``none``; ``full AC``; ``selective llm()`` (``apply_ac(model, "selective")``); ``regions attention``;
``regions attention+linear(+experts)`` (``apply_ac``'s default); ``budget f`` (``apply_ac(model, memory_budget=f,
example_inputs=...)``, planned in this process: one calibration per kind of block serves every f).

Memory: one untimed step per row under ``sac2.measure.memory.measure_step`` (kept = allocated by forward and alive
when backward starts), the same on every run. Time: one forward+backward per row per round, the rows taking turns in a
rotating order, ``--rounds`` rounds, medians; ``--clock cpu`` (the default) reads the process's CPU time, which a
shared machine's other jobs do not add to, ``--clock wall`` the wall clock. Exactness: every row's loss and gradients
against ``none``'s, bitwise. Then, per model, the acceptance checks of issue #40, each line ``ok`` or ``FAIL``:

- kept bytes of the budgets are monotone in f, and each is at most full AC's + f x (none's - full AC's) + 5% of none's;
- each budget's step is at most 1.05x full AC's;
- no row keeps no more than a budget row and takes less than 0.95x its step.

Nothing is asserted; the script prints. ``--repeat N`` runs the whole side-by-side N times and prints the spread of
each ratio.

    python benchmarks/budgets.py [--models tiny,small,hf-llama,hf-qwen3-moe] [--rounds 15] [--clock cpu|wall]
                                 [--fractions 0.1,0.2,...] [--repeat 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

import sac2
from sac2.measure.memory import measure_step
from sac2.measure.rotation import turns

MODELS = ("tiny", "small", "hf-llama", "hf-qwen3-moe")
FRACTIONS = tuple(round(0.1 * i, 1) for i in range(1, 10))


@dataclass
class Model:
    name: str
    model: nn.Module
    inputs: dict[str, Any]
    loss: Callable[[nn.Module], torch.Tensor]
    blocks: Callable[[Any], nn.Module]
    experts: bool = False


@dataclass
class Row:
    name: str
    prepare: Callable[[nn.Module], object]
    model: nn.Module | None = None
    kept: int = 0
    times: list[float] = field(default_factory=list)
    equal: bool = True
    note: str = ""


def _bench(config: str) -> Model:
    from sac2.bench.models import CONFIGS, Transformer, random_tokens

    cfg = CONFIGS[config]
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens, targets = random_tokens(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))
    inputs = {"tokens": tokens, "targets": targets}
    return Model(config, model, inputs, lambda m: m(**inputs), lambda m: m.blocks)


def _hf(kind: str) -> Model:
    import transformers

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False)
    if kind == "hf-llama":
        config = transformers.AutoConfig.for_model("llama", **common)
    else:
        config = transformers.AutoConfig.for_model("qwen3_moe", **common, head_dim=32, num_experts=8,
                                                   num_experts_per_tok=2, moe_intermediate_size=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    return Model(kind, model, inputs, lambda m: m(**inputs).loss, lambda m: m.model.layers, kind != "hf-llama")


def _rows(m: Model, fractions: tuple[float, ...]) -> list[Row]:
    default = ["attention", "linear", "experts"] if m.experts else ["attention", "linear"]

    def budget(model: nn.Module, f: float) -> None:
        sac2.apply_ac(model, memory_budget=f, example_inputs=m.inputs, blocks=m.blocks(model))

    rows = [
        Row("none", lambda _model: None),
        Row("full AC", lambda model: sac2.apply_ac(model, "full", blocks=m.blocks(model))),
        Row("selective llm()", lambda model: sac2.apply_ac(model, "selective", blocks=m.blocks(model))),
        Row("regions attention", lambda model: sac2.apply_ac(model, "regions", save=["attention"],
                                                             blocks=m.blocks(model))),
        Row(f"regions {'+'.join(default)}", lambda model: sac2.apply_ac(model, "regions", save=default,
                                                                        blocks=m.blocks(model))),
    ]
    rows += [Row(f"budget {f:g}", functools.partial(budget, f=f)) for f in fractions]
    return rows


def _grads(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor | None]:
    return [loss.detach(), *(p.grad for p in model.parameters())]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b, strict=True))


def _what(blocks: nn.Module) -> str:
    """What a budget row chose for its first block: full AC, the regions it keeps, or the op calls."""
    wrapper: Any = next(iter(blocks.children()))
    context_fn = wrapper.checkpoint_fn.keywords.get("context_fn")
    if context_fn is None:
        return "full AC"
    policy = context_fn.args[0]
    if isinstance(policy, sac2.policies.MemoryBudget):
        return f"op-level: {len(policy.saved)} of {len(policy.profile.calls)} calls"
    return "regions " + "+".join(sorted(r.name for r in policy.ops))


def measure(m: Model, rounds: int, clock: Callable[[], float], fractions: tuple[float, ...]) -> list[Row]:
    rows = _rows(m, fractions)
    for row in rows:
        row.model = copy.deepcopy(m.model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a budget that runs full AC says so: the row's note says it here
            row.prepare(row.model)
        if row.name.startswith("budget"):
            row.note = _what(m.blocks(row.model))
    reference: list[torch.Tensor | None] = []
    for row in rows:
        model = row.model
        assert model is not None
        memory, loss = measure_step(functools.partial(m.loss, model), "cpu")
        row.kept = memory.kept
        got = _grads(model, loss)
        reference = reference or got
        row.equal = _same(got, reference)
        model.zero_grad(set_to_none=True)
    for r in range(rounds):
        for i in turns(r, len(rows)):
            model = rows[i].model
            assert model is not None
            model.zero_grad(set_to_none=True)
            start = clock()
            m.loss(model).backward()
            rows[i].times.append(clock() - start)
    return rows


def ratio(a: Row, b: Row) -> float:
    """``a``'s step over ``b``'s: the median of their round-by-round ratios (a round's steps ran side by side)."""
    return statistics.median(x / y for x, y in zip(a.times, b.times, strict=True))


def checks(rows: list[Row]) -> list[str]:
    """Issue #40's acceptance checks on one model's rows, one line each."""
    by = {r.name: r for r in rows}
    none, full = by["none"], by["full AC"]
    budgets = [r for r in rows if r.name.startswith("budget")]
    out = []
    kept = [b.kept for b in budgets]
    out.append(f"{'ok' if kept == sorted(kept) else 'FAIL'}: budget kept bytes monotone ({kept})")
    for b in budgets:
        f = float(b.name.split()[1])
        bound = full.kept + f * (none.kept - full.kept) + 0.05 * none.kept
        out.append(f"{'ok' if b.kept <= bound else 'FAIL'}: {b.name} keeps {b.kept / none.kept:.2f}x none <= "
                   f"{bound / none.kept:.2f}x")
        step = ratio(b, full)
        out.append(f"{'ok' if step <= 1.05 else 'FAIL'}: {b.name} step {step:.2f}x full AC's (<= 1.05)")
        beaters = [r.name for r in rows if r is not b and r.kept <= b.kept and ratio(r, b) < 0.95]
        out.append(f"{'ok' if not beaters else 'FAIL'}: {b.name} dominated by nothing"
                   + (f" (but by {', '.join(beaters)})" if beaters else ""))
    return out


def table(m: Model, rows: list[Row]) -> str:
    none, full = rows[0], rows[1]
    lines = [f"{m.name}: step (median) and vs full AC's (median of round-by-round ratios), kept vs none's (MiB), "
             "equal, what a budget chose"]
    for r in rows:
        step = statistics.median(r.times)
        lines.append(f"  {r.name:34s} {step * 1e3:8.2f} ms {ratio(r, full):5.2f}x   {r.kept / none.kept:5.2f}x "
                     f"({r.kept / 2**20:7.2f})  {'yes' if r.equal else 'NO':3s}  {r.note}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Memory budgets against every other setup, side by side.")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    fractions = tuple(float(f) for f in args.fractions.split(","))
    results: dict[str, list[dict[str, Any]]] = {}
    for name in args.models.split(","):
        if name.startswith("hf") and importlib.util.find_spec("transformers") is None:
            print(f"{name}: skipped (transformers is not installed)")
            continue
        for k in range(args.repeat):
            m = _bench(name) if name in ("tiny", "small") else _hf(name)
            rows = measure(m, args.rounds, clock, fractions)
            print(table(m, rows))
            print("\n".join("  " + line for line in checks(rows)))
            results.setdefault(name, []).append(
                {r.name: {"kept": r.kept, "median_s": statistics.median(r.times), "vs_full": ratio(r, rows[1]),
                          "equal": r.equal, "note": r.note} for r in rows})
            print(f"  (run {k + 1} of {args.repeat}, {args.rounds} rounds, {args.clock} clock)", flush=True)
    if args.repeat > 1:
        for name, runs in results.items():
            print(f"{name}: step / full AC's over {len(runs)} runs (min-max)")
            for row in runs[0]:
                ratios = [run[row]["vs_full"] for run in runs]
                print(f"  {row:34s} {min(ratios):.2f}-{max(ratios):.2f}x   kept {runs[0][row]['kept']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
