"""Sums of floor((x_i + K) / m) over terms that move together in a decode clock K: how many
blocks decoders of different phases hold after K more steps, in O(log) per query and
O(min(m, terms)) per integral over a stretch (the paged allocator's block counts, the hybrid
cohort's per-block-size terms, vAttention's pages).

Outside the allocators package so that the hybrid cohort (which the hybrid allocator imports)
can use it without importing the allocators package it is part of.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Final

import numpy as np
from mypy_extensions import mypyc_attr


def times(a: int, b: int) -> int:
    """a * b, signs taken out first. Compiled, a product stays native only when both operands
    are in [0, 2**30): a negative one goes through Python's multiply (an int object made and
    freed, ~10x the cost). The decode cohort's phases (tokens less the clock) and the
    coefficients of requests leaving it are negative as often as not."""
    if a < 0:
        return -times(-a, b)
    if b < 0:
        return -(a * -b)
    return a * b


def _prefix_sums(y: int, bs: int) -> tuple[int, int]:
    """(sum of floor(t/bs), sum of t*floor(t/bs)) for t in [0, y): one division for both, as
    `FloorSum.integrate` calls it once per residue at every decode stretch."""
    q = y // bs  # (not divmod: compiled, // and - stay native, divmod is a Python call)
    m = y - q * bs
    p1 = bs * q * (q - 1) // 2 + m * q
    full = bs * bs * (q - 1) * q * (2 * q - 1) // 6 + bs * (bs - 1) * q * (q - 1) // 4
    return p1, full + q * (m * q * bs + m * (m - 1) // 2)


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class FloorSum:
    """sum_i coef_i * floor((x_i + K)/bs) over registered terms, as a function of the clock K.

    Only the residues in use are kept (sorted, with their summed coefficients and the running
    sums of those), so `value` and `steps_within` cost O(log residues) and `integrate`
    O(residues in use), at most min(bs, terms): a 1,024-token block or a 2 MiB page costs
    about what a 16-token block does. Up to `_LINEAR` residues (16-token blocks: 16 at most)
    one pass over them costs less than a bisect (a Python call) and the running sums (rebuilt
    after every add, as a request joins or leaves the cohort): they are walked instead."""

    def __init__(self, bs: int) -> None:
        self.bs = bs
        self.res: list[int] = []  # residues r of x with a nonzero coefficient, ascending
        self.coef: list[int] = []  # the signed coefficient of each, summed over its terms
        self.q = 0  # sum of coef * floor(x / bs)
        self.per = 0  # sum of coef: what every bs steps add
        self.negative = 0  # residues with a negative coefficient (beams): steps give back
        self._cum: list[int] | None = None  # [0, c0, c0 + c1, ...] until the next add
        self._memo_k = -1  # value(k) for this k (-1: none), kept up to date by `add`
        self._memo = 0
        self._far_k = -1  # `value_far`'s clock (-1: none), likewise kept by `add`
        self._far = 0

    @property
    def nonzero(self) -> int:
        """Residues in use (0: the sum is constant)."""
        return len(self.res)

    def add(self, x: int, coef: int) -> None:
        q, r = x // self.bs, x % self.bs  # (x < 0 is common: see `times`)
        res, coefs = self.res, self.coef
        if len(res) <= _LINEAR:
            i = 0
            while i < len(res) and res[i] < r:
                i += 1
        else:
            i = bisect_left(res, r)
        if i < len(res) and res[i] == r:
            before = coefs[i]
            after = before + coef
            if after:
                coefs[i] = after
            else:
                del res[i], coefs[i]
        else:
            before, after = 0, coef
            res.insert(i, r)
            coefs.insert(i, coef)
        self.negative += (after < 0) - (before < 0)
        self.q += times(coef, q)
        self.per += coef
        self._cum = None
        if self._memo_k >= 0:  # the new term's value at the remembered clock
            self._memo += times(coef, (x + self._memo_k) // self.bs)
        if self._far_k >= 0:
            self._far += times(coef, (x + self._far_k) // self.bs)

    def _sums(self) -> list[int]:
        """Running sums of the coefficients in residue order, from 0."""
        cum = self._cum
        if cum is None:
            total = 0
            cum = [0]
            for c in self.coef:
                total += c
                cum.append(total)
            self._cum = cum
        return cum

    def value(self, k: int) -> int:
        if self._memo_k == k:
            return self._memo
        res = self.res
        if not res:
            return self.q
        q = k // self.bs
        m = k - q * self.bs
        value = self.q + self.per * q
        if m:  # the terms whose x + k crossed one more multiple of bs: r >= bs - m
            lo = self.bs - m
            if len(res) <= _LINEAR:
                coefs, i = self.coef, len(res) - 1
                while i >= 0 and res[i] >= lo:
                    value += coefs[i]
                    i -= 1
            else:
                cum = self._sums()
                value += cum[-1] - cum[bisect_left(res, lo)]
        self._memo_k, self._memo = k, value
        return value

    def value_far(self, k: int) -> int:
        """`value(k)` remembered apart from `value`'s own: a look-ahead asks the sum at the
        end of a stretch between questions about now (one memo for both lost each in turn,
        at every question after a request joined or left)."""
        if self._far_k == k:
            return self._far
        memo_k, memo = self._memo_k, self._memo
        got = self.value(k)
        self._memo_k, self._memo = memo_k, memo
        self._far_k, self._far = k, got
        return got

    def integrate(self, k: int, n: int, w0: float, w1: float, weight: float) -> float:
        """sum over j = 1..n of (w0 + w1*(j-1)) * value(k + j), exactly per residue class,
        summed in ascending residue order (so the float result is the same either way: with
        many residues numpy does the same operations, in the same order)."""
        bs = self.bs
        total = self.q * weight
        # numpy pays when many residues need the prefix sums (those within n steps of a block
        # boundary: about len(res) * min(n, bs) / bs of them; the others add one term each),
        # and its int64 terms stay below 2 (bs + n)**3: exact within this bound.
        many = len(self.res) * min(n, bs) >= _VECTOR_RESIDUES * bs
        if many and 2 * (bs + n) ** 3 < 2**62:
            return self._integrate_vector(total, k, n, w0, w1, weight)
        res, coefs = self.res, self.coef
        for i in range(len(res)):  # (indices: compiled, a zip is a Python call per stretch)
            count, x = coefs[i], res[i] + k + 1
            whole = x // bs
            m0 = x - whole * bs
            # Both prefix sums vanish below bs (m0 < bs): the sums over [m0, m0 + n) are
            # the ones over [0, m0 + n), the second shifted to count j - 1 from m0. (Up to
            # bs, they are 0: a short stretch, the usual one, needs no call.)
            u1, p2 = _prefix_sums(m0 + n, bs) if m0 + n > bs else (0, 0)
            total += count * (whole * weight + w0 * u1 + w1 * (p2 - m0 * u1))
        return total

    def _integrate_vector(
        self, total: float, k: int, n: int, w0: float, w1: float, weight: float
    ) -> float:
        """`integrate`'s loop over numpy arrays: the same integer terms (exact in int64 for
        the sizes it is given), the same float operations in the same order, added one after
        the other by cumsum (sequential, unlike sum's pairwise): the result is bit-identical."""
        bs = self.bs
        whole, m0 = np.divmod(np.array(self.res, dtype=np.int64) + (k + 1), bs)
        q, m = np.divmod(m0 + n, bs)  # _prefix_sums(m0 + n, bs), elementwise
        u1 = bs * q * (q - 1) // 2 + m * q
        full = bs * bs * (q - 1) * q * (2 * q - 1) // 6 + bs * (bs - 1) * q * (q - 1) // 4
        p2 = full + q * (m * q * bs + m * (m - 1) // 2)
        count = np.array(self.coef, dtype=np.int64)
        terms = count * (whole * weight + w0 * u1 + w1 * (p2 - m0 * u1))
        return float(np.cumsum(np.concatenate(([total], terms)))[-1])

    def steps_within(self, k: int, budget: int) -> int | None:
        """Most steps t such that value(k + t') - value(k) <= budget for every t' <= t."""
        if not self.res:
            return None
        if self.negative:
            return self._steps_within_negative(k, budget)
        # Every bs steps add `per`; in the last, partial period step t adds the terms whose
        # x + k + t is a multiple of bs: residues are met downwards from (-(k + 1)) mod bs,
        # wrapping round. The first that takes the running sum past `left` ends the walk.
        bs, res = self.bs, self.res
        periods = budget // self.per
        left = budget - periods * self.per
        start = -(k + periods * bs + 1) % bs
        if len(res) <= _LINEAR:
            return periods * bs + self._walk_down(start, left)
        cum = self._sums()
        i = bisect_right(res, start)  # res[:i] are met first (cum[i] in all), then res[i:]
        # Meeting res[j] (j < i) takes cum[i] - cum[j]; past the wrap, cum[i] + cum[-1] - cum[j].
        over = cum[i] - left
        j = bisect_left(cum, over if over > 0 else over + cum[-1]) - 1
        return periods * bs + (start - res[j]) % bs

    def _walk_down(self, start: int, left: int) -> int:
        """`_steps_within`'s walk, one residue at a time: residues met downwards from `start`
        (wrapping round), their coefficients summed until the sum passes `left` (< per: within
        one period); returns the steps to the residue that passes it."""
        res, coefs = self.res, self.coef
        i = 0
        while i < len(res) and res[i] <= start:
            i += 1
        total, j = 0, i - 1
        while True:
            if j < 0:
                j = len(res) - 1
            total += coefs[j]
            if total > left:
                return (start - res[j]) % self.bs
            j -= 1

    def _steps_within_negative(self, k: int, budget: int) -> int | None:
        """steps_within with negative coefficients: what steps 1..t of a period add (p) is
        not monotone, but it changes only where a residue in use is met, and within a stretch
        of equal p the first step exceeds the budget soonest."""
        bs, res, coef = self.bs, self.res, self.coef
        start = -(k + 1) % bs
        i = bisect_right(res, start)
        order = [*range(i - 1, -1, -1), *range(len(res) - 1, i - 1, -1)]
        p, starts = 0, ([] if res[order[0]] == start else [(1, 0)])
        for j in order:
            p += coef[j]
            starts.append(((start - res[j]) % bs + 1, p))
        best = None
        for t, p in starts:
            if p > budget:
                periods = 0
            elif self.per > 0:
                periods = (budget - p) // self.per + 1
            else:
                continue  # never exceeds at this phase of the period
            steps = periods * bs + t
            if best is None or steps < best:
                best = steps
        return None if best is None else best - 1


#: Residues needing the prefix sums from which `FloorSum.integrate` hands its loop to numpy.
_VECTOR_RESIDUES: Final = 48
#: Residues in use up to which `FloorSum` walks them rather than bisect them (see its docstring).
_LINEAR: Final = 32
