"""``sac2 bench``: a very short run writes the table, the JSON (with the per-op curve) and the plot (its Pareto front
marked); the one-line region rows and ``--compile`` keep the correctness column; under ``--compile`` each row
compiles once; the rows are plain code, built in one place."""

import contextlib
import io
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from expecttest import assert_expected_inline

import sac2
from sac2 import bench
from sac2.__main__ import main as cli_main
from sac2.bench import checkpoint_modes, cli, job
from sac2.bench.models import CONFIGS, REGION_NAMES, Transformer, random_tokens
from sac2.measure import pareto, step
from sac2.regions.in_models import region_name_of


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> tuple[int, str, dict, Path]:
    """A short run of the bench: its (exit code, stdout, JSON, plot path)."""
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = bench.main(["--config", "tiny", "--steps", "2", "--json", str(out / "out.json"),
                           "--plot", str(out / "out.png"), "--curve", "4,8", "--curve-repeat", "1"])
    return code, stdout.getvalue(), json.loads((out / "out.json").read_text()), out / "out.png"


def test_exits_zero(short_run):
    assert short_run[0] == 0


def test_table_has_a_row_per_mode_under_its_header(short_run):
    lines = short_run[1].splitlines()
    assert lines[1].split()[:8] == ["mode", "step", "ms", "vs", "none", "kept", "MiB", "peak"]
    names = [m["name"] for m in short_run[2]["modes"]]
    for name, line in zip(names, lines[2 : 2 + len(names)], strict=True):  # the table's rows; notes follow
        assert line.startswith(name), line


def test_runs_the_four_required_modes_first(short_run):
    names = [m["name"] for m in short_run[2]["modes"]]
    assert names[:4] == ["none", "full", "stock SAC", "sac2 SAC"]


def test_json_describes_the_run(short_run):
    data = short_run[2]
    assert data["config"]["name"] == "tiny"
    assert data["config"]["dim"] == CONFIGS["tiny"].dim
    assert (data["device"], data["steps"], data["torch"]) == ("cpu", 2, torch.__version__)


def test_json_rows_hold_times_memory_and_equality(short_run):
    for row in short_run[2]["modes"]:
        assert len(row["step_s"]) == 2
        assert row["median_s"] == pytest.approx(sum(row["step_s"]) / 2, abs=1e-7)
        assert row["kept_bytes"] > 0
        assert row["peak_bytes"] >= row["kept_bytes"]
        assert isinstance(row["ratio_to_none"], float)


def test_every_mode_matches_no_checkpointing_bit_for_bit(short_run):
    assert {m["name"]: m["equal"] for m in short_run[2]["modes"] if not m["equal"]} == {}


def test_full_checkpointing_keeps_less_than_none(short_run):
    rows = {m["name"]: m for m in short_run[2]["modes"]}
    assert rows["full"]["kept_bytes"] < rows["none"]["kept_bytes"]


def test_writes_the_plot(short_run):
    assert short_run[3].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_line_region_rows_match_bit_for_bit_and_attention_only_keeps_less(short_run):
    rows = {m["name"]: m for m in short_run[2]["modes"]}
    assert (rows["sac2 regions"]["equal"], rows["sac2 regions"]["check"]) == (True, "bitwise")
    assert rows["sac2 regions attn"]["equal"]
    assert rows["sac2 regions attn"]["kept_bytes"] < rows["sac2 regions"]["kept_bytes"]


def test_the_inputs_kept_twin_keeps_what_the_regions_row_rebuilds(short_run):
    rows = {m["name"]: m for m in short_run[2]["modes"]}
    assert rows["sac2 regions, inputs kept"]["equal"]
    assert rows["sac2 regions, inputs kept"]["kept_bytes"] > rows["sac2 regions"]["kept_bytes"]
    assert rows["sac2 regions"]["kept_bytes"] == rows["stock SAC"]["kept_bytes"]


def test_prints_and_writes_the_pareto_front(short_run):
    modes = short_run[2]["modes"]
    front = [modes[i]["name"] for i in pareto.pareto_front([(m["median_s"], m["kept_bytes"]) for m in modes])]
    assert short_run[2]["pareto_front"] == front
    assert f"no other row is faster and keeps less): {', '.join(front)}\n" in short_run[1]


