"""Compiled flex attention inside selective checkpointing: no AC, full AC, torch's SAC (plain and torchtitan's
setup), sac2's SAC and torch_remat.

A small llama-style model with ``torch.compile(flex_attention)`` and a document-causal block mask trains a few
steps per mode. Every SAC mode saves mm and attention:

- ``torch_sac``: stock SAC, mm and the flex HOP in its save list. Its policy cannot see the compiled flex kernel,
  so it re-runs flex in backward.
- ``torchtitan_sac``: torchtitan's current stock setup, ``torch.compile(flex_attention,
  options={"wrap_inductor_compiled_regions": True})`` with ``torch.ops.higher_order.inductor_compiled_code`` in
  stock SAC's save list, so stock SAC sees the compiled kernel as one HOP call and can save it.
- ``sac2_sac``: flex in a named ``sac2.region`` that sac2's policy saves.
- ``torch_remat`` (only when torch_remat is installed): flex and the matmuls each in a
  ``remat.region(..., recompute=False)``.

Per mode it prints the median step time, its ratio to no AC, peak memory, whether flex ran compiled (torch's
unfused-path warning never appeared) and how many times per step the flex kernel ran again in backward (the
compiled callable's calls; for ``torchtitan_sac`` the ``inductor_compiled_code`` calls that stock SAC did not
serve from its cache). Each mode runs in a process of its own (``in_own_process``); a mode that raises is a row
naming the error (on an H200, torch 2.13: ``torchtitan_sac``, stock SAC's replay missing ``aten.new_zeros``).

    python benchmarks/gpu_flex_sac.py --json flex.json          # GPU, about 3 minutes on one H200
    python benchmarks/gpu_flex_sac.py --mode sac2_sac           # one mode, in this process
    python benchmarks/gpu_flex_sac.py --device cpu --smoke      # forward only, tiny: what the test suite runs

The smoke run compiles flex with the ``eager`` backend (dynamo traces the frame, flex runs its dense path; no
inductor options, so ``torchtitan_sac`` there is stock SAC with the HOP in its list but never met).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

import sac2

__all__ = ["Config", "MODES", "run", "run_or_report", "in_own_process", "main"]

HAS_REMAT = importlib.util.find_spec("torch_remat") is not None
MODES = ("no_ac", "full_ac", "torch_sac", "torchtitan_sac", "sac2_sac", *(("torch_remat",) if HAS_REMAT else ()))
_ICC = getattr(torch.ops.higher_order, "inductor_compiled_code", None)
_UNFUSED_WARNING = "flex_attention_performance"  # torch's id for "flex_attention called without torch.compile()"


@dataclass(frozen=True)
class Config:
    dim: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int
    vocab: int
    n_docs: int
    warmup: int
    steps: int


GPU = Config(dim=1024, n_layers=8, n_heads=16, seq_len=4096, batch=2, vocab=8192, n_docs=8, warmup=2, steps=6)
SMOKE = Config(dim=64, n_layers=2, n_heads=4, seq_len=128, batch=1, vocab=128, n_docs=3, warmup=0, steps=1)


@cache
def _compiled_flex(backend: str, wrapped: bool) -> Callable:
    """One per process and kind: every mode reuses its compilation. ``wrapped``: torchtitan's option, which makes
    the compiled code one ``inductor_compiled_code`` HOP call (inductor only)."""
    if wrapped and backend == "inductor":
        return torch.compile(flex_attention, options={"wrap_inductor_compiled_regions": True})
    return torch.compile(flex_attention, backend=backend)


class _CountCompiledCode(TorchDispatchMode):
    """Counts the ``inductor_compiled_code`` calls that reach it: above a SAC mode, the ones it did not replay."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _ICC:
            self.calls += 1
        return func(*args, **(kwargs or {}))


if _ICC is not None:  # a HOP reaches a Python mode only through a rule registered for that mode's type
    _ICC.py_impl(_CountCompiledCode)(lambda mode, *args, **kwargs: mode.__torch_dispatch__(_ICC, [], args, kwargs))


class Attend:
    """Compiled flex attention that counts its calls, so a run can tell how often backward re-ran it."""

    def __init__(self, backend: str, wrapped: bool = False) -> None:
        self.flex = _compiled_flex(backend, wrapped)
        self.calls = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
        self.calls += 1
        return self.flex(q, k, v, block_mask=block_mask)


