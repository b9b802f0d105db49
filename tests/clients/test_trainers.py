"""sac2 inside the trainers people use: Hugging Face ``Trainer``, Accelerate, Lightning (``Trainer``, ``Fabric``),
and DeepSpeed's activation checkpointing beside sac2.

Each route trains the tiny random-weight Llama of ``tests.clients`` and is compared with the same run without
checkpointing: the losses and every parameter bitwise equal (``torch.equal``: CPU, one thread, the recompute runs the
same kernels on the same inputs), and ``sac2.forward_count()`` moved by one per checkpointed layer per step, so a
route that silently ran torch's checkpoint (or none) fails. The Python blocks of ``docs/trainers.md`` run last.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.utils.checkpoint as tuc  # noqa: E402

import sac2  # noqa: E402

from . import parameters, tiny_llama, tokens  # noqa: E402
from helpers import python_blocks  # noqa: E402

LAYERS = 2
STEPS = 4  # HF Trainer runs: two saved at step 2, two resumed
ROWS = tokens(batch=4)  # 2 batches of 2 rows: STEPS steps are 2 epochs
# torch's own function, held before any install() in a tuple: install() rebinds module-level names that are it.
TORCH_CREATE_SAC_CONTEXTS = (tuc.create_selective_checkpoint_contexts,)

Result = tuple[list[torch.Tensor], dict[str, torch.Tensor]]


def stock_context_fn() -> Callable[[], Any]:
    """torch's own SAC (its create_selective_checkpoint_contexts, bound at import) with sac2's ``llm()`` policy."""
    return functools.partial(TORCH_CREATE_SAC_CONTEXTS[0], sac2.policies.llm())


def sac2_context_fn() -> Callable[[], Any]:
    return functools.partial(sac2.create_selective_checkpoint_contexts, sac2.policies.llm())


def counted(run: Callable[[], Any]) -> tuple[Any, int]:
    """``run()``'s result and how many checkpointed forwards sac2's forward mode ran meanwhile."""
    before = sac2.forward_count()
    result = run()
    return result, sac2.forward_count() - before


def assert_bitwise(result: Result, reference: Result) -> None:
    """Same losses and same parameters, bit for bit."""
    (losses, params), (ref_losses, ref_params) = result, reference
    assert len(losses) == len(ref_losses) and all(map(torch.equal, losses, ref_losses)), (losses, ref_losses)
    assert params.keys() == ref_params.keys()
    differ = [k for k in params if not torch.equal(params[k], ref_params[k])]
    assert not differ, f"parameters differ from the run without checkpointing: {differ}"


# ---- Hugging Face Trainer ----


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(ROWS)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": ROWS[i], "labels": ROWS[i]}


class _LossTrainer(transformers.Trainer):  # type: ignore[name-defined]  # a module importorskip returned
    """A Trainer that keeps each step's loss tensor (its log history rounds them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[torch.Tensor] = []

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        self.losses.append((loss[0] if return_outputs else loss).detach().clone())
        return loss


def hf_train(output_dir: Path, *, resume: str | None = None, save: bool = False, **kwargs: Any) -> Result:
    """``STEPS`` Trainer steps (AdamW, linear decay) of the tiny Llama; ``kwargs`` go to ``TrainingArguments``."""
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="steps" if save else "no",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **kwargs,
    )
    trainer = _LossTrainer(model=tiny_llama(), args=args, train_dataset=_Rows())
    trainer.train(resume_from_checkpoint=resume)
    return trainer.losses, parameters(trainer.model)


@pytest.fixture(scope="module")
def hf_no_ac(tmp_path_factory: pytest.TempPathFactory) -> Result:
    return hf_train(tmp_path_factory.mktemp("hf_no_ac"))


