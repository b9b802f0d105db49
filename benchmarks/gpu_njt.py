"""Packed documents without padding: SDPA over nested jagged tensors (NJT) under selective checkpointing.

The other packed-document path beside flex attention's block masks (``gpu_flex_sac.py``): each document is one
component of a ``torch.jagged`` nested tensor and attention runs per document through SDPA's NJT support. Each
block is wrapped with ``checkpoint_wrapper`` (torch's for no AC's twin rows and stock SAC, sac2's for sac2 SAC);
both SAC modes use ``sac2.policies.llm()`` (matmuls and every attention kernel saved). Every mode runs eager and
under ``torch.compile`` of the wrapped block, each compiled row after ``torch._dynamo.reset()`` (the rows share
``forward``'s code object, so without it later rows run out of recompiles and fall back to eager). Per row: median
step time, its ratio to no AC of the same kind, peak memory, the attention kernels that ran again in backward (counted
by a dispatch mode over one more, untimed backward: served ops never reach it; compiled code reaches it through its
fallback kernels), the graphs dynamo compiled, and whether loss and gradients match no AC (bitwise in eager,
allclose under compile). On CUDA every row runs under ``sac2.measure.determinism.deterministic_kernels``: without it
attention's backward differs from run to run and no row could match bitwise.

    python benchmarks/gpu_njt.py --json njt.json      # GPU, bf16, about a minute on one H200
    python benchmarks/gpu_njt.py --smoke              # CPU, tiny, fp32, aot_eager backend: what the tests run
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as tcw
from torch.utils._python_dispatch import TorchDispatchMode

import sac2
from sac2.measure.determinism import deterministic_kernels
from sac2.policies import llm

__all__ = ["Config", "MODES", "run", "main"]

#: (name, checkpointing, compiled)
MODES = tuple(
    (f"{ac}{' compiled' if c else ''}", ac, c) for c in (False, True) for ac in ("no_ac", "stock_sac", "sac2_sac")
)


@dataclass(frozen=True)
class Config:
    dim: int
    n_layers: int
    n_heads: int
    doc_lens: tuple[int, ...]
    warmup: int
    steps: int
    dtype: str
    backend: str  # torch.compile backend of the compiled rows


GPU = Config(dim=1024, n_layers=8, n_heads=16, doc_lens=(3072, 1024, 2048, 512, 4096, 1536, 2560, 1632),
             warmup=3, steps=10, dtype="bfloat16", backend="inductor")
SMOKE = Config(dim=32, n_layers=2, n_heads=4, doc_lens=(5, 9, 3), warmup=0, steps=1, dtype="float32",
               backend="aot_eager")


class CountAttentionKernels(TorchDispatchMode):
    """Counts the forward attention kernels that reach it (over a backward: the ones recompute ran again; an op a
    SAC mode served from its cache never gets here)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "attention" in name and "backward" not in name:
            self.calls += 1
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    """Attention (separate q, k, v projections: NJT SDPA needs each contiguous) and a SiLU MLP, with residuals."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:  # (docs, jagged, dim) -> (docs, heads, jagged, head dim)
            return t.unflatten(-1, (self.n_heads, -1)).transpose(1, 2)

        # SDPA within each document (NJT: no is_causal with ragged sequences)
        a = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        x = x + self.o(a.transpose(1, 2).flatten(-2))
        return x + self.down(F.silu(self.up(x)))


def _wrap(ac: str, smoke: bool) -> Callable[[nn.Module], nn.Module]:
    # CPU NJT SDPA runs its math path on strided nested tensors, whose sizes the default determinism check cannot read
    kwargs: dict[str, Any] = {"determinism_check": "none"} if smoke else {}
    if ac == "no_ac":
        return lambda block: block
    if ac == "stock_sac":
        contexts = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, llm())
        return lambda block: tcw.checkpoint_wrapper(block, context_fn=contexts, **kwargs)
    contexts = functools.partial(sac2.create_selective_checkpoint_contexts, llm())
    return lambda block: sac2.checkpoint_wrapper(block, context_fn=contexts, **kwargs)


def _batch(cfg: Config, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    docs = [torch.randn(n, cfg.dim, generator=g) for n in cfg.doc_lens]
    return torch.nested.nested_tensor(docs, layout=torch.jagged, device=device, dtype=getattr(torch, cfg.dtype))


def run(name: str, ac: str, compiled: bool, cfg: Config, device: torch.device, smoke: bool) -> dict[str, Any]:
    """Train ``cfg.warmup + cfg.steps`` steps of one mode; the row, and the last step's loss and gradients."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers)).to(device, getattr(torch, cfg.dtype))
    wrap = _wrap(ac, smoke)
    calls: list[Callable[..., Any]] = [wrap(b) for b in blocks]
    if compiled:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        calls = [torch.compile(c, backend=cfg.backend) for c in calls]
    x = _batch(cfg, device)
    cuda = device.type == "cuda"
    times = []

    def forward() -> torch.Tensor:
        h = x
        for call in calls:
            h = call(h)
        return h.values().float().square().mean()

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(cfg.warmup + cfg.steps):
        blocks.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = forward()
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        if step >= cfg.warmup:
            times.append(time.perf_counter() - start)
    grads = [loss.detach(), *(p.grad.clone() for p in blocks.parameters())]
    extra = forward()  # untimed: count the attention kernels its backward runs again
    with CountAttentionKernels() as kernels:
        extra.backward()
    row = {
        "mode": name,
        "compiled": compiled,
        "backend": cfg.backend if compiled else None,
        "step_ms": statistics.median(times) * 1e3,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "attn_reruns_per_step": kernels.calls,
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] if compiled else None,
    }
    return {"row": row, "grads": grads}


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'mode':<20} {'step ms':>9} {'x no AC':>8} {'peak GiB':>9} {'attn re-runs':>13} {'graphs':>7} "
             f"{'matches no AC':>14}"]
    base = {r["compiled"]: r["step_ms"] for r in rows if r["mode"].startswith("no_ac") and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"{r['mode']:<20} failed: {r['error']}")
            continue
        mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        graphs = "-" if r["graphs"] is None else str(r["graphs"])
        ratio = f"{r['step_ms'] / base[r['compiled']]:>8.2f}" if r["compiled"] in base else f"{'-':>8}"
        lines.append(f"{r['mode']:<20} {r['step_ms']:>9.1f} {ratio} {mem:>9} {r['attn_reruns_per_step']:>13} "
                     f"{graphs:>7} {str(r['equal']):>14}")
    return "\n".join(lines)


