"""Which window each sequence of the run reads: pure integer functions of (seed, epoch, index).

**Without replacement.** Epoch e visits all N windows of a corpus once, in the order of a seeded
bijection of [0, N): a 4-round Feistel network (Luby and Rackoff 1988) on the smallest even-bit
domain 2^(2h) >= N, walked along its cycle until the value falls below N ("cycle walking", Black and
Rogaway 2002). No permutation of N entries is ever built: any window of any epoch is found in O(1)
time and memory (expected < 4 walks, since 2^(2h) < 4N), so 8 ranks over a 10^9-token file hold
nothing but the seed. The round function is SplitMix64 (Steele, Lea and Flood 2014).

**Mixtures by share.** Sequence p of the run goes to source k so that every prefix of the run holds
each source's share to within a sequence or two: the sources are split in halves recursively and at
each node the left half takes sequence q iff floor((q+1)w + c) > floor(qw + c), w the left half's share
of the node (a Beatty sequence; its complement is the right half's). That makes the count of sequences a
source received before p a closed form too, so each source reads its own epochs without replacement.
Shares are exact fractions of the weights given, so no rounding drifts over 10^12 sequences.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from math import floor

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's output function of state ``x`` (Steele, Lea and Flood 2014): a 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive(*parts: int) -> int:
    """A 64-bit key from integers (seed, epoch, source, ...), each mixed in turn."""
    key = 0
    for part in parts:
        key = splitmix64(key ^ (part & _MASK64))
    return key


def permuted(i: int, n: int, key: int) -> int:
    """Element ``i`` of the seeded permutation of [0, n) that ``key`` selects."""
    if not 0 <= i < n:
        raise IndexError(f"{i} outside [0, {n})")
    if n == 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 2^(2 half) >= n
    mask = (1 << half) - 1
    rounds = _round_keys(key)
    x = i
    while True:  # cycle walking: at most a few passes, since the domain is < 4n
        left, right = x >> half, x & mask
        for k in rounds:
            left, right = right, left ^ (splitmix64(right ^ k) & mask)
        x = (left << half) | right
        if x < n:
            return x


@lru_cache(maxsize=64)
def _round_keys(key: int) -> tuple[int, ...]:
    return tuple(derive(key, r) for r in range(4))


def epoch_order(position: int, n: int, seed: int) -> int:
    """The window read at ``position`` of an endless run over ``n`` windows: epoch position // n visits
    every window once, in its own seeded order."""
    epoch, i = divmod(position, n)
    return permuted(i, n, derive(seed, epoch))


class Interleave:
    """Sequence p -> (source k, the source's own sequence number j), by the weights' shares."""

    def __init__(self, weights: list[Fraction], seed: int):
        if not weights or any(w <= 0 for w in weights):
            raise ValueError(f"weights must be positive, got {weights}")
        self.weights = [Fraction(w) / sum(weights) for w in weights]
        self.seed = seed

    def _split(self, lo: int, hi: int) -> tuple[int, Fraction, Fraction]:
        """The node over sources [lo, hi): its middle, the left half's share w and the phase c."""
        mid = (lo + hi) // 2
        w = sum(self.weights[lo:mid]) / sum(self.weights[lo:hi])
        # c = (2m + 1) / (2 den(w)) keeps qw + c off the integers (odd numerator, even denominator), so
        # each sequence goes to exactly one side; m varies the pattern with the seed.
        m = derive(self.seed, lo, hi) % w.denominator
        return mid, w, Fraction(2 * m + 1, 2 * w.denominator)

    def assign(self, p: int) -> tuple[int, int]:
        lo, hi, q = 0, len(self.weights), p
        while hi - lo > 1:
            mid, w, c = self._split(lo, hi)
            before, after = floor(q * w + c) - floor(c), floor((q + 1) * w + c) - floor(c)
            if after > before:
                hi, q = mid, before
            else:
                lo, q = mid, q - before
        return lo, q

    def count(self, k: int, n: int) -> int:
        """Sequences among the first ``n`` that went to source ``k``."""
        lo, hi = 0, len(self.weights)
        while hi - lo > 1:
            mid, w, c = self._split(lo, hi)
            left = floor(n * w + c) - floor(c)
            if k < mid:
                hi, n = mid, left
            else:
                lo, n = mid, n - left
        return n
