"""TRL: its selective-activation-checkpointing helper, backed by sac2 under ``sac2.integrations.install()``."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import sac2  # noqa: E402
from sac2.integrations import install  # noqa: E402

from . import assert_bitwise_equal, hf_loss, tiny_llama, tokens, train  # noqa: E402

LAYERS = 2


@pytest.fixture(scope="module")
def no_ac():
    ids = tokens()
    return train(tiny_llama(), lambda m: hf_loss(m, ids))


def _trl_sac_model():
    from trl.models import enable_selective_activation_checkpointing

    model = tiny_llama()
    enable_selective_activation_checkpointing(model)  # builds its context_fn from the name it imported from torch
    model.gradient_checkpointing_enable()
    return model


def test_trl_selective_checkpointing_under_install_trains_bitwise_like_no_ac(no_ac):
    ids = tokens()
    with install():
        model = _trl_sac_model()
        result = train(model, lambda m: hf_loss(m, ids))
    assert_bitwise_equal(result, no_ac)


def test_trl_selective_checkpointing_under_install_runs_sac2_modes():
    ids = tokens()
    with install() as handle:
        model = _trl_sac_model()
        handle.verify()
        before = sac2.forward_count()
        train(model, lambda m: hf_loss(m, ids))
        assert sac2.forward_count() - before == LAYERS * 2


def test_trl_selective_checkpointing_keeps_sac2_after_uninstall():
    """The context_fn TRL built while installed holds sac2's function, so training after uninstall() still runs
    sac2's modes."""
    ids = tokens()
    with install():
        model = _trl_sac_model()
    before = sac2.forward_count()
    train(model, lambda m: hf_loss(m, ids))
    assert sac2.forward_count() - before == LAYERS * 2


def test_trl_helper_module_binding_is_rebound_by_install():
    import torch.utils.checkpoint as tuc
    import trl.models.selective_activation_checkpointing as trl_sac

    (torch_fn,) = (tuc.create_selective_checkpoint_contexts,)  # a local: install() rebinds only module-level names
    assert trl_sac.create_selective_checkpoint_contexts is torch_fn
    with install() as handle:
        assert trl_sac.create_selective_checkpoint_contexts is not torch_fn
        name = "trl.models.selective_activation_checkpointing.create_selective_checkpoint_contexts"
        assert handle.verify()[name] == "sac2"
    assert trl_sac.create_selective_checkpoint_contexts is torch_fn
