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
from expecttest import TestCase

import sac2
from sac2 import bench
from sac2.__main__ import main as cli_main
from sac2.bench import checkpoint_modes, cli, job
from sac2.bench.models import CONFIGS, REGION_NAMES, Transformer, random_tokens
from sac2.measure import pareto, step
from sac2.regions.in_models import region_name_of


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = bench.main(["--config", "tiny", "--steps", "2", "--json", str(out / "out.json"),
                           "--plot", str(out / "out.png"), "--curve", "4,8", "--curve-repeat", "1"])
    return code, stdout.getvalue(), json.loads((out / "out.json").read_text()), out / "out.png"


@pytest.fixture
def _attach(request, short_run):
    request.instance.result = short_run


@pytest.mark.usefixtures("_attach")
class TestShortRun(TestCase):
    result: tuple[int, str, dict, Path]  # short_run's (exit code, stdout, JSON, plot path), set by _attach

    def test_exits_zero(self):
        self.assertEqual(self.result[0], 0)

    def test_table_has_a_row_per_mode_under_its_header(self):
        lines = self.result[1].splitlines()
        self.assertEqual(lines[1].split()[:8], ["mode", "step", "ms", "vs", "none", "kept", "MiB", "peak"])
        names = [m["name"] for m in self.result[2]["modes"]]
        for name, line in zip(names, lines[2 : 2 + len(names)], strict=True):  # the table's rows; notes follow
            self.assertTrue(line.startswith(name), line)

    def test_runs_the_four_required_modes_first(self):
        names = [m["name"] for m in self.result[2]["modes"]]
        self.assertEqual(names[:4], ["none", "full", "stock SAC", "sac2 SAC"])

    def test_json_describes_the_run(self):
        data = self.result[2]
        self.assertEqual(data["config"]["name"], "tiny")
        self.assertEqual(data["config"]["dim"], CONFIGS["tiny"].dim)
        self.assertEqual((data["device"], data["steps"], data["torch"]), ("cpu", 2, torch.__version__))

    def test_json_rows_hold_times_memory_and_equality(self):
        for row in self.result[2]["modes"]:
            self.assertEqual(len(row["step_s"]), 2)
            self.assertAlmostEqual(row["median_s"], sum(row["step_s"]) / 2)
            self.assertGreater(row["kept_bytes"], 0)
            self.assertGreaterEqual(row["peak_bytes"], row["kept_bytes"])
            self.assertIsInstance(row["ratio_to_none"], float)

    def test_every_mode_matches_no_checkpointing_bit_for_bit(self):
        self.assertEqual({m["name"]: m["equal"] for m in self.result[2]["modes"] if not m["equal"]}, {})

    def test_full_checkpointing_keeps_less_than_none(self):
        rows = {m["name"]: m for m in self.result[2]["modes"]}
        self.assertLess(rows["full"]["kept_bytes"], rows["none"]["kept_bytes"])

    def test_writes_the_plot(self):
        self.assertEqual(self.result[3].read_bytes()[:8], b"\x89PNG\r\n\x1a\n")


    def test_one_line_region_rows_match_bit_for_bit_and_attention_only_keeps_less(self):
        rows = {m["name"]: m for m in self.result[2]["modes"]}
        self.assertEqual((rows["sac2 regions"]["equal"], rows["sac2 regions"]["check"]), (True, "bitwise"))
        self.assertTrue(rows["sac2 regions attn"]["equal"])
        self.assertLess(rows["sac2 regions attn"]["kept_bytes"], rows["sac2 regions"]["kept_bytes"])

    def test_the_inputs_kept_twin_keeps_what_the_regions_row_rebuilds(self):
        rows = {m["name"]: m for m in self.result[2]["modes"]}
        self.assertTrue(rows["sac2 regions, inputs kept"]["equal"])
        self.assertGreater(rows["sac2 regions, inputs kept"]["kept_bytes"], rows["sac2 regions"]["kept_bytes"])
        self.assertEqual(rows["sac2 regions"]["kept_bytes"], rows["stock SAC"]["kept_bytes"])

    def test_prints_and_writes_the_pareto_front(self):
        modes = self.result[2]["modes"]
        front = [modes[i]["name"] for i in pareto.pareto_front([(m["median_s"], m["kept_bytes"]) for m in modes])]
        self.assertEqual(self.result[2]["pareto_front"], front)
        self.assertIn(f"no other row is faster and keeps less): {', '.join(front)}\n", self.result[1])

    def test_says_how_it_checked_correctness(self):
        self.assertIn("equal: loss and every gradient vs none, bitwise (torch.equal)", self.result[1])
        self.assertEqual(self.result[2]["check"], "bitwise (torch.equal)")

    def test_json_holds_the_per_op_curve_of_every_mode(self):
        data = self.result[2]["curve"]
        self.assertEqual(data["lengths"], [4, 8])
        self.assertEqual(list(data["us_per_op"]), ["none", "full", "stock SAC", "sac2 SAC"])
        for name, us in data["us_per_op"].items():
            self.assertEqual(len(us), 2, name)
            self.assertTrue(all(u > 0 for u in us), name)
        self.assertEqual(data["equal"], {name: [True, True] for name in data["us_per_op"]})

    def test_prints_the_curve(self):
        self.assertIn("per-op cost vs region length", self.result[1])


