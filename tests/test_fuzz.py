"""The default-suite slice of the differential fuzzer (tests/fuzz): a fixed range of seeds, no failing case.

A case fails when sac2 is silently wrong against the un-checkpointed run (outputs, input gradients, outputs
after backward, generator state), fails with an error that does not name the op, reports a divergence on a
program proven deterministic, leaves a dispatch mode behind, or raises at all where stock SAC or plain
``torch.utils.checkpoint`` is right (unless docs/concepts.md documents that error on purpose and the case earned
it). ``python -m tests.fuzz --cases 10000`` is the long mode; each failure below prints the command that
reproduces it.
"""

from __future__ import annotations

import pytest

from tests.fuzz.oracle import CaseResult, mode_state, run_case
from tests.fuzz.programs import BACKWARDS, KINDS, generate

SEEDS = range(0, 1000)


@pytest.fixture(scope="module")
def results() -> list[CaseResult]:
    return [run_case(generate(seed)) for seed in SEEDS]


def test_no_case_of_the_slice_fails(results: list[CaseResult]) -> None:
    failing = [r for r in results if r.status == "fail"]
    assert not failing, f"{len(failing)} of {len(results)} fuzz cases fail:\n" + "\n".join(
        r.line() + "\n" + r.program.source() for r in failing
    )


def test_most_programs_of_the_slice_are_valid(results: list[CaseResult]) -> None:
    # An invalid program (its un-checkpointed run raises) tests nothing: the generator must avoid them.
    invalid = [r for r in results if r.status == "invalid"]
    assert len(invalid) < len(results) // 10, [r.detail for r in invalid[:10]]


def test_the_slice_covers_every_op_kind(results: list[CaseResult]) -> None:
    seen = {kind for r in results if r.status != "invalid" for kind in r.program.kinds}
    assert set(KINDS) - seen == set()
    assert "njt" in seen


def test_the_slice_offloads_under_every_backward_style(results: list[CaseResult]) -> None:
    # CPU offload answers go through code of their own in sac2 (an ordinary save on CPU tensors): every backward
    # style must meet a policy that answers MUST_CPU_OFFLOAD or PREFER_CPU_OFFLOAD for some of the ops it names.
    def offloads(r: CaseResult) -> bool:
        return r.program.policy.kind == "answers" and any("CPU_OFFLOAD" in a for a in r.program.policy.answers)

    seen = {r.program.backward for r in results if r.status != "invalid" and offloads(r)}
    assert set(BACKWARDS) - {"no_grad"} - seen == set()


def test_list_and_answers_policies_name_ops(results: list[CaseResult]) -> None:
    # Such a policy names ops a probe saw the program run: a probe that sees none (one run under no_grad, where a
    # checkpoint skips its contexts, did) leaves every list policy empty and the fuzzer blind to what they save.
    named = [r for r in results if r.status != "invalid" and r.program.policy.kind in ("list", "answers")]
    assert sum(bool(r.program.policy.ops) for r in named) > 0.8 * len(named)


@pytest.mark.usefixtures("results")  # after the slice ran
def test_no_dispatch_mode_is_left_after_the_slice() -> None:
    assert mode_state() is None


def test_a_seed_gives_the_same_program_every_time() -> None:
    assert [generate(s).source() for s in range(50)] == [generate(s).source() for s in range(50)]