class Block(nn.Module):
    """Pre-norm attention (fused QKV, flex attention) and pre-norm SwiGLU MLP, each with a residual."""

    def __init__(self, cfg: Config, attend: Callable, keep: Callable[[Callable, str], Callable] | None) -> None:
        super().__init__()
        self.n_heads, self.attend, self.keep = cfg.n_heads, attend, keep or (lambda fn, _name: fn)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.up = nn.Linear(cfg.dim, 2 * 4 * cfg.dim, bias=False)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
        b, s, d = x.shape
        keep = self.keep  # the identity, or torch_remat's saved region around each matmul
        q, k, v = keep(self.qkv, "qkv")(F.rms_norm(x, (d,))).view(b, s, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        x = x + keep(self.o, "o")(self.attend(q, k, v, block_mask).transpose(1, 2).reshape(b, s, d))
        gate, up = keep(self.up, "up")(F.rms_norm(x, (d,))).chunk(2, dim=-1)
        return x + keep(self.down, "down")(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, cfg: Config, attend: Callable, run_block: Callable, keep: Callable | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, attend, keep) for _ in range(cfg.n_layers))
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.run_block = run_block

    def forward(self, tokens: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = self.run_block(block, x, block_mask)
        return self.head(F.rms_norm(x, (x.shape[-1],)))


def document_causal_mask(cfg: Config, device: torch.device) -> BlockMask:
    """Causal attention within each of ``cfg.n_docs`` documents of random lengths packed into one sequence."""
    g = torch.Generator().manual_seed(0)
    cuts = torch.randperm(cfg.seq_len - 1, generator=g)[: cfg.n_docs - 1] + 1
    doc = torch.zeros(cfg.seq_len, dtype=torch.long)
    doc[cuts] = 1
    doc = doc.cumsum(0).to(device)

    def mask_mod(_b, _h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return create_block_mask(mask_mod, None, None, cfg.seq_len, cfg.seq_len, device=str(device))


def _block_runner(mode: str) -> Callable:
    aten = torch.ops.aten
    if mode == "no_ac":
        return lambda block, x, mask: block(x, mask)
    if mode == "full_ac":
        return lambda block, x, mask: tuc.checkpoint(block, x, mask, use_reentrant=False)
    if mode in ("torch_sac", "torchtitan_sac"):
        ops: list[Any] = [aten.mm.default, torch.ops.higher_order.flex_attention]  # ops, HOPs and a Region below
        if mode == "torchtitan_sac" and _ICC is not None:
            ops.append(_ICC)
        contexts = partial(tuc.create_selective_checkpoint_contexts, ops)
        return lambda block, x, mask: tuc.checkpoint(block, x, mask, use_reentrant=False, context_fn=contexts)
    if mode == "torch_remat":
        import torch_remat as remat

        return lambda block, x, mask: remat.checkpoint(region_name="block")(block)(x, mask)
    ops = [aten.mm.default, torch.ops.higher_order.flex_attention, sac2.Region("attn")]
    contexts = partial(sac2.create_selective_checkpoint_contexts, ops)
    return lambda block, x, mask: sac2.checkpoint(block, x, mask, context_fn=contexts)


def run(mode: str, cfg: Config, device: torch.device, smoke: bool) -> dict[str, Any]:
    """Train ``cfg.warmup + cfg.steps`` steps under ``mode`` (forward only if ``smoke``) and measure them."""
    torch.manual_seed(0)
    # smoke: dynamo still compiles the frame, no codegen
    counter = Attend("eager" if smoke else "inductor", wrapped=mode == "torchtitan_sac")
    attend: Callable[..., Any] = counter
    keep: Callable[[Callable, str], Callable] | None = None
    if mode == "sac2_sac":
        attend = sac2.region(counter, name="attn")
    elif mode == "torch_remat":
        attend, keep = _remat_keep(counter, "attn"), _remat_keep
    model = Model(cfg, attend, _block_runner(mode), keep).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mask = document_causal_mask(cfg, device)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), device=device)
    cuda = device.type == "cuda"
    times, reruns = [], []
    flex_module._WARNINGS_SHOWN.discard(_UNFUSED_WARNING)  # torch warns once per process; we ask per mode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for step in range(cfg.warmup + cfg.steps):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            if smoke:
                with torch.no_grad():  # compiled flex has no CPU backward
                    model(tokens[:, :-1], mask)
            else:
                logits = model(tokens[:, :-1], mask)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                forward_calls = counter.calls
                loss.backward()
                reruns.append(counter.calls - forward_calls)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
            if step >= cfg.warmup:
                times.append(time.perf_counter() - start)
        if not smoke and mode == "torchtitan_sac" and _ICC is not None:  # one more step, untimed, counting HOPs
            loss = F.cross_entropy(model(tokens[:, :-1], mask).flatten(0, 1).float(), tokens[:, 1:].flatten())
            with _CountCompiledCode() as hops:
                loss.backward()
            opt.zero_grad(set_to_none=True)
            reruns.append(hops.calls)
    unfused = any("flex_attention called without torch.compile" in str(w.message) for w in caught)
    return {
        "mode": mode,
        "step_ms": statistics.median(times) * 1e3,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "flex_compiled": not unfused,
        "flex_reruns_per_step": reruns[-1] if reruns else None,
    }