@pytest.fixture(scope="module")
def hf_sac2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, int, Path]:
    """The Trainer with a sac2 ``context_fn``, saving a checkpoint at step 2: its result, sac2's forwards, its
    output directory."""
    out = tmp_path_factory.mktemp("hf_sac2")
    kwargs = {"use_reentrant": False, "context_fn": sac2_context_fn()}
    result, forwards = counted(
        lambda: hf_train(out, save=True, gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
    )
    return result, forwards, out


def test_hf_trainer_with_sac2_context_fn_trains_bitwise_like_no_checkpointing(hf_sac2, hf_no_ac):
    result, forwards, _ = hf_sac2
    assert forwards == LAYERS * STEPS
    assert_bitwise(result, hf_no_ac)


def test_hf_trainer_resumed_from_its_checkpoint_trains_like_the_uninterrupted_run(hf_sac2):
    (losses, params), _, out = hf_sac2
    kwargs = {"use_reentrant": False, "context_fn": sac2_context_fn()}
    resumed, forwards = counted(
        lambda: hf_train(
            out, resume=str(out / "checkpoint-2"), gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs
        )
    )
    assert forwards == LAYERS * (STEPS - 2)
    assert_bitwise(resumed, (losses[2:], params))


def test_hf_trainer_with_torch_sac_context_fn_under_install_trains_bitwise_like_no_checkpointing(tmp_path, hf_no_ac):
    """A Trainer configured for torch's SAC (torch's create_selective_checkpoint_contexts, bound before install)
    runs sac2's modes under ``sac2.install()``."""
    kwargs = {
        "use_reentrant": False,
        "context_fn": functools.partial(TORCH_CREATE_SAC_CONTEXTS[0], sac2.policies.llm()),
    }
    with sac2.install():
        result, forwards = counted(
            lambda: hf_train(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
        )
    assert forwards == LAYERS * STEPS
    assert_bitwise(result, hf_no_ac)


def test_hf_trainer_with_stock_sac_trains_bitwise_like_no_checkpointing_too(tmp_path, hf_no_ac):
    """Stock SAC works under the Trainer: the same kwargs without ``install()`` run torch's modes, not sac2's."""
    kwargs = {"use_reentrant": False, "context_fn": stock_context_fn()}
    result, forwards = counted(
        lambda: hf_train(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
    )
    assert forwards == 0
    assert_bitwise(result, hf_no_ac)


# ---- Accelerate ----


def accelerate_train(
    model: torch.nn.Module,
    steps: int = 2,
    *,
    load_from: Path | None = None,
    save_to: Path | None = None,
    **forward_kwargs: Any,
) -> Result:
    """``steps`` SGD steps of ``model`` prepared by an ``Accelerator(cpu=True)``, after ``load_state(load_from)``;
    ``save_state(save_to)`` after them."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    if load_from is not None:
        accelerator.load_state(str(load_from))
    model.train()
    ids, losses = tokens(), []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids, **forward_kwargs).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    if save_to is not None:
        accelerator.save_state(str(save_to))
    return losses, parameters(model)


@pytest.fixture(scope="module")
def accelerate_no_ac() -> Result:
    pytest.importorskip("accelerate")
    return accelerate_train(tiny_llama(), steps=4)


def _apply_ac_llama() -> torch.nn.Module:
    model = tiny_llama()
    assert sac2.apply_ac(model, "selective") == ["model.layers.0", "model.layers.1"]
    return model


def test_accelerate_prepared_model_with_apply_ac_trains_bitwise_like_no_checkpointing(accelerate_no_ac):
    result, forwards = counted(lambda: accelerate_train(_apply_ac_llama(), steps=4, use_cache=False))
    assert forwards == LAYERS * 4
    assert_bitwise(result, accelerate_no_ac)


def test_accelerate_model_calling_torch_checkpoint_under_install_trains_bitwise_like_no_checkpointing(
    accelerate_no_ac,
):
    """The model checkpoints with torch's own ``checkpoint`` (transformers' gradient checkpointing); under
    ``sac2.install()`` its frame is sac2's."""
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with sac2.install():
        result, forwards = counted(lambda: accelerate_train(model, steps=4))
    assert forwards == LAYERS * 4
    assert_bitwise(result, accelerate_no_ac)


def test_accelerate_with_stock_sac_trains_bitwise_like_no_checkpointing_too(accelerate_no_ac):
    model = tiny_llama()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": stock_context_fn()}
    )
    result, forwards = counted(lambda: accelerate_train(model, steps=4))
    assert forwards == 0
    assert_bitwise(result, accelerate_no_ac)


def test_accelerate_save_state_load_state_round_trip_resumes_bitwise(tmp_path, accelerate_no_ac):
    """Two steps, ``save_state``; a fresh sac2-checkpointed model and optimizer ``load_state`` it and take the last
    two steps of the uninterrupted run without checkpointing."""
    accelerate_train(_apply_ac_llama(), steps=2, save_to=tmp_path, use_cache=False)
    result, forwards = counted(
        lambda: accelerate_train(_apply_ac_llama(), steps=2, load_from=tmp_path, use_cache=False)
    )
    assert forwards == LAYERS * 2
    losses, params = accelerate_no_ac
    assert_bitwise(result, (losses[2:], params))


# ---- Lightning ----


def lightning_train(checkpointing: bool, stock: bool = False) -> Result:
    """Two steps of ``lightning.Trainer`` on a LightningModule whose ``configure_model`` applies sac2 when
    ``checkpointing`` (torch's checkpoint wrapper with its own SAC when ``stock``)."""
    L = pytest.importorskip("lightning")

    class LitLlama(L.LightningModule):  # type: ignore[name-defined]  # as _LossTrainer
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama()
            self.losses: list[torch.Tensor] = []

        def configure_model(self) -> None:
            if checkpointing and stock:
                _stock_wrap(self.model)
            elif checkpointing:
                sac2.apply_ac(self.model, "selective")

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:  # noqa: ARG002 (Lightning's hook)
            loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = LitLlama()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # ROWS indexes and has a length: a map-style dataset, to which torch's stubs admit only Dataset subclasses
    trainer.fit(module, torch.utils.data.DataLoader(ROWS, batch_size=2))  # type: ignore[arg-type]
    return module.losses, parameters(module.model)


def test_lightning_configure_model_with_apply_ac_trains_bitwise_like_no_checkpointing():
    reference = lightning_train(checkpointing=False)
    result, forwards = counted(lambda: lightning_train(checkpointing=True))
    assert forwards == LAYERS * 2
    assert_bitwise(result, reference)


def test_lightning_with_stock_sac_trains_bitwise_like_no_checkpointing_too():
    reference = lightning_train(checkpointing=False)
    result, forwards = counted(lambda: lightning_train(checkpointing=True, stock=True))
    assert forwards == 0
    assert_bitwise(result, reference)


def _stock_wrap(model: Any) -> None:
    """Each decoder layer in torch's ``checkpoint_wrapper`` with torch's own SAC."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer, context_fn=stock_context_fn())


def fabric_train(checkpointing: bool, stock: bool = False) -> Result:
    """Two SGD steps through ``lightning.fabric.Fabric``, each decoder layer in ``sac2.checkpoint_wrapper`` when
    ``checkpointing`` (torch's ``checkpoint_wrapper`` with its own SAC when ``stock``)."""
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = tiny_llama()
    if checkpointing and stock:
        _stock_wrap(model)
    elif checkpointing:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = sac2.checkpoint_wrapper(layer, context_fn=sac2_context_fn())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    model.train()
    ids, losses = tokens(), []
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, parameters(model)


def test_fabric_with_checkpoint_wrapper_trains_bitwise_like_no_checkpointing():
    reference = fabric_train(checkpointing=False)
    result, forwards = counted(lambda: fabric_train(checkpointing=True))
    assert forwards == LAYERS * 2
    assert_bitwise(result, reference)


def test_fabric_with_stock_sac_trains_bitwise_like_no_checkpointing_too():
    reference = fabric_train(checkpointing=False)
    result, forwards = counted(lambda: fabric_train(checkpointing=True, stock=True))
    assert forwards == 0
    assert_bitwise(result, reference)


# ---- DeepSpeed beside sac2 ----


def _blocks() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)) for _ in range(2)
    )


