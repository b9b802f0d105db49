"""The texts of ``sac2.advise`` and of ``python -m sac2 advise``'s arguments (``sac2.advisor``,
``sac2.advisor.cli``).
"""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "advise_nothing_fits", "advise_block_never_called", "advise_no_loss", "advise_bad_target", "advise_bad_steps",
    "advise_unknown_candidate", "ADVISE_NO_TRANSFORMERS", "advise_no_such_config", "advise_not_a_model_config",
    "advise_no_causal_lm", "advise_config_not_json", "advise_config_without_model_type", "advise_factory_bad_form",
    "advise_factory_import", "advise_factory_no_function", "advise_factory_bad_return", "advise_bad_memory_target",
    "ADVISE_PLOT_NEEDS_MATPLOTLIB", "advise_no_offload",
]


def advise_nothing_fits(targets: str, least: str, least_kept: str, least_peak: str) -> str:
    return (
        f"recommended: nothing: no setup fits the {targets}; the least is {least} ({least_kept} kept, {least_peak} "
        "peak). Raise the target or try more setups (candidates=[...])."
    )


def advise_no_offload(device: str) -> str:
    return (
        f"no offload rows: offload (sac2.apply_ac(offload=...)) moves tensors from a CUDA device to pinned host "
        f"memory, and on {device} it would move nothing; run advise on a CUDA device to measure them."
    )


def advise_block_never_called(block: str) -> str:
    return f"sac2.advise: block {block!r} did not run when the model was called on example_inputs."


def advise_no_loss(output: object) -> str:
    return (
        f"sac2.advise: cannot make a scalar loss of the model's output ({type(output).__name__}: no .loss and no "
        "tensor in it); pass loss_fn=..."
    )


def advise_bad_target(target: object) -> str:
    return (
        f"sac2.advise: a memory target must be a fraction in [0, 1] of what no checkpointing keeps (or of its peak, "
        f"for peak_target) or bytes (an int above 1), got {target!r}."
    )


def advise_bad_steps(steps: object) -> str:
    return f"sac2.advise: steps must be a positive int, got {steps!r}."


def advise_unknown_candidate(name: str, known: Sequence[str]) -> str:
    return f"sac2.advise: no candidate setup {name!r}; the built-in ones are: {', '.join(known)}."


ADVISE_NO_TRANSFORMERS = "needs transformers (pip install transformers); or use --factory"


def advise_no_such_config(text: str, names: Sequence[str]) -> str:
    return (
        f"{text!r} is neither a config.json file on disk nor a built-in config "
        f"({', '.join(names)})"
    )


def advise_not_a_model_config(text: str, reason: str) -> str:
    return f"{text!r} is not a Hugging Face model config: {reason}"


def advise_config_not_json(text: str, error: Exception) -> str:
    return advise_not_a_model_config(text, f"not JSON ({error})")


def advise_config_without_model_type(text: str) -> str:
    return advise_not_a_model_config(text, "it has no 'model_type'")


def advise_no_causal_lm(model_type: str, reason: str) -> str:
    return f"argument --config: transformers builds no causal LM for model_type {model_type!r}: {reason}"


def advise_factory_bad_form(text: str) -> str:
    return f"must be module:function (e.g. mypkg.models:make), got {text!r}"


def advise_factory_import(module: str, error: Exception) -> str:
    return f"cannot import module {module!r}: {type(error).__name__}: {error}"


def advise_factory_no_function(module: str, name: str) -> str:
    return f"module {module!r} has no callable {name!r}"


def advise_factory_bad_return(text: str, result: object) -> str:
    return (
        f"argument --factory: {text} returned {type(result).__name__}; it must return an nn.Module or "
        "(model, example_inputs)"
    )


def advise_bad_memory_target(text: str) -> str:
    return (
        "must be a fraction in [0, 1] of what no checkpointing keeps (e.g. 0.5) or bytes "
        f"with a unit (e.g. 200MiB, 1.5GiB, 300MB, 4096B), got {text!r}"
    )


ADVISE_PLOT_NEEDS_MATPLOTLIB = "--plot needs matplotlib: pip install 'sac2[plot]'"
