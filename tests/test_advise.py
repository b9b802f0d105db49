"""``sac2.advise`` and ``python -m sac2 advise``: every setup runs on a copy of the user's model, matches no
checkpointing bit for bit, keeps what a separate measurement of the same setup keeps; the recommendation is the
fastest setup on the Pareto front that fits the memory target; setups that do not apply are skipped with the reason;
every misuse of the command line is one line (exit 2)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import io
import json
import sys
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn

import sac2
from sac2 import advisor
from sac2.__main__ import main
from sac2.advisor import cli as advisor_cli
from sac2.advisor.advice import TIE, ratio, recommend
from sac2.api.wrappers import CheckpointWrapper
from sac2.measure import host_link
from sac2.measure.memory import measure_step
from sac2.measure.step import Progress, Result
from sac2.offload.standin import stand_in

from helpers import cli_error


class Attention(nn.Module):
    """A parameterless attention kernel module (what ``save=["attention"]`` finds outside transformers)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.attention = Attention()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(self.attention(q, k, v).transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def make_model(n: int = 2) -> tuple[Any, tuple[torch.Tensor]]:  # Any: tests read model.layers[0].up, which
    # nn.Module's stubs type as Tensor | Module
    """The factory ``--factory test_advise:make_model`` imports (``n`` blocks)."""
    torch.manual_seed(0)
    return Model(n=n), (torch.randn(2, 16, 32, requires_grad=True),)


def _sum_of(model: nn.Module, inputs: tuple[torch.Tensor]) -> torch.Tensor:
    return model(*inputs).float().sum()


def make_nothing() -> int:
    return 3


@pytest.fixture(scope="module")
def advice() -> sac2.Advice:
    model, inputs = make_model()
    return sac2.advise(model, inputs, steps=1, progress=False)


def test_runs_every_builtin_setup_that_applies_no_checkpointing_first_and_a_budget_for_the_target(advice):
    assert (
        [r.name for r in advice.rows][:-1]
        == ["none", "full AC", "selective llm()", "stock SAC llm()", "regions attention",
            "regions attention+linear+experts", "regions linear"]
    )
    none, full = advice.row("none"), advice.row("full AC")
    fraction = (advice.target_bytes - full.kept_bytes) / (none.kept_bytes - full.kept_bytes)
    assert advice.rows[-1].name == f"budget {int(fraction * 100) / 100:g}"  # solved for the target
    assert advice.rows[-1].kept_bytes <= advice.target_bytes


def test_every_setup_matches_no_checkpointing_bit_for_bit(advice):
    assert [r.name for r in advice.rows if not r.equal] == []


def test_a_setup_that_does_not_apply_is_skipped_with_the_reason(advice):
    assert list(advice.skipped) == ["regions experts"]
    assert_expected_inline(
        advice.skipped["regions experts"],
        """sac2.apply_ac: save=['experts'] matches no module inside the blocks (['layers.0', 'layers.1']...); module names there look like ['norm', 'qkv', 'out', 'attention', 'up', 'down'].""",  # noqa: E501
    )


def test_kept_bytes_equal_a_separate_measurement_of_each_setup(advice):
    model, inputs = make_model()

    def step(m: nn.Module) -> torch.Tensor:
        return m(*inputs).float().sum()

    for candidate in advisor.candidates_for(model, inputs):
        if candidate.name in advice.skipped or candidate.offload:  # no offload rows on the CPU
            continue
        copy_ = copy.deepcopy(model)
        candidate.prepare(copy_)
        memory, _ = measure_step(functools.partial(step, copy_), "cpu")
        assert memory.kept == advice.row(candidate.name).kept_bytes, candidate.name


def test_full_ac_keeps_less_than_no_checkpointing(advice):
    assert advice.row("full AC").kept_bytes < advice.row("none").kept_bytes / 2


def test_default_target_is_half_of_what_no_checkpointing_keeps(advice):
    assert advice.target_bytes == int(0.5 * advice.row("none").kept_bytes)


def test_recommends_the_setup_keeping_least_of_those_tying_with_the_fastest_that_fits(advice):
    best = advice.row(advice.recommended)
    assert best.name in advice.front
    assert best.kept_bytes <= advice.target_bytes
    fitting = [r for r in advice.rows
               if r.kept_bytes <= advice.target_bytes and r.name not in advice.references]
    fastest = min(fitting, key=lambda r: r.median_s)
    tied = [r for r in fitting if r is fastest or ratio(r, fastest) <= 1 + TIE]
    assert advice.ties == [r.name for r in tied]
    assert min(tied, key=lambda r: (r.kept_bytes, r.peak_bytes)).name == best.name


def test_stock_sac_is_a_reference_never_on_the_front(advice):
    assert advice.references == ["stock SAC llm()"]
    assert "stock SAC llm()" not in advice.front


def test_the_front_holds_the_rows_no_other_beats_beyond_a_tie(advice):
    rows = [r for r in advice.rows if r.name not in advice.references]
    for r in rows:
        beaten = any(o.kept_bytes <= r.kept_bytes and o.peak_bytes <= r.peak_bytes and ratio(o, r) < 1 - TIE
                     for o in rows)
        assert (r.name in advice.front) == (not beaten), r.name
        assert (r.name in advice.dominated) == beaten, r.name


def test_every_code_line_runs_as_printed_and_keeps_what_its_row_kept(advice):
    model, inputs = make_model()
    for r in advice.rows:
        if r.name in advice.dominated or r.name == "none":
            continue
        copy_ = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a budget that runs full AC says so
            exec(r.policy, {"sac2": sac2, "torch": torch, "functools": functools, "model": copy_})  # noqa: S102
            memory, _ = measure_step(functools.partial(_sum_of, copy_, inputs), "cpu")
        assert memory.kept == r.kept_bytes, r.name


def test_gives_the_one_line_of_code_of_the_recommendation(advice):
    assert advice.code == advice.row(advice.recommended).policy
    assert advice.row("regions attention").policy == 'sac2.apply_ac(model, mode="regions", save=["attention"])'


def test_prints_the_table_the_front_the_skipped_and_the_recommendation(advice):
    text = str(advice)
    lines = text.splitlines()
    assert lines[1].startswith("setup "), text
    assert len([line for line in lines[2:] if line.split("  ")[0].strip() in
                {r.name for r in advice.rows}]) == len(advice.rows), text
    assert "Pareto front (step time against kept memory; ties within 5%): " + ", ".join(advice.front) in text
    assert "skipped regions experts: " in text
    assert lines[-1] == f"    {advice.code}"
    assert lines[-2].startswith(f"recommended: {advice.recommended} "), text


def test_json_holds_rows_front_and_recommendation(advice):
    data = json.loads(advice.to_json())
    assert [r["name"] for r in data["rows"]] == [r.name for r in advice.rows]
    assert [r["kept_bytes"] for r in data["rows"]] == [r.kept_bytes for r in advice.rows]
    assert (
        (data["pareto_front"], data["recommended"], data["code"])
        == (advice.front, advice.recommended, advice.code)
    )


def test_without_an_accelerator_there_are_no_offload_rows_and_one_note_says_why(advice):
    assert [r.name for r in advice.rows if r.name.startswith("offload")] == []
    assert advice.host_link is None
    assert_expected_inline("\n".join(n for n in advice.notes if "offload" in n), """\
no offload rows: offload (sac2.apply_ac(offload=...)) moves tensors from a CUDA device to pinned host memory, and on cpu it would move nothing; run advise on a CUDA device to measure them.""")  # noqa: E501


def test_plot_writes_a_png(advice):
    pytest.importorskip("matplotlib")
    path = f"{tempfile.mkdtemp()}/advice.png"
    advice.plot(path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


#: The offload rows, and the row each keeps the same tensors of, on the device.
OFFLOAD_TWINS = {"offload inputs": "full AC", "offload inputs+attention": "regions attention"}
#: What the offload rows move on ``make_model(3)``: the middle block's input (the first block's is the caller's
#: leaf, the last block keeps its own), and the first two blocks' attention output and logsumexp (float32).
INPUT_BYTES, ATTENTION_BYTES = 2 * 16 * 32 * 4, 2 * (2 * 4 * 16 * 8 + 2 * 4 * 16) * 4


@pytest.fixture(scope="module")
def on_a_device() -> tuple[sac2.Advice, list[tuple[str, object]]]:
    """``sac2.advise`` through the CPU stand-in for a device, on three blocks, the offload rows beside their twins;
    and the stand-in's log of what was copied."""
    model, inputs = make_model(3)
    with stand_in() as link:
        advice = sac2.advise(model, inputs, steps=1, progress=False, candidates=[*OFFLOAD_TWINS.values(),
                                                                                 *OFFLOAD_TWINS])
    return advice, link.log


@pytest.fixture
def device_advice(on_a_device) -> sac2.Advice:
    return on_a_device[0]


@pytest.fixture
def copy_log(on_a_device) -> list[tuple[str, object]]:
    return on_a_device[1]


def test_on_a_device_the_offload_rows_run_with_their_lines_of_code(device_advice):
    assert {r.name: r.policy for r in device_advice.rows if r.name in OFFLOAD_TWINS} == {
        "offload inputs": 'sac2.apply_ac(model, mode="full", offload=["inputs"])',
        "offload inputs+attention": 'sac2.apply_ac(model, mode="full", offload=["inputs", "attention"])',
    }


def test_an_offload_row_keeps_in_host_memory_what_it_moved_and_on_the_device_what_its_twin_keeps_less_that(
    device_advice,
):
    moved = {"offload inputs": INPUT_BYTES, "offload inputs+attention": INPUT_BYTES + ATTENTION_BYTES}
    for name, twin in OFFLOAD_TWINS.items():
        row = device_advice.row(name)
        assert row.host_bytes == moved[name], name
        assert row.kept_bytes == device_advice.row(twin).kept_bytes - row.host_bytes, name


def test_offload_rows_match_no_checkpointing_bit_for_bit(device_advice):
    assert [r.name for r in device_advice.rows if not r.equal] == []


def test_every_offload_line_of_code_runs_as_printed_and_keeps_what_its_row_kept(device_advice):
    model, inputs = make_model(3)
    for name in OFFLOAD_TWINS:
        row, copy_ = device_advice.row(name), copy.deepcopy(model)
        with stand_in():
            exec(row.policy, {"sac2": sac2, "model": copy_})  # noqa: S102
            memory, _ = measure_step(functools.partial(_sum_of, copy_, inputs), "cpu")
        assert (memory.kept, memory.host) == (row.kept_bytes, row.host_bytes), name


def test_the_host_link_is_timed_copying_a_pinned_buffer_each_way_on_offloads_streams(device_advice, copy_log):
    n, label = host_link.NBYTES, f"uint8[{host_link.NBYTES}]"
    assert ("host_alloc", n) in copy_log
    for way in ("to_host", "to_device"):
        assert copy_log.count((way, label)) == host_link.REPEATS, way
    link = device_advice.host_link
    assert link is not None
    assert (link.link, link.nbytes) == ("the CPU stand-in for a device, sac2.offload.standin", n)
    assert min(link.to_host, link.to_device) > 0


def test_the_table_gives_each_rows_host_bytes_and_the_report_the_bandwidth(device_advice):
    lines = str(device_advice).splitlines()
    header = lines[1].split()
    assert header[header.index("peak") + 2: header.index("peak") + 4] == ["host", "KiB"]
    for r in device_advice.rows:
        cells = next(line for line in lines if line.startswith(r.name + "  ")).split()
        assert cells[len(r.name.split()) + 5] == f"{r.host_bytes / 1024:.1f}", r.name
    link = device_advice.host_link
    assert link is not None
    assert (
        f"host link (the CPU stand-in for a device, sac2.offload.standin): {link.to_host / 1e9:.2f} GB/s to the "
        f"host, {link.to_device / 1e9:.2f} GB/s back (the median of 5 timed copies of a 64.00 MiB pinned buffer "
        "each way, on offload's own streams)"
        in lines
    )


def test_json_gives_each_rows_host_bytes_and_the_host_link(device_advice):
    data = json.loads(device_advice.to_json())
    assert [r["host_bytes"] for r in data["rows"]] == [r.host_bytes for r in device_advice.rows]
    assert data["host_link"] == dataclasses.asdict(device_advice.host_link)


def test_leaves_the_users_model_untouched():
    model, inputs = make_model()
    before = copy.deepcopy(model.state_dict())
    sac2.advise(model, inputs, steps=1, progress=False, candidates=["full AC"])
    assert not any(isinstance(m, CheckpointWrapper) for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_candidates_by_name_run_after_no_checkpointing():
    model, inputs = make_model()
    advice = sac2.advise(model, inputs, steps=1, progress=False, candidates=["regions attention", "full AC"])
    assert [r.name for r in advice.rows] == ["none", "regions attention", "full AC"]


def test_a_target_in_bytes_that_nothing_fits_recommends_nothing_and_says_so():
    model, inputs = make_model()
    advice = sac2.advise(model, inputs, steps=1, progress=False, candidates=["full AC"], memory_target=0)
    assert advice.recommended is None
    least = advice.row("full AC").kept_bytes
    peak = advice.row("full AC").peak_bytes
    assert (
        str(advice).splitlines()[-1]
        == "recommended: nothing: no setup fits the memory target: at most 0.0 KiB kept for backward; the least is "
           f"full AC ({least / 1024:.1f} KiB kept, {peak / 1024:.1f} KiB peak). Raise the target or try more setups "
           "(candidates=[...])."
    )


def test_the_loss_fn_gives_the_loss():
    model, inputs = make_model()
    calls = []

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        calls.append(out.shape)
        return out.pow(2).mean()

    sac2.advise(model, inputs, steps=1, progress=False, candidates=["full AC"], loss_fn=loss_fn)
    assert calls == [torch.Size([2, 16, 32])] * 4  # 2 setups x (memory step + 1 timed step)


def test_a_setup_that_changes_the_gradients_is_flagged_and_never_recommended():
    model, inputs = make_model()

    def corrupt(m: Any) -> None:  # Any: as make_model's
        with torch.no_grad():
            m.layers[0].up.weight.mul_(2)

    wrong = advisor.Candidate("wrong", "# doubles a weight", corrupt)
    advice = sac2.advise(model, inputs, steps=1, progress=False, candidates=[wrong], memory_target=10**9)
    assert [r.equal for r in advice.rows] == [True, False]
    assert (advice.recommended, advice.front) == ("none", ["none"])


def test_the_default_loss_sums_the_first_tensor_of_a_tuple_output():
    class Pair(Model):
        def forward(self, x: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]  # on purpose
            return None, super().forward(x)

    _, inputs = make_model()
    torch.manual_seed(0)
    advice = sac2.advise(Pair(), inputs, steps=1, progress=False, candidates=["full AC"])
    torch.manual_seed(0)
    model = Model()
    plain, _ = measure_step(lambda: model(*inputs).float().sum(), "cpu")
    assert advice.row("none").kept_bytes == plain.kept


def test_an_output_without_a_tensor_needs_a_loss_fn():
    class Nothing(Model):
        def forward(self, _x: torch.Tensor) -> str:  # type: ignore[override]  # no tensor out, on purpose
            return "no tensor"

    with pytest.raises(TypeError) as e:
        sac2.advise(Nothing(), (torch.randn(1, 2, 32),), steps=1, progress=False, candidates=["full AC"])
    assert_expected_inline(
        str(e.value),
        """sac2.advise: cannot make a scalar loss of the model's output (str: no .loss and no tensor in it); pass loss_fn=...""",  # noqa: E501
    )


def test_unknown_candidate():
    model, inputs = make_model()
    with pytest.raises(ValueError) as e:
        sac2.advise(model, inputs, steps=1, candidates=["regions everything"])
    assert_expected_inline(
        str(e.value),
        """sac2.advise: no candidate setup 'regions everything'; the built-in ones are: none, full AC, selective llm(), stock SAC llm(), regions attention, regions attention+linear+experts, regions linear, regions experts, offload inputs, offload inputs+attention, budget.""",  # noqa: E501
    )


def test_options_bad_memory_target():
    model, inputs = make_model()
    with pytest.raises(ValueError) as e:
        sac2.advise(model, inputs, steps=1, candidates=["full AC"], memory_target=1.5, progress=False)
    assert_expected_inline(
        str(e.value),
        """sac2.advise: a memory target must be a fraction in [0, 1] of what no checkpointing keeps (or of its peak, for peak_target) or bytes (an int above 1), got 1.5.""",  # noqa: E501
    )


def test_memory_target_one_is_all_of_what_no_checkpointing_keeps():
    model, inputs = make_model()
    advice = sac2.advise(model, inputs, steps=1, progress=False, candidates=["full AC"], memory_target=1)
    assert advice.target_bytes == advice.row("none").kept_bytes


def test_a_peak_target_recommends_a_row_whose_measured_peak_fits():
    model, inputs = make_model()
    probe = sac2.advise(model, inputs, steps=1, progress=False, candidates=["full AC"], memory_target=1)
    target = (probe.row("none").peak_bytes + probe.row("full AC").peak_bytes) // 2
    advice = sac2.advise(model, inputs, steps=1, progress=False, peak_target=target,
                         candidates=["full AC", "regions attention", "budget"])
    assert advice.target_bytes is None  # a peak target alone: no default target on kept bytes
    assert advice.row(advice.recommended).peak_bytes <= target
    assert all(advice.fits(r) == (r.peak_bytes <= target) for r in advice.rows)


def test_the_stock_reference_is_code_that_runs_torchs_own_checkpoint():
    model, inputs = make_model()
    before = sac2.forward_count()
    exec(advisor.candidates.STOCK_CODE, {"sac2": sac2, "torch": torch, "functools": functools,  # noqa: S102
                                         "model": model})
    model(*inputs).sum().backward()
    assert all(isinstance(b, CheckpointWrapper) for b in model.layers)
    assert sac2.forward_count() == before  # torch's frame and modes ran, not sac2's


def test_block_memory_budget_profiles_the_first_block_with_its_inputs():
    model, inputs = make_model()
    budget = advisor.block_memory_budget(model, inputs, 0.5)
    x = model.layers[0].norm.weight.new_empty(2, 16, 32).normal_().requires_grad_()
    direct = sac2.policies.memory_budget(model.layers[0], (x,), 0.5, cost="flops")
    assert budget.kept_bytes == direct.kept_bytes


def _row(name: str, kept: int, times: list[float], peak: int = 0, host: int = 0) -> Result:
    return Result(name, f"# {name}", step_s=times, kept_bytes=kept, peak_bytes=peak or kept, host_bytes=host)


# ``recommend`` on measured rows (made up here: the figures are the input, not what is tested).


def test_among_ties_the_row_keeping_least_is_recommended():
    rows = [_row("none", 100, [1.0, 1.0]), _row("a", 50, [2.0, 2.0]), _row("b", 30, [2.06, 2.08]),
            _row("c", 40, [1.98, 1.99])]
    advice = recommend(rows, [False] * 4, {}, 60, "cpu", 2)
    assert (advice.ties, advice.recommended) == (["a", "b", "c"], "b")


def test_a_row_faster_beyond_a_tie_is_recommended_over_one_keeping_less():
    rows = [_row("none", 100, [1.0]), _row("a", 50, [2.0]), _row("b", 30, [2.2])]
    assert recommend(rows, [False] * 3, {}, 60, "cpu", 1).recommended == "a"


def test_a_dominated_row_is_marked_and_shows_no_code():
    rows = [_row("none", 100, [1.0]), _row("a", 50, [2.0]), _row("b", 60, [2.5])]
    advice = recommend(rows, [False] * 3, {}, 60, "cpu", 1)
    assert advice.dominated == {"b": "a"}
    assert advice.front == ["none", "a"]
    assert "(dominated by a)" in advice.table().splitlines()[-1]
    assert json.loads(advice.to_json())["rows"][2]["code"] is None


def test_a_row_keeping_less_on_the_device_by_keeping_bytes_in_host_memory_fits_a_device_target():
    rows = [_row("none", 100, [1.0]), _row("full", 50, [2.0]), _row("offload", 30, [2.0], host=20)]
    advice = recommend(rows, [False] * 3, {}, 40, "cuda", 1)
    assert (advice.fits(rows[2]), advice.recommended) == (True, "offload")


def test_a_faster_row_keeping_more_in_host_memory_dominates_no_row():
    rows = [_row("none", 100, [1.0]), _row("full", 50, [2.0]), _row("offload", 50, [1.5], host=20)]
    advice = recommend(rows, [False] * 3, {}, 60, "cuda", 1)
    assert (advice.dominated, advice.front) == ({}, ["none", "full", "offload"])


def test_of_tied_rows_keeping_as_much_on_the_device_the_one_keeping_least_in_host_memory_is_recommended():
    rows = [_row("none", 100, [1.0]), _row("more", 30, [2.0], host=40), _row("less", 30, [2.0], host=20)]
    assert recommend(rows, [False] * 3, {}, 60, "cuda", 1).recommended == "less"


def test_the_recommended_row_is_never_dominated():
    # medians of ratios are not transitive: "c" ties the fastest, keeps least, yet "d" beats it beyond a tie
    rows = [_row("none", 100, [1.0, 1.0, 1.0]), _row("f", 50, [1.0, 1.0, 1.0]),
            _row("c", 30, [1.04, 1.04, 1.04]), _row("d", 30, [0.95, 0.99, 0.98], peak=29)]
    advice = recommend(rows, [False] * 4, {}, 60, "cpu", 3)
    assert advice.recommended not in advice.dominated


def test_factory_runs_prints_and_writes_json():
    path = f"{tempfile.mkdtemp()}/advice.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["advise", "--factory", "test_advise:make_model", "--steps", "1", "--memory-target", "0.3",
                     "--json", path])
    assert code == 0
    with open(path) as f:
        data = json.load(f)
    assert data["target_bytes"] == int(0.3 * data["rows"][0]["kept_bytes"])
    assert f"recommended: {data['recommended']} " in out.getvalue()


def test_needs_a_model():
    assert_expected_inline(
        cli_error(["advise"]), """sac2 advise: error: one of the arguments --config --factory is required"""
    )


@pytest.mark.skipif("transformers" in sys.modules or importlib.util.find_spec("transformers")
                    is not None, reason="transformers is installed")
def test_config_without_transformers():
    assert_expected_inline(
        cli_error(["advise", "--config", "tiny-llama"]),
        """sac2 advise: error: argument --config: needs transformers (pip install transformers); or use --factory""",
    )


def test_factory_not_module_colon_function():
    assert_expected_inline(
        cli_error(["advise", "--factory", "test_advise.make_model"]),
        """sac2 advise: error: argument --factory: must be module:function (e.g. mypkg.models:make), got 'test_advise.make_model'""",  # noqa: E501
    )


def test_factory_module_cannot_be_imported():
    assert_expected_inline(
        cli_error(["advise", "--factory", "no_such_module_xyz:make"]),
        """sac2 advise: error: argument --factory: cannot import module 'no_such_module_xyz': ModuleNotFoundError: No module named 'no_such_module_xyz'""",  # noqa: E501
    )


def test_factory_has_no_such_function():
    assert_expected_inline(
        cli_error(["advise", "--factory", "test_advise:make_everything"]),
        """sac2 advise: error: argument --factory: module 'test_advise' has no callable 'make_everything'""",
    )


def test_factory_returns_no_model():
    assert_expected_inline(
        cli_error(["advise", "--factory", "test_advise:make_nothing"]),
        """sac2 advise: error: argument --factory: test_advise:make_nothing returned int; it must return an nn.Module or (model, example_inputs)""",  # noqa: E501
    )


def test_command_line_bad_memory_target():
    assert_expected_inline(
        cli_error(["advise", "--factory", "test_advise:make_model", "--memory-target", "lots"]),
        """sac2 advise: error: argument --memory-target: must be a fraction in [0, 1] of what no checkpointing keeps (e.g. 0.5) or bytes with a unit (e.g. 200MiB, 1.5GiB, 300MB, 4096B), got 'lots'""",  # noqa: E501
    )


def test_memory_target_forms():
    parse = advisor_cli.parse_memory_target
    assert [parse("0.5"), parse("1"), parse("0"), parse("1B"), parse("200MiB"), parse("1.5GiB"),
            parse("300MB"), parse("4096")] == [0.5, 1.0, 0.0, 1, 200 * 2**20, int(1.5 * 2**30), 300 * 10**6, 4096]


def test_memory_target_one_means_what_it_means_in_python():
    path = f"{tempfile.mkdtemp()}/advice.json"
    with contextlib.redirect_stdout(io.StringIO()):
        main(["advise", "--factory", "test_advise:make_model", "--steps", "1", "--memory-target", "1",
              "--json", path])
    with open(path) as f:
        data = json.load(f)
    assert data["target_bytes"] == data["rows"][0]["kept_bytes"]


def test_help_is_plain_text():
    for command in ("advise", "bench"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            main([command, "--help"])
        assert "``" not in out.getvalue(), command


def test_progress_shows_off_a_terminal_too():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        bar = Progress(3, "sac2 advise")
        bar.EVERY = 0.0
        for _ in range(3):
            bar.step()
    assert err.getvalue().splitlines() == [f"sac2 advise: {i}/3 steps" for i in (1, 2, 3)]

