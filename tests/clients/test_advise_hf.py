"""``python -m sac2 advise --config tiny-llama|tiny-qwen3-moe``: on real transformers models the recommendation
keeps no more than stock SAC with ``llm()``, is on the Pareto front and fits the target, and its kept bytes are what a
separate measurement of the same setup keeps; config misuse is one line (exit 2)."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import warnings

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from expecttest import assert_expected_inline  # noqa: E402

import sac2  # noqa: E402
from sac2.__main__ import main  # noqa: E402
from sac2.advisor import cli as advisor_cli  # noqa: E402
from sac2.measure.memory import measure_step  # noqa: E402

from helpers import cli_error  # noqa: E402

TARGET = "0.5"


def _model(name: str) -> torch.nn.Module:
    """The model ``--config name`` builds: the same seed, so the same random weights."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(advisor_cli._config(name))


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3-moe"])
def run(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("advise") / "advice.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["advise", "--config", request.param, "--steps", "1", "--seq", "32",
                     "--memory-target", TARGET, "--json", str(path)])
    return request.param, code, out.getvalue(), json.loads(path.read_text())


def _row(data: dict, name: str) -> dict:
    return next(r for r in data["rows"] if r["name"] == name)


def test_exits_zero_and_prints_the_recommendation(run):
    _, code, out, data = run
    assert code == 0
    assert out.splitlines()[-1] == f"    {data['code']}"


def test_every_setup_matches_no_checkpointing_bit_for_bit(run):
    assert [r["name"] for r in run[3]["rows"] if not r["equal"]] == []


def test_recommendation_keeps_no_more_than_stock_sac_is_on_the_front_and_fits(run):
    data = run[3]
    best = _row(data, data["recommended"])
    assert best["kept_bytes"] <= _row(data, "stock SAC llm()")["kept_bytes"]
    assert data["recommended"] in data["pareto_front"]
    assert best["kept_bytes"] <= data["target_bytes"] == int(float(TARGET) * _row(data, "none")["kept_bytes"])


def test_experts_regions_apply_only_to_the_moe_model(run):
    name, _, _, data = run
    names = [r["name"] for r in data["rows"]]
    if name == "tiny-qwen3-moe":
        assert "regions experts" in names and data["skipped"] == {}
    else:
        assert "regions experts" not in names and list(data["skipped"]) == ["regions experts"]


def test_every_code_line_runs_as_printed_and_keeps_what_its_row_kept(run):
    name, _, _, data = run
    model = _model(name)
    inputs = advisor_cli._tokens(model, 2, 32)
    for row in data["rows"]:
        if row["code"] is None or row["name"] == "none":
            continue  # a row another dominates offers no code
        setup = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a budget that runs full AC says so
            exec(row["code"], {"sac2": sac2, "torch": torch, "functools": functools, "model": setup})  # noqa: S102
            memory, _ = measure_step(functools.partial(_loss, setup, inputs), "cpu")
        assert memory.kept == row["kept_bytes"], row["name"]


def _loss(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs).loss


def test_config_file_does_not_exist():
    assert_expected_inline(
        cli_error(["advise", "--config", "/no/such/config.json"]),
        """sac2 advise: error: argument --config: '/no/such/config.json' is neither a config.json file on disk nor a built-in config (tiny-llama, tiny-qwen3, tiny-qwen3-moe, tiny-mixtral)""",  # noqa: E501
    )


def test_config_file_is_not_json(tmp_path):
    with open(f"{tmp_path}/config.json", "w") as f:
        f.write("hidden_size: 64\n")
    assert_expected_inline(
        cli_error(["advise", "--config", f"{tmp_path}/config.json"]).replace(str(tmp_path), "DIR"),
        """sac2 advise: error: argument --config: 'DIR/config.json' is not a Hugging Face model config: not JSON (Expecting value: line 1 column 1 (char 0))""",  # noqa: E501
    )


def test_config_file_has_no_model_type(tmp_path):
    with open(f"{tmp_path}/config.json", "w") as f:
        json.dump({"hidden_size": 64}, f)
    assert_expected_inline(
        cli_error(["advise", "--config", f"{tmp_path}/config.json"]).replace(str(tmp_path), "DIR"),
        """sac2 advise: error: argument --config: 'DIR/config.json' is not a Hugging Face model config: it has no 'model_type'""",  # noqa: E501
    )


def test_config_file_runs(tmp_path):
    model_type, kwargs = advisor_cli.CONFIGS["tiny-llama"]
    with open(f"{tmp_path}/config.json", "w") as f:
        json.dump({"model_type": model_type, **kwargs, "num_hidden_layers": 2}, f)
    config = advisor_cli._config(f"{tmp_path}/config.json")
    assert (config.model_type, config.num_hidden_layers, config.use_cache) == ("llama", 2, False)
