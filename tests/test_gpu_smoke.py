"""Every GPU benchmark's ``--smoke`` CPU path runs (tiny sizes, flex through its dense path) and writes its table
to JSON, so the code the GPU run takes is exercised on CPU; the GPU runs themselves are benchmarks/gpu_all.sh."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"smoke_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_flex_smoke_runs_every_mode_with_compiled_flex(tmp_path):
    bench = _load("gpu_flex_sac")
    bench.main(["--device", "cpu", "--smoke", "--json", str(tmp_path / "flex.json")])
    rows = json.loads((tmp_path / "flex.json").read_text())["rows"]
    assert [(r["mode"], r["flex_compiled"]) for r in rows] == [(mode, True) for mode in bench.MODES]
    assert {"torchtitan_sac", "sac2_sac"} <= set(bench.MODES)


def test_njt_smoke_runs_every_mode_eager_and_compiled_and_matches_no_ac(tmp_path):
    bench = _load("gpu_njt")
    bench.main(["--smoke", "--json", str(tmp_path / "njt.json")])
    rows = json.loads((tmp_path / "njt.json").read_text())["rows"]
    assert [(r["mode"], r["compiled"]) for r in rows] == [(name, c) for name, _, c in bench.MODES]
    assert [(r["mode"], r["equal"], r["check"]) for r in rows if not r["equal"]] == []
    assert {r["check"] for r in rows if r["compiled"]} == {"allclose"}
    eager = {r["mode"]: r["attn_reruns_per_step"] for r in rows if not r["compiled"]}
    assert eager["no_ac"] == 0


def test_offload_without_a_gpu_says_so(capsys):
    assert _load("gpu_offload").main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_offload_smoke_runs_both_configs_through_the_stand_in(tmp_path):
    bench = _load("gpu_offload")
    assert bench.main(["--smoke", "--json", str(tmp_path / "offload.json")]) == 0
    results = json.loads((tmp_path / "offload.json").read_text())["results"]
    assert [r["config"] for r in results] == ["exposed", "hidden"]
    assert [[row["name"] for row in r["rows"]] for r in results] == [list(bench.ROWS)] * 2
    for r in results:
        assert r["verdicts"]["grads_bitwise_equal_to_save"] and r["verdicts"]["memory_flat_over_steps"]
        copies = r["standin_copies"]
        assert copies["to_host"] > 0 and copies["to_device"] > 0  # offload moved tensors both ways


#: The per-command limit of a lent machine (600 s) less unpacking the bundle (about 15 s) and a margin: ``run.sh``
#: runs gpu_all.sh as one command, and the three calls carrying the bundle's other parts before it (about 2 minutes
#: with the machine's start) keep the whole check inside the 15 minutes of device time a session is lent.
GPU_ALL_LIMIT_S = 570


def test_gpu_all_runs_every_part_with_its_own_limit():
    script = (BENCHMARKS / "gpu_all.sh").read_text()
    parts = [line.split()[1:3] for line in script.splitlines() if line.startswith("run ")]
    assert [name for name, _ in parts] == ["bench", "bench_large", "flex", "njt", "offload", "advise"]
    assert sum(int(limit) for _, limit in parts) < GPU_ALL_LIMIT_S


def test_advise_factory_gives_the_bench_model_advise_can_check_bitwise(tmp_path, monkeypatch):
    from sac2.advisor import cli as advisor_cli

    monkeypatch.syspath_prepend(str(BENCHMARKS.parent))  # the factory is named benchmarks.gpu_advise:tiny
    out = tmp_path / "advice.json"
    assert advisor_cli.main(["--factory", "benchmarks.gpu_advise:tiny", "--steps", "1", "--json", str(out)]) == 0
    advice = json.loads(out.read_text())
    assert [r["name"] for r in advice["rows"] if not r["equal"]] == []
    assert advice["recommended"] is not None
