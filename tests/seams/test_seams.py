"""Each selected cell of the seam matrix (``matrix.selected()``), and the properties of the design itself.

Ids name the cell: ``route-execution-policy-backward-around-offload``. Known sac2 bugs are ``xfail(strict=True)``
cells, so the suite stays green until they are fixed and turns red when one is (``matrix.BUGS``).
"""

from __future__ import annotations

import itertools
import math

import pytest

from . import harness, matrix

CELLS = matrix.selected()


def _param(cell: matrix.Cell) -> object:
    bug = matrix.bug_of(cell)
    marks = [pytest.mark.xfail(strict=True, reason=f"sac2 bug: {bug}")] if bug else []
    return pytest.param(cell, id=cell.id, marks=marks)


@pytest.fixture(scope="module", autouse=True)
def _close_last_setup():
    yield
    harness.close()


@pytest.mark.parametrize("cell", [_param(c) for c in CELLS])
def test_cell(cell: matrix.Cell) -> None:
    harness.run_cell(cell)


@pytest.mark.parametrize("select", [matrix.pairwise, matrix.trimmed], ids=["pairwise", "ci"])
def test_the_selection_covers_every_pair_some_valid_cell_has(select) -> None:
    valid = matrix.valid_cells()
    needed = set().union(*(matrix.pairs_of(c) for c in valid))
    covered = set().union(*(matrix.pairs_of(c) for c in select(valid)))
    assert needed - covered == set()


def test_the_pairwise_set_is_deterministic_and_made_of_valid_cells() -> None:
    valid = matrix.valid_cells()
    chosen = matrix.pairwise(valid)
    assert chosen == matrix.pairwise(list(valid)) and set(chosen) <= set(valid)
    assert len(set(chosen)) == len(chosen)


def test_every_value_of_every_dimension_has_a_valid_cell() -> None:
    valid = matrix.valid_cells()
    for dimension, values in matrix.DIMENSIONS.items():
        assert {c.value(dimension) for c in valid} == set(values), dimension


def test_every_rule_and_bug_applies_to_some_valid_cell() -> None:
    """No dead rule: each exclusion removes some cell of the product, each other rule holds for some valid cell."""
    product, valid = matrix.product(), matrix.valid_cells()
    for rule in matrix.RULES:
        assert any(rule.when(c) for c in (product if rule.kind == "exclude" else valid)), rule.text
    for when, reason in matrix.BUGS:
        assert any(when(c) for c in valid), reason


def test_ids_name_each_cell_once() -> None:
    ids = [c.id for c in matrix.product()]
    assert len(set(ids)) == len(ids)
    assert all(len(i.split("-")) == len(matrix.DIMENSIONS) for i in ids)


def test_the_full_product_and_valid_cells_are_counted_from_the_dimensions() -> None:
    sizes = [len(v) for v in matrix.DIMENSIONS.values()]
    assert len(matrix.product()) == math.prod(sizes)
    assert len(list(itertools.chain(matrix.valid_cells()))) < len(matrix.product())
