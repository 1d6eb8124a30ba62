"""The last of a row of settings whose memory fits its budgets, where fitting stops once it stops: the most kept layers,
the least fill level, the largest loss chunk, the most resident blocks. Pure stdlib.

A plan's memory is affine in each of these settings: each kept layer adds its activations (and a device checkpoint
fewer), each fill level moves one more block to disk, a loss chunk adds chunk x V x (c + 12) bytes and the allocator's
slack on them. So the search need not bisect. ``last_fitting`` takes each overrun budget's excess (bytes needed
beyond it; at most 0 where it fits) at the two ends of the row, guesses where the line through them crosses 0, and
checks the guess on both sides: 2 memory estimates past the ends where bisection takes log2(n) (6 for 64 layers).

[Note: guessed boundary]: the guess only chooses which settings to try. Fitting is monotone along the row (what the
bisection this replaces relied on too), so the boundary is the one setting that fits with the next one not fitting,
and every probe moves one end of the bracket towards it whatever the guess was. Where the memory is not quite
affine (a fill level moving the embedding, larger than a layer), the next round guesses again from the narrowed
bracket; after ``GUESS_ROUNDS`` rounds plain bisection finishes, so a row of n takes at most
2 x GUESS_ROUNDS + log2(n) + 2 estimates.
"""
from __future__ import annotations

import bisect
from typing import Callable, Sequence

# Rounds of guess and check before bisection finishes the bracket (``last_fitting``).
GUESS_ROUNDS = 2


def last_fitting(xs: Sequence[int], excess: Callable[[int], Sequence[int]]) -> int | None:
    """The largest x of ``xs`` (ascending) whose ``excess`` (per budget, bytes needed beyond it) is at most 0 for
    every budget, when fitting holds for a first part of ``xs`` and for no x after it; None when ``xs[0]`` does not
    fit. ``excess`` is called on ``xs[-1]`` first, then ``xs[0]``, then inside the bracket
    ([Note: guessed boundary])."""
    hi_excess = tuple(excess(xs[-1]))
    if fits(hi_excess):
        return xs[-1]
    lo_excess = tuple(excess(xs[0]))
    if not fits(lo_excess):
        return None
    lo, hi = 0, len(xs) - 1  # xs[lo] fits, xs[hi] does not
    for _ in range(GUESS_ROUNDS):
        if hi - lo <= 1:
            break
        g = _guess(xs, lo, hi, lo_excess, hi_excess)  # the last one that fits, by the lines
        for i in (g + 1, g):  # the first predicted not to fit, then the last predicted to fit
            if lo < i < hi:
                at = tuple(excess(xs[i]))
                if fits(at):
                    lo, lo_excess = i, at
                else:
                    hi, hi_excess = i, at
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(excess(xs[mid])) else (lo, mid)
    return xs[lo]


def fits(excess: Sequence[int]) -> bool:
    """Whether every budget holds what is needed of it (``excess`` at most 0 in each)."""
    return all(e <= 0 for e in excess)


def fitting(excess: Callable[[object], Sequence[int]]) -> Callable[[object], bool]:
    """Whether a setting fits, from its ``excess``."""
    return lambda x: fits(excess(x))


def _guess(xs: Sequence[int], lo: int, hi: int, lo_excess: Sequence[int], hi_excess: Sequence[int]) -> int:
    """The index of the last x predicted to fit: for each budget that ``xs[hi]`` overruns, the x where the line
    through (xs[lo], its excess) and (xs[hi], its excess) reaches 0; the least of those, as an index in [lo, hi - 1]."""
    x_lo, x_hi = xs[lo], xs[hi]
    crossing = x_hi
    for e_lo, e_hi in zip(lo_excess, hi_excess):
        if e_hi > 0:  # fits at xs[lo] (e_lo <= 0), not at xs[hi]: this budget's need rose between them
            crossing = min(crossing, x_lo + (-e_lo) * (x_hi - x_lo) // (e_hi - e_lo))
    return min(max(bisect.bisect_right(xs, crossing, lo, hi + 1) - 1, lo), hi - 1)
