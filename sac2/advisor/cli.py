"""``python -m sac2 advise``: ``sac2.advise`` on a Hugging Face config or on a model from your own factory.

The command line checks every argument before any work starts, so a misuse ends in one line naming what is wrong
(argparse's ``error``, exit code 2): transformers missing for ``--config``, a config file that does not exist or is
not a model config, a factory that cannot be imported or returns something else than a model. Models from
``--config`` get random weights (``from_config``), never a download; the built-in tiny configs are in ``CONFIGS``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from sac2 import messages
from sac2.advisor import advise
from sac2.measure.arguments import device_arg, output_file, positive_int

__all__ = ["CONFIGS", "main", "parse_memory_target"]

#: The built-in tiny configs: name -> (transformers model_type, its keyword arguments). Random weights, no download.
_COMMON: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               use_cache=False)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", dict(_COMMON)),
    "tiny-qwen3": ("qwen3", {**_COMMON, "head_dim": 16}),
    "tiny-qwen3-moe": ("qwen3_moe", {**_COMMON, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 64}),
    "tiny-mixtral": ("mixtral", {**_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2}),
}

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory_target(text: str) -> float | int:
    """``--memory-target``, ``--peak-target``: a number in [0, 1] is a fraction (``0.5``, ``1``), as in Python; bytes
    have a unit (``200MiB``, ``1B``) or are an integer above 1 (``4096``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(messages.advise_bad_memory_target(text))
    number, unit = float(match[1]), match[2].lower()
    if unit:
        if unit not in _UNITS:
            raise argparse.ArgumentTypeError(messages.advise_bad_memory_target(text))
        return int(number * _UNITS[unit])
    if 0.0 <= number <= 1.0:
        return number
    if number > 1.0 and number.is_integer():
        return int(number)
    raise argparse.ArgumentTypeError(messages.advise_bad_memory_target(text))


def _config(text: str) -> Any:
    """``--config``: a built-in name or a ``config.json`` path, made a transformers config (checked now)."""
    if importlib.util.find_spec("transformers") is None:
        raise argparse.ArgumentTypeError(messages.ADVISE_NO_TRANSFORMERS)
    import transformers

    if text in CONFIGS:
        model_type, kwargs = CONFIGS[text]
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise argparse.ArgumentTypeError(messages.advise_no_such_config(text, list(CONFIGS)))
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise argparse.ArgumentTypeError(messages.advise_config_not_json(text, e)) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise argparse.ArgumentTypeError(messages.advise_config_without_model_type(text))
    kwargs = {k: v for k, v in data.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(data["model_type"], **kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise argparse.ArgumentTypeError(messages.advise_not_a_model_config(text, str(e).splitlines()[0])) from None
    config.use_cache = False  # training: no KV cache objects in the blocks' arguments
    return config


def _factory(text: str) -> tuple[str, Callable[[], Any]]:
    """``--factory module:function``: imported and looked up now."""
    module_name, sep, name = text.partition(":")
    if not sep or not module_name or not name:
        raise argparse.ArgumentTypeError(messages.advise_factory_bad_form(text))
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - whatever the import raised is what the user must see
        raise argparse.ArgumentTypeError(messages.advise_factory_import(module_name, e)) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise argparse.ArgumentTypeError(messages.advise_factory_no_function(module_name, name))
    return text, fn


#: What ``--help`` says the command does (plain text: argparse prints it as it is).
DESCRIPTION = ("Measure every checkpointing setup on a Hugging Face config or a model from your own factory, side by "
               "side, and recommend the one to use for your memory.")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sac2 advise", description=DESCRIPTION)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=_config, metavar="NAME_OR_PATH",
                        help=f"a Hugging Face config.json, or one of: {', '.join(CONFIGS)} (random weights)")
    source.add_argument("--factory", type=_factory, metavar="MODULE:FUNCTION",
                        help="a function returning (model, example_inputs), or a model with config.vocab_size")
    parser.add_argument("--batch", type=positive_int, default=2, help="batch size of the random tokens (default 2)")
    parser.add_argument("--seq", type=positive_int, default=64, help="sequence length of the random tokens (64)")
    parser.add_argument("--memory-target", type=parse_memory_target, metavar="FRACTION_OR_BYTES",
                        help="what may be kept for backward: 0.5 (of what no checkpointing keeps), 200MiB (default "
                             "0.5 unless --peak-target is given)")
    parser.add_argument("--peak-target", type=parse_memory_target, metavar="FRACTION_OR_BYTES",
                        help="the most a step may allocate at once: 0.8 (of no checkpointing's peak), 1GiB")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per setup (default 3)")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--json", type=output_file, metavar="FILE", help="also write the advice as JSON")
    parser.add_argument("--plot", type=output_file, metavar="FILE", help="also plot memory against step time")
    return parser


def _tokens(model: nn.Module, batch: int, seq: int) -> dict[str, torch.Tensor]:
    config: Any = model.config
    vocab = int(config.vocab_size)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(messages.ADVISE_PLOT_NEEDS_MATPLOTLIB)
    torch.manual_seed(0)
    if args.config is not None:
        import transformers

        try:
            model = transformers.AutoModelForCausalLM.from_config(args.config)
        except ValueError as e:
            parser.error(messages.advise_no_causal_lm(args.config.model_type, str(e).splitlines()[0]))
        inputs: Any = _tokens(model, args.batch, args.seq)
    else:
        text, fn = args.factory
        made = fn()
        if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
            model, inputs = made
        elif isinstance(made, nn.Module) and isinstance(getattr(getattr(made, "config", None), "vocab_size", None),
                                                        int):
            model, inputs = made, _tokens(made, args.batch, args.seq)
        else:
            parser.error(messages.advise_factory_bad_return(text, made))
    advice = advise(model, inputs, memory_target=args.memory_target, peak_target=args.peak_target, steps=args.steps,
                    device=args.device)
    print(advice)
    if args.json:
        Path(args.json).write_text(advice.to_json())
    if args.plot:
        advice.plot(args.plot)
    return 0