def test_says_how_it_checked_correctness(short_run):
    assert "equal: loss and every gradient vs none, bitwise (torch.equal)" in short_run[1]
    assert short_run[2]["check"] == "bitwise (torch.equal)"


def test_json_holds_the_per_op_curve_of_every_mode(short_run):
    data = short_run[2]["curve"]
    assert data["lengths"] == [4, 8]
    assert list(data["us_per_op"]) == ["none", "full", "stock SAC", "sac2 SAC"]
    for name, us in data["us_per_op"].items():
        assert len(us) == 2, name
        assert all(u > 0 for u in us), name
    assert data["equal"] == {name: [True, True] for name in data["us_per_op"]}


def test_prints_the_curve(short_run):
    assert "per-op cost vs region length" in short_run[1]


def test_a_bfloat16_run_keeps_about_half_the_bytes_and_matches_no_checkpointing_bitwise(short_run):
    """``--dtype bfloat16`` (the GPU check's compute-bound row): the model and its activations in bf16 (the loss in
    float32, and index tensors, keep a few bytes more than half)."""
    results, _ = bench.run("tiny", steps=1, dtype=torch.bfloat16)
    fp32 = {m["name"]: m["kept_bytes"] for m in short_run[2]["modes"]}
    assert [r.name for r in results if not r.equal] == []
    assert all(0.4 < r.kept_bytes / fp32[r.name] < 0.75 for r in results if r.name in ("none", "sac2 SAC"))


def _rows() -> list[bench.Row]:
    return bench.rows()


def test_rows_in_order():
    names = [row.name for row in _rows()]
    expected = ["none", "full", "stock SAC", "sac2 SAC", "sac2 full", "sac2 every_other_matmul",
                "sac2 budget 0.3", "sac2 budget 0.5", "sac2 budget 0.7", "sac2 regions",
                "sac2 regions, inputs kept", "sac2 regions attn"]
    assert names == expected + (["torch_remat"] if checkpoint_modes.remat_available() else [])


def test_region_rows_are_one_line_on_the_unmodified_model():
    rows = {row.name: row for row in _rows()}
    for name, save in (("sac2 regions", ["attention", "linear"]), ("sac2 regions attn", ["attention"])):
        assert rows[name].region is None
        assert rows[name].prepare is not None
        assert rows[name].policy == f'apply_ac(model, "regions", save={save})'
    assert (
        rows["sac2 regions, inputs kept"].policy
        == 'apply_ac(model, "regions", save=[\'attention\', \'linear\'], keep_inputs=True)'
    )
    assert rows["sac2 SAC"].prepare is None


def test_a_one_line_row_checkpoints_its_own_copy_with_regions_and_leaves_the_base_alone():
    torch.manual_seed(0)
    base = Transformer(CONFIGS["tiny"])
    rows = {row.name: row for row in bench.rows()}
    expected = {"sac2 regions": {"qkv", "proj", "gate_up", "down", "attention"}, "sac2 regions attn": {"attention"}}
    for name, names in expected.items():
        model = job._model(base, rows[name])
        assert all(isinstance(block, sac2.CheckpointWrapper) for block in model.blocks)
        assert list(model.state_dict()) == list(base.state_dict())
        regions = {region_name_of(m) for m in model.blocks[0].modules()} - {None}
        assert regions == names
    assert not any(isinstance(block, sac2.CheckpointWrapper) for block in base.blocks)
    assert {region_name_of(m) for m in base.modules()} == {None}


@pytest.mark.skipif(not checkpoint_modes.remat_available(), reason="torch_remat is not installed")
def test_torch_remat_row_stays_annotated_by_hand():
    row = next(row for row in _rows() if row.name == "torch_remat")
    assert row.region is checkpoint_modes.remat_region
    assert row.prepare is None


def test_keeps_the_points_no_other_beats_on_both():
    points = [(10, 90), (30, 10), (12, 60), (20, 60), (40, 5), (35, 20)]
    assert pareto.pareto_front(points) == [0, 1, 2, 4]