def test_a_bfloat16_run_keeps_about_half_the_bytes_and_matches_no_checkpointing_bitwise(short_run):
    """``--dtype bfloat16`` (the GPU check's compute-bound row): the model and its activations in bf16 (the loss in
    float32, and index tensors, keep a few bytes more than half)."""
    results, _ = bench.run("tiny", steps=1, dtype=torch.bfloat16)
    fp32 = {m["name"]: m["kept_bytes"] for m in short_run[2]["modes"]}
    assert [r.name for r in results if not r.equal] == []
    assert all(0.4 < r.kept_bytes / fp32[r.name] < 0.75 for r in results if r.name in ("none", "sac2 SAC"))


class TestRows(TestCase):
    def _rows(self) -> list[bench.Row]:
        return bench.rows()

    def test_rows_in_order(self):
        names = [row.name for row in self._rows()]
        expected = ["none", "full", "stock SAC", "sac2 SAC", "sac2 full", "sac2 every_other_matmul",
                    "sac2 budget 0.3", "sac2 budget 0.5", "sac2 budget 0.7", "sac2 regions",
                    "sac2 regions, inputs kept", "sac2 regions attn"]
        self.assertEqual(names, expected + (["torch_remat"] if checkpoint_modes.remat_available() else []))

    def test_region_rows_are_one_line_on_the_unmodified_model(self):
        rows = {row.name: row for row in self._rows()}
        for name, save in (("sac2 regions", ["attention", "linear"]), ("sac2 regions attn", ["attention"])):
            self.assertIsNone(rows[name].region)
            self.assertIsNotNone(rows[name].prepare)
            self.assertEqual(rows[name].policy, f'apply_ac(model, "regions", save={save})')
        self.assertEqual(rows["sac2 regions, inputs kept"].policy,
                         'apply_ac(model, "regions", save=[\'attention\', \'linear\'], keep_inputs=True)')
        self.assertIsNone(rows["sac2 SAC"].prepare)

    def test_a_one_line_row_checkpoints_its_own_copy_with_regions_and_leaves_the_base_alone(self):
        torch.manual_seed(0)
        base = Transformer(CONFIGS["tiny"])
        rows = {row.name: row for row in bench.rows()}
        expected = {"sac2 regions": {"qkv", "proj", "gate_up", "down", "attention"}, "sac2 regions attn": {"attention"}}
        for name, names in expected.items():
            model = job._model(base, rows[name])
            self.assertTrue(all(isinstance(block, sac2.CheckpointWrapper) for block in model.blocks))
            self.assertEqual(list(model.state_dict()), list(base.state_dict()))
            regions = {region_name_of(m) for m in model.blocks[0].modules()} - {None}
            self.assertEqual(regions, names)
        self.assertFalse(any(isinstance(block, sac2.CheckpointWrapper) for block in base.blocks))
        self.assertEqual({region_name_of(m) for m in base.modules()}, {None})

    @pytest.mark.skipif(not checkpoint_modes.remat_available(), reason="torch_remat is not installed")
    def test_torch_remat_row_stays_annotated_by_hand(self):
        row = next(row for row in self._rows() if row.name == "torch_remat")
        self.assertIs(row.region, checkpoint_modes.remat_region)
        self.assertIsNone(row.prepare)


