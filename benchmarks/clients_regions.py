"""One-line regions against stock SAC on client models: step time, kept memory and exactness, side by side.

Models: a tiny Hugging Face Llama (hidden 64, 4 layers, seq 64, batch 2: dispatch overhead decides the step), a
tiny Qwen3-MoE (the same, 8 experts, top 2) and torchtitan 0.3.0's llama3 debug model (SDPA inner attention,
seq 64, batch 2). Each model, one copy per row, same weights:

- ``none``; ``full AC``: ``sac2.apply_ac(model, "full")``;
- ``stock SAC``: torch's ``checkpoint_wrapper`` with torch's ``create_selective_checkpoint_contexts`` and
  ``sac2.policies.llm()`` (every matmul and attention saved);
- ``sac2 op list``: ``sac2.apply_ac(model, "selective")`` (the same ``llm()`` save list, sac2's modes);
- ``sac2 regions attention``: ``sac2.apply_ac(model, "regions", save=["attention"])``;
- ``sac2 regions matmuls``: ``sac2.apply_ac(model, "regions", save=["attention", "linear", "experts"])``
  (the default); ``sac2 regions matmuls, inputs kept``: the same with ``keep_inputs=True`` (what the saved regions'
  bodies save of their own inputs kept for real, as 0.3 did, instead of rebuilt in recompute; the setting belongs
  to the region names, so each step of these rows sets it for its own row first);
- ``torch_remat attention`` / ``torch_remat matmuls`` (torch 2.15 with ``torch-remat`` only): the same calls
  annotated by hand with ``remat.region(..., recompute=False)`` (plus ``remat.recompute_needs_tensor`` on their
  outputs), each block in ``remat.checkpoint``.

Time: this thread's CPU time (``time.thread_time``) of one forward+backward, one thread; the rows take turns
within each round in a rotating order (as ``benchmarks/overhead.py``), medians over rounds. Memory: one untimed
step per row under ``sac2.measure.memory.measure_step`` (kept = allocated by forward and alive when backward
starts). Exactness: that step's loss and every gradient against ``none``'s, bitwise (``torch.equal``). Then the
rows that Pareto-dominate stock SAC (step time and kept memory both no higher) are listed. Numbers only: nothing
here is asserted (``tests/clients/test_clients_regions_script.py`` runs ``--smoke``).

    python benchmarks/clients_regions.py [--rounds 15] [--models hf-llama,hf-qwen3-moe,tt-llama3]
                                         [--plot FILE] [--json FILE] [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn

import sac2
from sac2.measure.memory import measure_step
from sac2.measure.pareto import pareto_front
from sac2.measure.rotation import turns

MODELS = ("hf-llama", "hf-qwen3-moe", "tt-llama3")
STOCK = "stock SAC"
#: The two save sets of the region rows: row suffix -> ``save`` (matmuls is apply_ac's default).
SAVES: dict[str, list[str] | None] = {"attention": ["attention"], "matmuls": ["attention", "linear", "experts"]}


@dataclass
class Shape:
    layers: int
    seq: int
    batch: int = 2


@dataclass
class Model:
    """A model to benchmark: how to build it (same weights every call), its block container, a loss."""

    name: str
    describe: str
    build: Callable[[], nn.Module]
    blocks: Callable[[Any], nn.Module]  # given the built model (a transformers or torchtitan one: untyped)
    loss: Callable[[nn.Module], torch.Tensor]
    hf: bool


@dataclass
class Row:
    name: str
    times: list[float] = field(default_factory=list)
    kept: int = 0
    equal: bool = False

    @property
    def ms(self) -> float:
        return statistics.median(self.times) * 1e3


# --- models -------------------------------------------------------------------------------------------------------


def _tokens(vocab: int, shape: Shape, extra: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (shape.batch, shape.seq + extra), generator=torch.Generator().manual_seed(0))


def _hf(kind: str, shape: Shape) -> Model:
    import transformers

    common = dict(hidden_size=64, num_hidden_layers=shape.layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256, attn_implementation="sdpa")
    if kind == "llama":
        config, cls = transformers.LlamaConfig(intermediate_size=176, **common), transformers.LlamaForCausalLM
        describe = "LlamaForCausalLM"
    else:
        config = transformers.Qwen3MoeConfig(head_dim=16, intermediate_size=176, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=64, decoder_sparse_step=1, **common)
        cls, describe = transformers.Qwen3MoeForCausalLM, "Qwen3MoeForCausalLM, 8 experts, top 2"
    ids = _tokens(256, shape)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return cls(config)

    def loss(model: nn.Module) -> torch.Tensor:
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    return Model(f"hf-{kind.replace('_', '-')}",
                 f"{describe}: hidden 64, {shape.layers} layers, seq {shape.seq}, batch {shape.batch}",
                 build, lambda m: m.model.layers, loss, hf=True)


def _torchtitan_llama3(shape: Shape, trim: bool) -> Model:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    ids = _tokens(2048, shape, extra=1)

    def build() -> nn.Module:
        config = llama3_configs["debugmodel"](attn_backend="flex")  # 0.3.0 refuses "sdpa" for language models
        if trim:
            config.layers = config.layers[: shape.layers]
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
        torch.manual_seed(0)
        model = config.build()
        torch.manual_seed(0)
        model.init_weights()
        return model

    def loss(model: nn.Module) -> torch.Tensor:
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    layers = shape.layers if trim else 6
    return Model("tt-llama3", f"torchtitan llama3 debugmodel: dim 256, {layers} layers, seq {shape.seq}, batch "
                 f"{shape.batch}, SDPA", build, lambda m: m.layers, loss, hf=False)


def models(names: list[str], smoke: bool) -> tuple[list[Model], list[str]]:
    """The models asked for whose client is installed, and a note for each one skipped."""
    shape = Shape(layers=2, seq=16) if smoke else Shape(layers=4, seq=64)
    out, notes = [], []
    for name in names:
        client = "torchtitan" if name.startswith("tt-") else "transformers"
        if importlib.util.find_spec(client) is None:
            notes.append(f"{name}: {client} is not installed, skipped")
            continue
        if name == "hf-llama":
            out.append(_hf("llama", shape))
        elif name == "hf-qwen3-moe":
            out.append(_hf("qwen3_moe", shape))
        else:
            out.append(_torchtitan_llama3(shape, trim=smoke))
    return out, notes


# --- rows ---------------------------------------------------------------------------------------------------------


def _stock(blocks: nn.Module) -> None:
    """torch's own checkpoint_wrapper around each block, torch's SAC contexts, sac2's llm() save list."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    context_fn = functools.partial(tuc.create_selective_checkpoint_contexts, sac2.policies.llm())
    for name, block in list(blocks.named_children()):
        setattr(blocks, name, checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=True))


