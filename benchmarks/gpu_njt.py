"""Packed documents without padding: SDPA over nested jagged tensors (NJT) under selective checkpointing.

The other packed-document path beside flex attention's block masks (``gpu_flex_sac.py``): each document is one
component of a ``torch.jagged`` nested tensor and attention runs per document through SDPA's NJT support. Each
block is wrapped with ``checkpoint_wrapper`` (torch's for no AC's twin rows and stock SAC, sac2's for sac2 SAC);
both SAC modes use ``sac2.policies.llm()`` (matmuls and every attention kernel saved). Every mode runs eager and
under ``torch.compile`` of the wrapped block. Per row: median step time, its ratio to no AC of the same kind, peak
memory, how often attention ran again in backward (eager only: compiled code does not call Python), and whether
loss and gradients match no AC (bitwise in eager, allclose under compile).

    python benchmarks/gpu_njt.py --json njt.json      # GPU, bf16, about a minute on one H200
    python benchmarks/gpu_njt.py --smoke              # CPU, tiny, fp32, aot_eager backend: what the tests run
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as tcw

import sac2
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


class Attention:
    """SDPA within each document that counts its calls, so a run can tell how often backward re-ran attention."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.scaled_dot_product_attention(q, k, v)  # NJT: no is_causal with ragged sequences


class Block(nn.Module):
    """Attention (separate q, k, v projections: NJT SDPA needs each contiguous) and a SiLU MLP, with residuals."""

    def __init__(self, cfg: Config, attend: Attention) -> None:
        super().__init__()
        self.n_heads, self.attend = cfg.n_heads, attend
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:  # (docs, jagged, dim) -> (docs, heads, jagged, head dim)
            return t.unflatten(-1, (self.n_heads, -1)).transpose(1, 2)

        a = self.attend(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
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
    attend = Attention()
    blocks = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.n_layers)).to(device, getattr(torch, cfg.dtype))
    wrap = _wrap(ac, smoke)
    calls: list[Callable[..., Any]] = [wrap(b) for b in blocks]
    if compiled:
        calls = [torch.compile(c, backend=cfg.backend) for c in calls]
    x = _batch(cfg, device)
    cuda = device.type == "cuda"
    times, reruns = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(cfg.warmup + cfg.steps):
        blocks.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        h = x
        for call in calls:
            h = call(h)
        loss = h.values().float().square().mean()
        forward_calls = attend.calls
        loss.backward()
        reruns.append(attend.calls - forward_calls)
        if cuda:
            torch.cuda.synchronize(device)
        if step >= cfg.warmup:
            times.append(time.perf_counter() - start)
    grads = [loss.detach(), *(p.grad for p in blocks.parameters())]
    row = {
        "mode": name,
        "compiled": compiled,
        "backend": cfg.backend if compiled else None,
        "step_ms": statistics.median(times) * 1e3,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "attn_reruns_per_step": None if compiled else reruns[-1],
    }
    return {"row": row, "grads": grads}


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'mode':<20} {'step ms':>9} {'x no AC':>8} {'peak GiB':>9} {'attn re-runs':>13} {'matches no AC':>14}"]
    base = {r["compiled"]: r["step_ms"] for r in rows if r["mode"].startswith("no_ac")}
    for r in rows:
        mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        rerun = "-" if r["attn_reruns_per_step"] is None else str(r["attn_reruns_per_step"])
        lines.append(f"{r['mode']:<20} {r['step_ms']:>9.1f} {r['step_ms'] / base[r['compiled']]:>8.2f} {mem:>9} "
                     f"{rerun:>13} {str(r['equal']):>14}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    parser.add_argument("--smoke", action="store_true", help="tiny, fp32, CPU unless --device, one step per mode")
    parser.add_argument("--json", help="write the table to this JSON file")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    cfg = SMOKE if args.smoke else GPU
    rows, ref = [], {}
    for name, ac, compiled in MODES:
        out = run(name, ac, compiled, cfg, device, args.smoke)
        if ac == "no_ac":
            ref[compiled] = out["grads"]
        tol = 1e-2 if cfg.dtype == "bfloat16" else 1e-4
        same = functools.partial(torch.allclose, atol=tol / 10, rtol=tol) if compiled else torch.equal
        out["row"]["equal"] = all(same(a, b) for a, b in zip(out["grads"], ref[compiled], strict=True))
        out["row"]["check"] = "allclose" if compiled else "bitwise"
        rows.append(out["row"])
    print(f"NJT SDPA, docs {list(cfg.doc_lens)}, {cfg.dtype}, {device}; compiled rows: torch.compile(backend="
          f"{cfg.backend!r}) of each checkpoint_wrapper'ed block; matches: bitwise eager, allclose compiled")
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": asdict(cfg), "device": str(device), "torch": torch.__version__, "rows": rows}, f,
                      indent=2)
    return rows


if __name__ == "__main__":
    main()
