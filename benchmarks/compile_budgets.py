"""sac2's memory budgets against the compiler's own, under ``torch.compile`` (inductor), side by side.

Two fronts on one model, each point a copy of it with the same weights:

- ``sac2 budget f``: ``sac2.apply_ac(model, memory_budget=f, example_inputs=...)``, then ``torch.compile(model,
  fullgraph=True)`` (a graph break raises), eager and compiled;
- ``partitioner f``: the plain model compiled with ``torch._functorch.config.activation_memory_budget = f`` (the
  min-cut partitioner's own budget, a fraction of what its runtime-optimal saved set keeps: no checkpoint, no
  policy).

Beside them: eager and compiled no checkpointing and full AC. Kept memory is the allocator's (kept = allocated by
forward and alive when backward starts, ``sac2.measure.memory``), relative to eager no checkpointing; step times are
medians of ``--rounds`` rounds in which every row takes a step, in a rotating order, timed by the process's CPU
time (one thread), relative to eager no checkpointing's. Every compiled row compiles once, untimed. Gradients are
checked against eager no checkpointing's (allclose: inductor may fuse differently). Numbers only, nothing asserted.

Models: ``hf-llama`` (transformers' Llama, hidden 128, 4 layers, seq 128, batch 2; needs transformers) and the
bench's ``tiny``.

    python benchmarks/compile_budgets.py [--models hf-llama,tiny] [--rounds 10] [--budgets 0.5] [--partitioner 0.1,...]
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config
from torch import nn

import sac2
from sac2.measure.memory import measure_step
from sac2.measure.rotation import turns


@dataclass
class Row:
    name: str
    model: nn.Module
    run: Callable[[], torch.Tensor]
    memory_budget: float | None = None  # the partitioner's, for the compiled call
    kept: int = 0
    times: list[float] = field(default_factory=list)
    close: bool = True


def _models(name: str) -> tuple[nn.Module, dict[str, Any], Callable[[nn.Module, dict[str, Any]], torch.Tensor]]:
    if name == "hf-llama":
        import transformers

        config = transformers.AutoConfig.for_model(
            "llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
        return model, {"input_ids": ids, "labels": ids}, lambda m, inputs: m(**inputs).loss
    from sac2.bench.models import CONFIGS, Transformer, random_tokens

    cfg = CONFIGS[name]
    torch.manual_seed(0)
    tokens, targets = random_tokens(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))
    return Transformer(cfg), {"tokens": tokens, "targets": targets}, lambda m, inputs: m(**inputs)


def _step(loss: Callable[..., torch.Tensor], target: Any, inputs: dict[str, Any], budget: float) -> torch.Tensor:
    """One forward, under the row's own partitioner budget (whenever dynamo compiles, it compiles with it)."""
    with functorch_config.patch(activation_memory_budget=budget):
        return loss(target, inputs)


def _own_code(model: nn.Module, name: str) -> Callable[..., Any]:
    """``model`` called from a function with a code object of its own: dynamo keeps compiled code per code object
    and takes parameters as inputs, so two copies of a model compiled directly would share the first one's graphs,
    partitioned with the first one's budget."""

    def call(**kwargs: Any) -> Any:
        return model(**kwargs)

    call.__code__ = call.__code__.replace(co_name=name.replace(" ", "_").replace(".", "_"))
    return call


def _row(name: str, model: nn.Module, inputs: dict[str, Any], loss: Callable[..., torch.Tensor],
         compiled: bool, memory_budget: float | None = None) -> Row:
    target: Any = torch.compile(_own_code(model, name), fullgraph=True) if compiled else model
    run = functools.partial(_step, loss, target, inputs, 1.0 if memory_budget is None else memory_budget)
    if compiled:
        run().backward()  # compiles now, untimed
        model.zero_grad(set_to_none=True)
    return Row(name, model, run, memory_budget)


def measure(name: str, rounds: int, budgets: list[float], partitioner: list[float]) -> list[Row]:
    base, inputs, loss = _models(name)
    base.train()

    def applied(**kwargs: Any) -> nn.Module:
        m = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sac2.apply_ac(m, **kwargs)
        return m

    rows = [_row("eager none", copy.deepcopy(base), inputs, loss, False),
            _row("eager full AC", applied(mode="full"), inputs, loss, False)]
    for f in budgets:
        rows.append(_row(f"eager sac2 budget {f:g}", applied(memory_budget=f, example_inputs=inputs), inputs, loss,
                         False))
    rows.append(_row("compiled none", copy.deepcopy(base), inputs, loss, True))
    rows.append(_row("compiled full AC", applied(mode="full"), inputs, loss, True))
    for f in budgets:
        rows.append(_row(f"compiled sac2 budget {f:g}", applied(memory_budget=f, example_inputs=inputs), inputs,
                         loss, True))
    for f in partitioner:
        rows.append(_row(f"compiled partitioner {f:g}", copy.deepcopy(base), inputs, loss, True, f))
    reference: list[torch.Tensor] = []
    for row in rows:
        memory, _ = measure_step(row.run, "cpu")
        row.kept = memory.kept
        grads = [p.grad for p in row.model.parameters() if p.grad is not None]
        reference = reference or grads
        row.close = all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(grads, reference, strict=True))
        row.model.zero_grad(set_to_none=True)
    for r in range(rounds):
        for i in turns(r, len(rows)):
            rows[i].model.zero_grad(set_to_none=True)
            start = time.process_time()
            rows[i].run().backward()
            rows[i].times.append(time.process_time() - start)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="sac2's memory budgets against the partitioner's, compiled.")
    parser.add_argument("--models", default="hf-llama,tiny")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--budgets", default="0.5")
    parser.add_argument("--partitioner", default="0.1,0.3,0.5,0.7,0.9")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Compile every row afresh: the caches' keys do not hold the partitioner's budget.
    torch._inductor.config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    for name in args.models.split(","):
        if name == "hf-llama" and importlib.util.find_spec("transformers") is None:
            print(f"{name}: skipped (transformers is not installed)")
            continue
        budgets = [float(f) for f in args.budgets.split(",") if f]
        partitioner = [float(f) for f in args.partitioner.split(",") if f]
        rows = measure(name, args.rounds, budgets, partitioner)
        none = rows[0]
        base = statistics.median(none.times)
        print(f"{name} (torch {torch.__version__}, inductor on cpu, one thread, {args.rounds} rounds)")
        print(f"  {'row':32s} {'kept vs eager none':>18s} {'step vs eager none':>19s}  grads close")
        for row in rows:
            print(f"  {row.name:32s} {row.kept / none.kept:17.2f}x {statistics.median(row.times) / base:18.2f}x  "
                  f"{'yes' if row.close else 'NO'}")


if __name__ == "__main__":
    main()