def remat_available() -> bool:
    return importlib.util.find_spec("torch_remat") is not None


def _remat(model: nn.Module, blocks: nn.Module, save: list[str] | None, hf: bool) -> None:
    """torch_remat by hand: the calls ``save`` names (as sac2's ``mode="regions"`` picks them) in saved regions,
    each block in ``remat.checkpoint``. Modules keep their place (instance ``forward``s), so names are unchanged."""
    import torch_remat as remat

    def saved(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        kept = remat.region(fn, name, recompute=False)

        def call(*args: Any, **kwargs: Any) -> Any:
            out = kept(*args, **kwargs)
            first = out[0] if isinstance(out, (tuple, list)) else out
            remat.recompute_needs_tensor(first)  # bare ops (views, adds) read it in recompute
            return out

        return call

    def own(module: nn.Module) -> Callable[..., Any]:
        return type(module).forward.__get__(module)

    targets = ["attention"] if save is None else save
    if "attention" in targets and hf:
        _remat_hf_attention(model, saved)
    for index, block in blocks.named_children():
        for name, module in block.named_modules():
            is_kernel = type(module).__name__.endswith("Attention") and next(module.parameters(), None) is None
            if not name or not (
                ("linear" in targets and isinstance(module, nn.Linear))
                or ("experts" in targets and type(module).__name__.endswith("Experts"))
                or ("attention" in targets and not hf and is_kernel)
            ):
                continue
            module.forward = saved(own(module), name)
        block.forward = remat.checkpoint(region_name=f"block {index}")(own(block))


def _remat_hf_attention(model: Any, saved: Callable[..., Any]) -> None:
    """transformers' attention function, registered again as a saved torch_remat region (and its mask function
    under the new name too, or transformers builds no mask for it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = model.config._attn_implementation
    name = f"remat_{implementation}"
    AttentionInterface.register(name, saved(ALL_ATTENTION_FUNCTIONS[implementation], "attention"))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    model.set_attn_implementation(name)


#: What a row does to its copy of the model (given the copy and its block container); it may return what must run
#: before each of the row's steps.
Setup = Callable[[nn.Module, nn.Module], Callable[[], object] | None]


def row_setups(hf: bool) -> dict[str, Setup]:
    """Row name -> its ``Setup``."""
    setups: dict[str, Setup] = {
        "none": lambda _m, _b: None,
        "full AC": lambda m, b: _then_nothing(sac2.apply_ac(m, "full", blocks=b)),
        STOCK: lambda _m, b: _stock(b),
        "sac2 op list": lambda m, b: _then_nothing(sac2.apply_ac(m, "selective", blocks=b)),
    }
    for label, save in SAVES.items():
        setups[f"sac2 regions {label}"] = functools.partial(_apply_regions, save=save)
    setups["sac2 regions matmuls, inputs kept"] = functools.partial(_apply_regions, save=SAVES["matmuls"],
                                                                   keep_inputs=True)
    if remat_available():
        for label, save in SAVES.items():
            setups[f"torch_remat {label}"] = functools.partial(_apply_remat, save=save, hf=hf)
    return setups


def _then_nothing(_done: object) -> None:
    """A setup with nothing to run before each step."""


def _apply_regions(model: nn.Module, blocks: nn.Module, save: list[str] | None, keep_inputs: bool = False) -> None:
    sac2.apply_ac(model, "regions", save=save, blocks=blocks, keep_inputs=keep_inputs)


def _apply_remat(model: nn.Module, blocks: nn.Module, save: list[str] | None, hf: bool) -> None:
    _remat(model, blocks, save, hf)


# --- measuring ----------------------------------------------------------------------------------------------------


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in model.parameters()]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def bench_model(spec: Model, rounds: int) -> list[Row]:
    """Every row on ``spec``: memory and exactness from one step each, then ``rounds`` interleaved timed rounds."""
    base = spec.build()
    setups = row_setups(spec.hf)
    copies, before = {}, {}
    for name, setup in setups.items():
        model = copy.deepcopy(base)
        model.train()
        before[name] = setup(model, spec.blocks(model)) or (lambda: None)
        copies[name] = model
    rows = {name: Row(name) for name in setups}
    losses = {}
    for name, model in copies.items():
        before[name]()
        memory, losses[name] = measure_step(functools.partial(spec.loss, model), "cpu")
        rows[name].kept = memory.kept
    reference, ref_loss = _grads(copies["none"]), losses["none"]
    for name, model in copies.items():
        grads = _grads(model)
        rows[name].equal = torch.equal(losses[name], ref_loss) and len(grads) == len(reference) and all(
            _same(g, r) for g, r in zip(grads, reference, strict=True))
    names = list(setups)
    for name in names:  # warm up every path once more, untimed
        before[name]()
        copies[name].zero_grad(set_to_none=True)
        spec.loss(copies[name]).backward()
    for r in range(rounds):
        for name in (names[i] for i in turns(r, len(names))):
            model = copies[name]
            model.zero_grad(set_to_none=True)
            before[name]()
            start = time.thread_time()
            spec.loss(model).backward()
            rows[name].times.append(time.thread_time() - start)
    return [rows[name] for name in names]


def dominating(rows: list[Row]) -> list[str]:
    """The rows whose step time and kept memory are both no higher than stock SAC's."""
    stock = next(r for r in rows if r.name == STOCK)
    return [r.name for r in rows if r.name != STOCK and r.ms <= stock.ms and r.kept <= stock.kept]


def format_rows(rows: list[Row]) -> str:
    base = rows[0].ms
    width = max(24, *(len(r.name) for r in rows))
    lines = [f"  {'mode':<{width}} {'step ms':>8} {'vs none':>8} {'kept MiB':>9}  grads equal to none"]
    for r in rows:
        lines.append(f"  {r.name:<{width}} {r.ms:8.2f} {r.ms / base:7.2f}x {r.kept / 2**20:9.2f}  "
                     f"{'yes' if r.equal else 'NO'}")
    return "\n".join(lines)


def plot(results: dict[str, list[Row]], path: str, title: str) -> None:
    """Step time against kept memory, one panel per model: stock SAC's dominated quadrant shaded, the Pareto
    front ringed, one legend below."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * len(results), 5))
    FigureCanvasAgg(fig)
    markers = "os^vD<>pP*Xh"
    for k, (model, rows) in enumerate(results.items()):
        ax = fig.add_subplot(1, len(results), k + 1)
        points = [(r.ms, r.kept / 2**20) for r in rows]
        for i, r in enumerate(rows):
            ax.scatter(*points[i], marker=markers[i % len(markers)], zorder=3, label=r.name)
        front = [points[i] for i in pareto_front(points)]
        front_ms, front_kept = zip(*front, strict=True)
        ax.scatter(front_ms, front_kept, s=220, facecolors="none", edgecolors="black", linewidths=1.2, zorder=2,
                   label="Pareto front (no row faster and keeping less)")
        stock = next(p for p, r in zip(points, rows, strict=True) if r.name == STOCK)
        ax.fill_between([0, stock[0]], 0, stock[1], color="tab:green", alpha=0.12, zorder=1,
                        label="dominates stock SAC (step and kept both <= stock's)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("median step ms (thread CPU time, 1 thread)")
        ax.set_ylabel("activation memory kept for backward (MiB)")
        ax.set_title(model)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, bbox_inches="tight")


def main(argv: list[str] | None = None) -> dict[str, list[Row]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (each row one step per round)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--plot", metavar="FILE", help="plot step time against kept memory per model")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (2 layers, seq 16) and 1 round")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'sac2[plot]'")
    rounds = 1 if args.smoke else args.rounds
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        specs, notes = models(names, args.smoke)
        if not remat_available():
            notes.append(f"torch_remat is not installed (pip install torch-remat==0.2.2; it needs torch 2.15, this is "
                         f"{torch.__version__}): no torch_remat rows")
        results: dict[str, list[Row]] = {}
        for spec in specs:
            rows = bench_model(spec, rounds)
            results[spec.name] = rows
            print(f"\n{spec.name} ({spec.describe}); torch {torch.__version__}, 1 thread, median of {rounds} rounds")
            print(format_rows(rows))
            better = dominating(rows)
            print(f"  Pareto-dominate stock SAC (step <= {rows[[r.name for r in rows].index(STOCK)].ms:.2f} ms and "
                  f"kept <= stock's): {', '.join(better) if better else 'none'}")
        for note in notes:
            print(f"note: {note}")
    finally:
        torch.set_num_threads(threads)
    title = f"one-line regions vs stock SAC, torch {torch.__version__}, CPU, 1 thread"
    if args.json:
        payload = {"torch": torch.__version__, "rounds": rounds, "smoke": args.smoke, "notes": notes,
                   "models": {m: {"describe": next(s.describe for s in specs if s.name == m),
                                  "dominate_stock": dominating(rows),
                                  "rows": [{"name": r.name, "median_ms": r.ms, "times_s": r.times,
                                            "kept_bytes": r.kept, "grads_equal": r.equal} for r in rows]}
                              for m, rows in results.items()}}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    if args.plot and results:
        plot(results, args.plot, title)
    return results


if __name__ == "__main__":
    main()
