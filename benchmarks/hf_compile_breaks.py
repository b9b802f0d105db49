"""Graph breaks of a checkpointed Hugging Face Llama under torch.compile, route by route, sac2 beside stock torch.

The model is issue #41's: a LlamaForCausalLM of hidden size 128 and 4 layers (SDPA, random weights, train mode,
batch 2, sequence 32). Each row checkpoints a fresh copy by one route, compiles it (``torch.compile(model)``,
aot_eager by default) after ``torch._dynamo.reset()``, runs one forward and backward and reads dynamo's counters:
graph breaks and graphs; then how many ``sac2.EagerFallbackWarning``s the step gave, how many checkpointed
forwards sac2's eager path ran (``sac2.forward_count()`` moves while tracing too: a selective route counts there),
and whether the loss and every gradient are within atol 1e-5 / rtol 1e-4 of the compiled run without
checkpointing. Numbers only: ``tests/clients/test_transformers_compile.py`` asserts sac2's rows.

Run it in the venv of the transformers to measure (5.25 breaks in stock routes, 5.24 does not)::

    PYTHONPATH=. python benchmarks/hf_compile_breaks.py [--backend aot_eager] [--routes NAME,NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import warnings
from typing import Any, Callable

import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch._dynamo.utils import counters

import sac2
import sac2.advisor

VOCAB = 256
IDS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))


def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.train()
    return model


def _hf(context_fn: Callable[[], Any] | None) -> Callable[[nn.Module], None]:
    def route(model: Any) -> None:  # a transformers model: untyped
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5.25 renames it
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    return route


def _torch_wrapper(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_ac

    torch_ac.apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=torch_ac.checkpoint_wrapper,
        check_fn=lambda sub: type(sub).__name__ == "LlamaDecoderLayer")


def _budget(model: nn.Module) -> None:
    inputs = {"input_ids": IDS, "labels": IDS, "use_cache": False}
    sac2.apply_ac(model, policy=sac2.advisor.block_memory_budget(model, inputs, 0.5))


def _torch_contexts() -> Any:
    return functools.partial(tuc.create_selective_checkpoint_contexts, sac2.policies.llm())


def _sac2_contexts() -> Any:
    return functools.partial(sac2.create_selective_checkpoint_contexts, sac2.policies.llm())


#: name -> (how it checkpoints the model, whether sac2 is installed meanwhile)
ROUTES: dict[str, tuple[Callable[[nn.Module], Any], bool]] = {
    "sac2 apply_ac full": (lambda m: sac2.apply_ac(m, "full"), False),
    "sac2 apply_ac selective": (lambda m: sac2.apply_ac(m, "selective"), False),
    "sac2 apply_ac regions": (lambda m: sac2.apply_ac(m, "regions"), False),
    "sac2 apply_ac budget 0.5": (_budget, False),
    "sac2 checkpoint_wrapper": (lambda m: sac2.apply_activation_checkpointing(
        m, check_fn=lambda sub: type(sub).__name__ == "LlamaDecoderLayer"), False),
    "sac2 install() + HF gradient_checkpointing_enable": (_hf(None), True),
    "sac2 install() + HF gradient_checkpointing_enable with SAC llm()": (_hf(_torch_contexts), True),
    "HF gradient_checkpointing_enable with sac2 context_fn (no install)": (_hf(_sac2_contexts), False),
    "stock HF gradient_checkpointing_enable": (_hf(None), False),
    "stock HF gradient_checkpointing_enable with SAC llm()": (_hf(_torch_contexts), False),
    "stock torch checkpoint_wrapper": (_torch_wrapper, False),
}


def step(model: nn.Module, backend: str) -> dict[str, Any]:
    """One compiled step from a reset dynamo: breaks, graphs, fallback warnings, sac2's eager forwards, loss, grads."""
    torch._dynamo.reset()
    counters.clear()
    before = sac2.forward_count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend=backend)(input_ids=IDS, labels=IDS, use_cache=False).loss
        loss.backward()
    return {
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "fallbacks": sum(issubclass(w.category, sac2.EagerFallbackWarning) for w in caught),
        "forwards": sac2.forward_count() - before,
        "loss": loss.detach(),
        "grads": [p.grad for p in model.parameters()],
    }


def close(a: dict[str, Any], b: dict[str, Any]) -> bool:
    pairs = [(a["loss"], b["loss"]), *zip(a["grads"], b["grads"], strict=True)]
    return all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in pairs)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--routes", default=",".join(ROUTES), help="comma-separated row names (default: all)")
    args = parser.parse_args(argv)
    import transformers

    reference = step(llama(), args.backend)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, backend {args.backend}; "
          f"no checkpointing: {reference['breaks']} graph breaks, {reference['graphs']} graphs")
    print(f"{'route':<66} {'breaks':>6} {'graphs':>6} {'fallback warnings':>17} {'sac2 forwards':>13}  close")
    rows = []
    for name in args.routes.split(","):
        apply, installed = ROUTES[name]
        model = llama()
        with sac2.install() if installed else contextlib.nullcontext():
            apply(model)
            row = step(model, args.backend)
        row["name"], row["close"] = name, close(row, reference)
        rows.append(row)
        print(f"{name:<66} {row['breaks']:>6} {row['graphs']:>6} {row['fallbacks']:>17} {row['forwards']:>13}  "
              f"{'yes' if row['close'] else 'NO'}")
    return rows


if __name__ == "__main__":
    main()
