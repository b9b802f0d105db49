"""Integration tests with real client frameworks (transformers, TRL, torchtitan).

Each test module ``pytest.importorskip``s its client, so the default suite, which runs without them, skips these.
``.ci/clients.sh`` installs the clients (``pip install -e '.[clients]'``) and runs this folder.

Shared helpers: a tiny random-weight Llama, torchtitan's debug models, one fixed token batch, and a two-step SGD
loop with fixed seeds.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

SEQ, BATCH, VOCAB, STEPS = 16, 2, 128, 2


def tokens(vocab: int = VOCAB, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    """One fixed token batch."""
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1234))


def tiny_llama(hidden: int = 64, layers: int = 2, vocab: int = VOCAB) -> Any:
    """A random-weight ``LlamaForCausalLM`` (SDPA attention, 4 heads, 2 KV heads, MLP twice ``hidden`` wide) in train
    mode, the same weights on every call: 2 layers of 64 by default."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.train()
    return model


#: torchtitan 0.3.0 model -> its configs registry (every one has a ``debugmodel`` flavor)
TITAN_REGISTRIES = {"llama3": "llama3_configs", "qwen3": "qwen3_configs", "deepseek_v3": "deepseekv3_configs"}


def titan_model(name: str = "llama3", layers: int | None = None) -> Any:  # torchtitan is untyped
    """torchtitan's debug model ``name`` (its first ``layers`` blocks when given), every block's inner attention
    set to ScaledDotProductAttention (0.3.0's ``attn_backend="sdpa"`` is refused for language models; the class
    itself is causal SDPA), the same weights on every call."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    kwargs = {"moe_comm_backend": "standard"} if name == "deepseek_v3" else {}
    configs = getattr(importlib.import_module(f"torchtitan.models.{name}"), TITAN_REGISTRIES[name])
    config = configs["debugmodel"](attn_backend="flex", **kwargs)
    if layers is not None:
        config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = config.build()
    torch.manual_seed(0)
    model.init_weights()
    return model


def hf_loss(model: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, **kwargs).loss


def train(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module], torch.Tensor], steps: int = STEPS):
    """``steps`` SGD steps (lr 0.1) in train mode; the losses and every parameter after the last step."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        torch.manual_seed(7)
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, parameters(model)


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, by its name in the unwrapped model, detached and cloned."""
    return {
        name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): p.detach().clone()
        for name, p in model.named_parameters()
    }


def assert_bitwise_equal(result, reference) -> None:
    """Losses and parameters of two ``train`` results are bitwise equal (``torch.equal``)."""
    (losses, params), (ref_losses, ref_params) = result, reference
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)), (losses, ref_losses)
    assert params.keys() == ref_params.keys()
    differ = [k for k in params if not torch.equal(params[k], ref_params[k])]
    assert not differ, f"parameters differ from no AC after {STEPS} steps: {differ}"


def assert_close(result, reference, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Losses and parameters of two ``train`` results agree within ``rtol``/``atol`` (used under compile)."""
    (losses, params), (ref_losses, ref_params) = result, reference
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=rtol, atol=atol)
    assert params.keys() == ref_params.keys()
    for k in params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=rtol, atol=atol, msg=k)