def _grads(run: Callable[[torch.nn.ModuleList, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of the input and every parameter of two blocks, the blocks run by ``run``."""
    blocks = _blocks()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    run(blocks, x).square().sum().backward()
    return [x.grad, *(p.grad for p in blocks.parameters())]


@pytest.mark.parametrize("ds_checkpoint", ["checkpoint", "non_reentrant_checkpoint"])
def test_deepspeed_checkpoint_beside_sac2_gives_no_checkpointing_gradients(ds_checkpoint):
    """One block under DeepSpeed's checkpoint, the next under ``sac2.checkpoint`` (selective), in one model."""
    deepspeed = pytest.importorskip("deepspeed")
    ds = getattr(deepspeed.checkpointing, ds_checkpoint)
    reference = _grads(lambda blocks, x: blocks[1](blocks[0](x)))
    got, forwards = counted(
        lambda: _grads(lambda blocks, x: sac2.checkpoint(blocks[1], ds(blocks[0], x), context_fn=sac2_context_fn()))
    )
    assert forwards == 1
    assert all(map(torch.equal, got, reference))


@pytest.mark.parametrize("ds_checkpoint", ["checkpoint", "non_reentrant_checkpoint"])
def test_deepspeed_checkpoint_under_install_stays_deepspeeds(ds_checkpoint):
    """DeepSpeed's checkpoints do not call torch's, so ``install()`` leaves them as they are: no sac2 forward runs,
    the gradients are those of no checkpointing."""
    deepspeed = pytest.importorskip("deepspeed")
    ds = getattr(deepspeed.checkpointing, ds_checkpoint)
    reference = _grads(lambda blocks, x: blocks[1](blocks[0](x)))
    with sac2.install():
        got, forwards = counted(lambda: _grads(lambda blocks, x: ds(blocks[1], ds(blocks[0], x))))
    assert forwards == 0
    assert all(map(torch.equal, got, reference))


def _tracker_dropout_grads(run: Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]):
    """Gradients of a block whose dropout draws from DeepSpeed's model-parallel RNG tracker (Megatron's
    ``get_cuda_rng_tracker().fork()``, on CPU here), the block run by ``run``; the tracker and the global seed
    fixed first, the tracker reset after."""
    deepspeed = pytest.importorskip("deepspeed")
    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)

    def block(h: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return torch.nn.functional.dropout(linear(h), 0.5)

    tracker.reset()
    tracker.add("model-parallel-rng", 123)
    try:
        run(block, x).sum().backward()
    finally:
        tracker.reset()
    return [x.grad, linear.weight.grad, linear.bias.grad]


@pytest.mark.parametrize(
    "route",
    [
        "deepspeed",
        pytest.param(
            "sac2",
            marks=pytest.mark.xfail(
                strict=True,
                reason="sac2 limitation: its frame (like torch's) replays only the default CPU and device RNG; "
                "tracker.fork() swaps in the tracker's own state, which the forward advanced, so the recompute "
                "draws another dropout mask and the gradients are silently wrong",
            ),
        ),
    ],
)
def test_dropout_under_deepspeeds_model_parallel_rng_tracker_recomputes_the_same_mask(route):
    deepspeed = pytest.importorskip("deepspeed")
    reference = _tracker_dropout_grads(lambda block, x: block(x))
    if route == "deepspeed":
        got = _tracker_dropout_grads(deepspeed.checkpointing.checkpoint)
    else:
        got = _tracker_dropout_grads(sac2.checkpoint)
    assert all(map(torch.equal, got, reference))


# ---- docs/trainers.md ----


def test_trainers_doc_python_blocks_run():
    for client in ("accelerate", "lightning", "deepspeed"):
        pytest.importorskip(client)
    blocks = python_blocks("docs/trainers.md")
    assert blocks, "docs/trainers.md has no runnable example"
    namespace: dict = {"__name__": "doc:docs/trainers.md"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/trainers.md[block {i}]", "exec"), namespace)


# ---- benchmarks/frame.py's DeepSpeed rows ----


def test_frame_benchmark_runs_deepspeed_rows_with_the_gradients_of_no_checkpointing(capsys):
    """With deepspeed installed, ``benchmarks/frame.py`` times DeepSpeed's two checkpoints beside sac2's frame."""
    pytest.importorskip("deepspeed")
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("frame_benchmark", Path(__file__).parents[2] / "benchmarks/frame.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    module.main(["--smoke", "--config", "cpu-bound"])
    text = capsys.readouterr().out
    for row in ("deepspeed checkpoint", "deepspeed non-reentrant"):
        (line,) = [line for line in text.splitlines() if line.startswith(f"  {row} ")]
        assert line.endswith("  yes"), line
    assert "ratio full AC: sac2 frame / deepspeed reentrant" in text
