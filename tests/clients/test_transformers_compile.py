"""transformers under torch.compile: a checkpointed LlamaForCausalLM compiles in one graph on every sac2 route.

transformers 5.25 requires the ``kernels`` package, whose wrapper around each attention forward
(``use_kernelized_func``) sets and resets a context variable; compiled, that is a change to an object from outside
the checkpoint, which dynamo refuses inside torch's checkpoint operator ("HOP: Unsafe side effect": a graph break
per layer, the layers run eagerly). sac2's checkpoint keeps the change in the graph, and ``install()`` does so for
HF's own ``gradient_checkpointing_enable``; on transformers 5.24 (no ``kernels``) there is nothing to keep. Each
route: no graph break (dynamo's counters), one graph, no ``EagerFallbackWarning``, and loss and gradients within
atol 1e-5 / rtol 1e-4 of the compiled run without checkpointing. A block forced to break warns, naming it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.utils.checkpoint as tuc  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import sac2  # noqa: E402
import sac2.advisor  # noqa: E402

from . import tiny_llama  # noqa: E402

VOCAB = 256
IDS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))


def llama() -> Any:
    """The issue's model: hidden size 128 and 4 layers."""
    return tiny_llama(hidden=128, layers=4, vocab=VOCAB)


def _budget(model: nn.Module) -> None:
    inputs = {"input_ids": IDS, "labels": IDS, "use_cache": False}
    sac2.apply_ac(model, policy=sac2.advisor.block_memory_budget(model, inputs, 0.5))


def _hf_installed(context: bool) -> Callable[[nn.Module], None]:
    """HF's own gradient_checkpointing_enable while sac2 is installed (the test's fixture installs it), with HF's
    default kwargs or a context_fn of torch's name built after install() (so sac2's)."""

    def route(model: Any) -> None:  # a transformers model: untyped
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if context:
            kwargs["context_fn"] = functools.partial(tuc.create_selective_checkpoint_contexts, sac2.policies.llm())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # 5.25 renames it activation_checkpointing_enable
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    return route


#: Every sac2 route of docs/huggingface.md that compiles, by name.
ROUTES: dict[str, Callable[[nn.Module], Any]] = {
    "apply_ac full": lambda m: sac2.apply_ac(m, "full"),
    "apply_ac selective": lambda m: sac2.apply_ac(m, "selective"),
    "apply_ac regions": lambda m: sac2.apply_ac(m, "regions"),
    "apply_ac budget": _budget,
    "sac2.checkpoint_wrapper": lambda m: sac2.apply_activation_checkpointing(
        m, check_fn=lambda sub: type(sub).__name__ == "LlamaDecoderLayer"),
    "install(), HF's gradient_checkpointing_enable": _hf_installed(context=False),
    "install(), HF's gradient_checkpointing_enable, sac2 context_fn": _hf_installed(context=True),
}


def compiled_step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One compiled forward and backward (aot_eager), from a reset dynamo and cleared counters; EagerFallbackWarning
    is an error. The loss and each parameter's gradient, by its name in the unwrapped model."""
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", sac2.EagerFallbackWarning)
        loss = torch.compile(model, backend="aot_eager")(input_ids=IDS, labels=IDS, use_cache=False).loss
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.fixture(scope="module")
def no_checkpointing() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return compiled_step(llama())


@pytest.mark.parametrize("route", ROUTES)
def test_a_checkpointed_llama_compiles_in_one_graph_like_no_checkpointing(route: str, no_checkpointing) -> None:
    model = llama()
    with sac2.install() if route.startswith("install()") else contextlib.nullcontext():
        ROUTES[route](model)
        loss, grads = compiled_step(model)
    assert not counters["graph_break"], list(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    want_loss, want_grads = no_checkpointing
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def _breaking_mlp(model: Any) -> None:  # a transformers model: untyped
    """Make every decoder layer's MLP break dynamo's graph (a forward pre-hook calling graph_break)."""
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: torch._dynamo.graph_break())


@pytest.mark.parametrize("route", ["apply_ac selective", "install(), HF's gradient_checkpointing_enable"])
def test_a_layer_that_falls_back_to_eager_warns_naming_it(route: str) -> None:
    model = llama()
    _breaking_mlp(model)
    with sac2.install() if route.startswith("install()") else contextlib.nullcontext():
        ROUTES[route](model)
        with pytest.raises(sac2.EagerFallbackWarning, match="the checkpointed block LlamaDecoderLayer") as caught:
            compiled_step(model)
    assert "Call to `torch._dynamo.graph_break()`" in str(caught.value)