def _row(name: str, ac: str, compiled: bool, cfg: Config, device: torch.device, smoke: bool,
         ref: dict[bool, list[torch.Tensor]]) -> dict[str, Any]:
    """One mode's row, checked against no AC of the same kind; a mode that raises is a row naming the error (off
    the smoke run), so it does not hide the others' figures."""
    try:
        out = run(name, ac, compiled, cfg, device, smoke)
    except Exception as e:  # any failure is the row's result; the whole error goes to the output
        if smoke:
            raise
        traceback.print_exc()
        failed = {"mode": name, "compiled": compiled, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        print(f"-- {json.dumps(failed)}", flush=True)
        return failed
    if ac == "no_ac":
        ref[compiled] = out["grads"]
    tol = 1e-2 if cfg.dtype == "bfloat16" else 1e-4
    same = functools.partial(torch.allclose, atol=tol / 10, rtol=tol) if compiled else torch.equal
    reference = ref.get(compiled)
    row: dict[str, Any] = out["row"]
    row["equal"] = reference is not None and all(same(a, b) for a, b in zip(out["grads"], reference, strict=True))
    row["check"] = "allclose" if compiled else "bitwise"
    print(f"-- {json.dumps(row)}", flush=True)  # as it comes: a run cut off by its time limit still shows it
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    parser.add_argument("--smoke", action="store_true", help="tiny, fp32, CPU unless --device, one step per mode")
    parser.add_argument("--json", help="write the table to this JSON file")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    cfg = SMOKE if args.smoke else GPU
    ref: dict[bool, list[torch.Tensor]] = {}
    with deterministic_kernels(device) as deterministic:
        rows = [_row(name, ac, compiled, cfg, device, args.smoke, ref) for name, ac, compiled in MODES]
    print(f"NJT SDPA, docs {list(cfg.doc_lens)}, {cfg.dtype}, {device}; compiled rows: torch.compile(backend="
          f"{cfg.backend!r}) of each checkpoint_wrapper'ed block; matches: bitwise eager, allclose compiled; "
          f"deterministic kernels: {deterministic}")
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": asdict(cfg), "device": str(device), "torch": torch.__version__,
                       "deterministic": deterministic, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
