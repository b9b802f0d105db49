"""``sac2.apply_ac(..., offload=...)`` on models sac2 did not write, through the CPU stand-in for a device
(``sac2.offload.standin``): transformers' Llama and torchtitan 0.3.0's llama3 debug model train 2 steps bitwise like
the same model saving the same tensors on the device, and the tensors do go to the host and back."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torchtitan")

import torch.nn.functional as F  # noqa: E402

import sac2  # noqa: E402
from sac2.offload.standin import stand_in  # noqa: E402

from . import assert_bitwise_equal, hf_loss, tiny_llama, titan_model, tokens, train  # noqa: E402

#: (mode, offload=..., the same saves on the device): what offload moves is what the other keeps.
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "full-inputs": ("full", {"offload": ["inputs"]}, {}),
    "regions-inputs-attention": ("regions", {"offload": ["inputs", "attention"]}, {}),
    "regions-linear-offloaded": ("regions", {"save": ["attention"], "offload": ["linear"]},
                                 {"save": ["attention", "linear"]}),
    "selective-inputs": ("selective", {"offload": ["inputs"]}, {}),
}


def _hf_train(model):
    ids = tokens()
    return train(model, lambda m: hf_loss(m, ids, use_cache=False))


def _titan(model):
    ids = tokens(vocab=model.tok_embeddings.num_embeddings, seq=17)

    def loss(m):
        logits = m(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    return train(model, loss)


def _model(kind):
    if kind == "hf":
        model = tiny_llama()
        model.config.use_cache = False
        return model, _hf_train
    return titan_model("llama3", layers=3), _titan


@pytest.mark.parametrize("case", CASES, ids=CASES)
@pytest.mark.parametrize("kind", ["hf", "torchtitan"])
def test_offload_trains_bitwise_like_saving_the_same_tensors(kind, case):
    mode, offloading, saving = CASES[case]
    model, run = _model(kind)
    with stand_in() as link:
        sac2.apply_ac(model, mode, **offloading)
        result = run(model)
    sent, back = ([str(label) for what, label in link.log if what == kind_] for kind_ in ("to_host", "to_device"))
    assert sent and sorted(back) == sorted(sent)  # each tensor sent is read back once per step
    reference, run = _model(kind)
    sac2.apply_ac(reference, mode, **saving)
    assert_bitwise_equal(result, run(reference))
