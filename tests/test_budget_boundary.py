"""``budget_boundary.last_fitting``: the same setting as a scan of the row for every need that grows with it, in
about two estimates past the ends where the need grows by the same bytes a step."""
from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from megatrain.planner.costs import budget_boundary


def scan(xs: list[int], excess) -> int | None:
    """The reference: the last x that fits, walking the whole row."""
    fitting = [x for x in xs if budget_boundary.fits(excess(x))]
    return fitting[-1] if fitting else None


@st.composite
def rows(draw):
    """An ascending row and, per budget, a need that never falls along it (steps of any size), with a budget."""
    xs = sorted(set(draw(st.lists(st.integers(-300, 300), min_size=1, max_size=70))))
    needs = []
    for _ in range(draw(st.integers(1, 3))):
        steps = draw(st.lists(st.integers(0, 10**6), min_size=len(xs), max_size=len(xs)))
        need = [sum(steps[:i + 1]) for i in range(len(xs))]
        needs.append((dict(zip(xs, need)), draw(st.integers(-10, 10**6 * len(xs)))))
    return xs, needs


@given(rows())
def test_the_same_answer_as_walking_the_row(row) -> None:
    xs, needs = row
    calls = []

    def excess(x: int) -> tuple[int, ...]:
        calls.append(x)
        return tuple(need[x] - budget for need, budget in needs)

    found = budget_boundary.last_fitting(xs, excess)
    probed = set(calls)  # last_fitting's own estimates, before the reference walks the row
    assert found == scan(xs, excess)
    assert len(probed) <= 2 + 2 * budget_boundary.GUESS_ROUNDS + math.ceil(math.log2(len(xs))) + 1


def test_an_affine_need_takes_two_estimates_past_the_ends() -> None:
    """65 settings (a 64-layer model's kept layers), 3 GiB a layer beside 20 GiB of the rest, 80 GiB of memory and a
    host budget that always holds: bisection would take 6 estimates past the two ends."""
    calls = []

    def excess(k: int) -> tuple[int, int]:
        calls.append(k)
        return (20 * 2**30 + 3 * 2**30 * k - 80 * 2**30, -1)

    assert budget_boundary.last_fitting(range(65), excess) == 20
    assert calls[:2] == [64, 0] and len(calls) == 4


def test_nothing_fits_and_everything_fits() -> None:
    assert budget_boundary.last_fitting([1, 2, 3], lambda x: (x,)) is None
    assert budget_boundary.last_fitting([1, 2, 3], lambda x: (x - 3, -x)) == 3
    assert budget_boundary.last_fitting([7], lambda x: (0,)) == 7