def _remat_keep(fn: Callable, name: str) -> Callable:
    """``fn`` in torch_remat's saved region; its output persists, as bare ops read it in recompute."""
    import torch_remat as remat

    saved = remat.region(fn, name, recompute=False)

    def call(*args: Any) -> torch.Tensor:
        out = saved(*args)
        remat.recompute_needs_tensor(out)
        return out

    return call


def run_or_report(mode: str, cfg: Config, device: torch.device, smoke: bool) -> dict[str, Any]:
    """``run``, or, when the mode raises (stock SAC can: its replay misses ops that compiled flex never dispatched
    in forward), a row that names the error, so one failing mode does not hide the others' figures."""
    try:
        row = run(mode, cfg, device, smoke)
    except Exception as e:  # any failure is the row's result; the whole error goes to the output
        if smoke:
            raise
        traceback.print_exc()
        row = {"mode": mode, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    print(f"-- {json.dumps(row)}", flush=True)  # as it comes: a run cut off by its time limit still shows it
    return row


def in_own_process(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """``mode``'s row from a child process of this script. Each mode runs alone: one that fails leaves torch's
    global state behind (measured on an H200: after stock SAC's replay miss in ``torchtitan_sac``, dynamo traced
    flex's eager autograd in the next mode and refused it), and no mode reuses another's compiled flex."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        command = [sys.executable, __file__, "--device", args.device, "--mode", mode, "--json", str(out)]
        done = subprocess.run([*command, *(["--smoke"] if args.smoke else [])], check=False)
        if out.exists():
            row: dict[str, Any] = json.loads(out.read_text())["rows"][0]
            return row
        return {"mode": mode, "error": f"its process exited with {done.returncode} and no row (its output above)"}


def _table(rows: list[dict[str, Any]]) -> str:
    base = next((r["step_ms"] for r in rows if r["mode"] == "no_ac" and "error" not in r), None)
    lines = [f"{'mode':<14} {'step ms':>9} {'x no AC':>8} {'peak GiB':>9} {'flex compiled':>14} {'flex re-runs':>13}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['mode']:<14} failed: {r['error']}")
            continue
        mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        rerun = "-" if r["flex_reruns_per_step"] is None else str(r["flex_reruns_per_step"])
        ratio = "-" if base is None else f"{r['step_ms'] / base:.2f}"
        lines.append(
            f"{r['mode']:<14} {r['step_ms']:>9.1f} {ratio:>8} {mem:>9} "
            f"{str(r['flex_compiled']):>14} {rerun:>13}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny model, forward only, one step per mode")
    parser.add_argument("--json", help="write the table to this JSON file")
    parser.add_argument("--mode", action="append", choices=MODES, help="run only this mode (repeatable; default all)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg = SMOKE if args.smoke else GPU
    modes = args.mode or MODES
    if len(modes) == 1:
        rows = [run_or_report(modes[0], cfg, device, args.smoke)]
    else:
        rows = [in_own_process(mode, args) for mode in modes]
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg.__dict__, "device": str(device), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