class TestParetoFront(TestCase):
    def test_keeps_the_points_no_other_beats_on_both(self):
        points = [(10, 90), (30, 10), (12, 60), (20, 60), (40, 5), (35, 20)]
        self.assertEqual(pareto.pareto_front(points), [0, 1, 2, 4])

    def test_equal_points_are_both_on_the_front(self):
        self.assertEqual(pareto.pareto_front([(1, 1), (1, 1), (2, 2)]), [0, 1])


class TestRegionModel(TestCase):
    def test_default_model_calls_no_region(self):
        self.assertTrue(all(block.calls is None for block in Transformer(CONFIGS["tiny"]).blocks))

    def test_region_wrapped_model_has_the_same_parameters_and_loss(self):
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
        self.assertTrue(torch.equal(plain(tokens, targets), wrapped(tokens, targets)))
        self.assertEqual(seen, list(REGION_NAMES) * cfg.n_layers)


class TestCompile(TestCase):
    def test_every_row_trains_under_compile_as_without_checkpointing(self):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):  # aot_eager: the inductor run's graphs, without C++ codegen time
            results, notes = bench.run("tiny", 1, compile=True, backend="aot_eager")
        rows = bench.rows()
        self.assertEqual([r.name for r in results], [row.name for row in rows])
        self.assertEqual({r.name: (r.equal, r.check) for r in results},
                         {r.name: (True, "allclose") for r in results})
        self.assertTrue(all(len(r.step_s) == 1 and r.kept_bytes > 0 for r in results))

    def test_each_row_compiles_its_own_frame_once(self):
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
        self.assertEqual(len({f._torchdynamo_orig_callable.__code__ for f in forwards}), 3)  # type: ignore[attr-defined]
        with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
            for forward in forwards * 2:
                forward(*batch).backward()

    def test_one_line_region_rows_compile_without_graph_breaks(self):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cfg = CONFIGS["tiny"]
        torch.manual_seed(0)
        base = Transformer(cfg)
        row = next(row for row in bench.rows() if row.name == "sac2 regions")
        forward = job._forward(job._model(base, row), row, "aot_eager")
        forward(*random_tokens(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))).backward()
        self.assertEqual(dict(torch._dynamo.utils.counters["graph_break"]), {})

    def test_title_names_the_backend(self):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cli, "run", lambda *a, **k: ([bench.Result("none", "-", [1.0])], []))
            stdout = io.StringIO()
            with contextlib.redirect_stdout(stdout):
                bench.main(["--config", "tiny", "--steps", "1", "--compile", "--curve", ""])
        self.assertIn("torch.compile (backend inductor)", stdout.getvalue().splitlines()[0])
        self.assertIn("torch.allclose", stdout.getvalue())


class TestCommandLine(TestCase):
    def test_bench_subcommand_reaches_the_bench_parser(self):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout), self.assertRaises(SystemExit) as exit:
            cli_main(["bench", "--help"])
        self.assertEqual(exit.exception.code, 0)
        self.assertIn("usage: sac2 bench", stdout.getvalue())


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class TestProgressBar(TestCase):
    def test_draws_on_a_terminal(self):
        err = _Terminal()
        with contextlib.redirect_stderr(err):
            progress = step.Progress(2)
            progress.step()
            progress.step()
        self.assertExpectedInline(
            err.getvalue().replace("\r", "|"),
            """\
|[###############...............] 1/2|[##############################] 2/2
""",
        )

    def test_stays_silent_when_stderr_is_not_a_terminal(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            step.Progress(1).step()
        self.assertEqual(err.getvalue(), "")


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
