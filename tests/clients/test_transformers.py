"""transformers: a tiny random-weight Llama trained through every route to sac2, bitwise equal to no AC."""

from __future__ import annotations

import functools
from typing import cast

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.utils.checkpoint as tuc  # noqa: E402

import sac2  # noqa: E402
from sac2.integrations import install  # noqa: E402

from . import assert_bitwise_equal, assert_close, hf_loss, tiny_llama, tokens, train  # noqa: E402

LAYERS = 2
# torch's own function, held before any install() in a tuple: install() rebinds module-level names that are it.
TORCH_CREATE_SAC_CONTEXTS = (tuc.create_selective_checkpoint_contexts,)


def sac2_context_fn():
    return functools.partial(sac2.create_selective_checkpoint_contexts, sac2.policies.llm())


@pytest.fixture(scope="module")
def no_ac():
    ids = tokens()
    return train(tiny_llama(), lambda m: hf_loss(m, ids))


def counted(run):
    """``run()``'s result and how many checkpointed forwards sac2's forward mode ran meanwhile."""
    before = sac2.forward_count()
    result = run()
    return result, sac2.forward_count() - before


def test_gradient_checkpointing_kwargs_with_sac2_context_fn_trains_bitwise_like_no_ac(no_ac):
    ids = tokens()
    model = tiny_llama()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": sac2_context_fn()}
    )
    result, forwards = counted(lambda: train(model, lambda m: hf_loss(m, ids)))
    assert forwards == LAYERS * 2
    assert_bitwise_equal(result, no_ac)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_apply_ac_trains_bitwise_like_no_ac(no_ac, mode):
    ids = tokens()
    model = tiny_llama()
    assert sac2.apply_ac(model, mode) == ["model.layers.0", "model.layers.1"]
    # HF does not know the layers are checkpointed: without use_cache=False it fills a DynamicCache in train mode
    # and the recompute updates it a second time.
    assert_bitwise_equal(train(model, lambda m: hf_loss(m, ids, use_cache=False)), no_ac)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_apply_ac_runs_sac2_modes_in_every_checkpointed_forward(mode):
    ids = tokens()
    model = tiny_llama()
    sac2.apply_ac(model, mode)
    _, forwards = counted(lambda: train(model, lambda m: hf_loss(m, ids, use_cache=False)))
    assert forwards == LAYERS * 2


def test_install_makes_torch_sac_code_run_sac2_bitwise_like_no_ac(no_ac):
    """Code written for torch's SAC (its create_selective_checkpoint_contexts, held before install) runs sac2."""
    ids = tokens()
    model = tiny_llama()
    torch_context_fn = functools.partial(TORCH_CREATE_SAC_CONTEXTS[0], sac2.policies.llm())
    with install() as handle:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": torch_context_fn}
        )
        handle.verify()
        result, forwards = counted(lambda: train(model, lambda m: hf_loss(m, ids)))
    assert forwards == LAYERS * 2
    assert_bitwise_equal(result, no_ac)


def test_install_leaves_transformers_import_time_checkpoint_torchs():
    """transformers calls torch's checkpoint function by the name it imported; it stays torch's (torch.compile
    recognises it by identity) and runs sac2's frame underneath."""
    import transformers.modeling_utils as mu

    (torch_checkpoint,) = (tuc.checkpoint,)
    with install():
        assert mu.checkpoint is torch_checkpoint
    assert mu.checkpoint is torch_checkpoint


def test_install_with_default_gradient_checkpointing_recomputes_with_sac2_bitwise_like_no_ac(no_ac):
    """``gradient_checkpointing_enable()`` with HF's default kwargs after install(): each layer is fully recomputed
    by sac2's frame, bitwise like no AC."""
    ids = tokens()
    model = tiny_llama()
    with install():
        model.gradient_checkpointing_enable()
        result, forwards = counted(lambda: train(model, lambda m: hf_loss(m, ids)))
    assert forwards == LAYERS * 2
    assert_bitwise_equal(result, no_ac)


def test_install_with_default_gradient_checkpointing_runs_sac2_modes():
    ids = tokens()
    model = tiny_llama()
    with install():
        model.gradient_checkpointing_enable()
        _, forwards = counted(lambda: train(model, lambda m: hf_loss(m, ids)))
    assert forwards == LAYERS * 2


def test_save_pretrained_round_trip_of_sac2_checkpointed_model_keeps_state_dict(tmp_path):
    reference = tiny_llama().state_dict()
    model = tiny_llama()
    sac2.apply_ac(model, "selective")
    model.save_pretrained(tmp_path)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    state = loaded.state_dict()
    assert list(state) == list(reference)
    assert all(torch.equal(state[k], reference[k]) for k in reference)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_trainer_trains_and_saves_a_checkpoint_with_a_sac2_context_fn(tmp_path):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=0.1,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": sac2_context_fn()},
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=_Rows(tokens(batch=4)))
    _, forwards = counted(trainer.train)
    assert forwards == LAYERS * 2
    saved = tmp_path / "checkpoint-2"
    assert (saved / "model.safetensors").is_file()
    assert (saved / "training_args.bin").is_file()


def _compiled_train(model, **forward_kwargs):
    ids = tokens()
    compiled = cast(torch.nn.Module, torch.compile(model, backend="aot_eager"))  # a Module's is an OptimizedModule
    return train(compiled, lambda m: hf_loss(m, ids, **forward_kwargs))


@pytest.fixture(scope="module")
def compiled_no_ac():
    torch._dynamo.reset()
    return _compiled_train(tiny_llama())


def test_compiled_gradient_checkpointing_kwargs_with_sac2_matches_compiled_no_ac(compiled_no_ac):
    torch._dynamo.reset()
    model = tiny_llama()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": sac2_context_fn()}
    )
    result, forwards = counted(lambda: _compiled_train(model))
    assert forwards > 0
    assert_close(result, compiled_no_ac)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_compiled_apply_ac_matches_compiled_no_ac(compiled_no_ac, mode):
    torch._dynamo.reset()
    model = tiny_llama()
    sac2.apply_ac(model, mode)
    result, forwards = counted(lambda: _compiled_train(model, use_cache=False))
    # compiled full AC is torch's checkpoint operator, with no sac2 mode in it (and not counted: a counter dynamo
    # traced would be guarded on and recompile every step); a selective one runs sac2's modes while it traces
    assert (forwards > 0) == (mode == "selective")
    assert_close(result, compiled_no_ac)