def test_equal_points_are_both_on_the_front():
    assert pareto.pareto_front([(1, 1), (1, 1), (2, 2)]) == [0, 1]


def test_default_model_calls_no_region():
    assert all(block.calls is None for block in Transformer(CONFIGS["tiny"]).blocks)


def test_region_wrapped_model_has_the_same_parameters_and_loss():
    cfg = CONFIGS["tiny"]
    seen = []
    torch.manual_seed(0)
    plain = Transformer(cfg)
    def region(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        seen.append(name)
        return fn

    wrapped = Transformer(cfg, region=region)
    wrapped.load_state_dict(plain.state_dict())
    tokens, targets = random_tokens(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert torch.equal(plain(tokens, targets), wrapped(tokens, targets))
    assert seen == list(REGION_NAMES) * cfg.n_layers


def test_every_row_trains_under_compile_as_without_checkpointing():
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):  # aot_eager: the inductor run's graphs, without C++ codegen time
        results, notes = bench.run("tiny", 1, compile=True, backend="aot_eager")
    rows = bench.rows()
    assert [r.name for r in results] == [row.name for row in rows]
    assert {r.name: (r.equal, r.check) for r in results} == {r.name: (True, "allclose") for r in results}
    assert all(len(r.step_s) == 1 and r.kept_bytes > 0 for r in results)


def test_each_row_compiles_its_own_frame_once():
    """Rows share ``Transformer.forward``; compiled as one frame, each row recompiled it and the 9th row on hit
    ``recompile_limit`` (8) and ran uncompiled. Here a second compile of any frame raises."""
    torch._dynamo.reset()
    cfg = CONFIGS["tiny"]
    torch.manual_seed(0)
    base = Transformer(cfg)
    rows = {row.name: row for row in bench.rows()}
    batch = random_tokens(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))
    forwards = [job._forward(job._model(base, rows[name]), rows[name], "aot_eager", i)
                for i, name in enumerate(["none", "full", "sac2 SAC"])]
    # dynamo's attribute on what torch.compile returns: the function it compiles
    assert len({f._torchdynamo_orig_callable.__code__ for f in forwards}) == 3  # type: ignore[attr-defined]
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for forward in forwards * 2:
            forward(*batch).backward()


def test_one_line_region_rows_compile_without_graph_breaks():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = CONFIGS["tiny"]
    torch.manual_seed(0)
    base = Transformer(cfg)
    row = next(row for row in bench.rows() if row.name == "sac2 regions")
    forward = job._forward(job._model(base, row), row, "aot_eager")
    forward(*random_tokens(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))).backward()
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}


def test_title_names_the_backend():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "run", lambda *a, **k: ([bench.Result("none", "-", [1.0])], []))
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            bench.main(["--config", "tiny", "--steps", "1", "--compile", "--curve", ""])
    assert "torch.compile (backend inductor)" in stdout.getvalue().splitlines()[0]
    assert "torch.allclose" in stdout.getvalue()


def test_bench_subcommand_reaches_the_bench_parser():
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), pytest.raises(SystemExit) as exit:
        cli_main(["bench", "--help"])
    assert exit.value.code == 0
    assert "usage: sac2 bench" in stdout.getvalue()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_draws_on_a_terminal():
    err = _Terminal()
    with contextlib.redirect_stderr(err):
        progress = step.Progress(2)
        progress.step()
        progress.step()
    assert_expected_inline(
        err.getvalue().replace("\r", "|"),
        """\
|[###############...............] 1/2|[##############################] 2/2
""",
    )


def test_stays_silent_when_stderr_is_not_a_terminal():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        step.Progress(1).step()
    assert err.getvalue() == ""


def test_a_run_leaves_every_regions_keep_inputs_setting_as_it_found_it():
    from sac2.core.keys import Region
    from sac2.record import region_saves

    region_saves.keep_inputs(["qkv"], True)  # a user's own setting for a name the bench's model uses too
    try:
        bench.run("tiny", 1)
        assert region_saves.keeps_inputs(Region("qkv"))
        assert not region_saves.keeps_inputs(Region("attention"))
    finally:
        region_saves.keep_inputs(["qkv"], False)
