"""Sample orders that cost O(1) memory: a keyed pseudo-random permutation of ``[0, n)`` evaluated per index.

A torch or numpy permutation of a corpus's samples is an array as long as the corpus, rebuilt every epoch. Here
position ``i`` of epoch ``e`` maps to a sample through a keyed bijection computed on the fly (Black & Rogaway,
"Ciphers with Arbitrary Finite Domains", 2002): a balanced Feistel network on the smallest even number of bits that
holds ``n``, keyed by ``(seed, epoch)``, and cycle-walking (re-encrypting any value that lands at ``n`` or beyond
until it lands inside) to restrict it to ``[0, n)``. A Feistel network is a bijection whatever its round function,
and cycle-walking keeps a bijection a bijection, so every epoch visits every sample exactly once; the domain is at
most ``4n``, so a value takes fewer than 4 encryptions on average. Everything is vectorized over numpy ``uint64``
arrays; nothing depends on the platform (the keys come from numpy's ``SeedSequence``).
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 6
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """The round function: splitmix64's finalizer of ``values ^ key`` (wrapping uint64 arithmetic)."""
    z = values ^ key
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


class KeyedPermutation:
    """A pseudo-random bijection of ``[0, size)`` keyed by ``(seed, epoch)``, evaluated per position.

    Args:
        size: the number of elements (0 is allowed: an empty order).
        seed: the run's seed (any int; negative ones are taken modulo 2**64).
        epoch: the epoch; each ``(seed, epoch)`` gives an unrelated order.
        stream: a further key (a blend's source number), so sources of one run do not share orders.

    Example::

        order = KeyedPermutation(10, seed=0, epoch=3)
        order(np.arange(10))  # the epoch's order: each of 0..9 once
    """

    def __init__(self, size: int, *, seed: int, epoch: int, stream: int = 0) -> None:
        if size < 0:
            raise ValueError(f"size={size} must not be negative")
        if epoch < 0:
            raise ValueError(f"epoch={epoch} must not be negative")
        self.size = int(size)
        bits = max(1, (max(self.size - 1, 1)).bit_length())
        self.half_bits = np.uint64((bits + 1) // 2)
        self.half_mask = np.uint64((1 << int(self.half_bits)) - 1)
        entropy = [int(seed) % (1 << 64), int(epoch), int(stream), self.size]
        self.keys = np.random.SeedSequence(entropy).generate_state(_ROUNDS, dtype=np.uint64)

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        left, right = values >> self.half_bits, values & self.half_mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right, key) & self.half_mask)
        return (left << self.half_bits) | right

    def __call__(self, positions) -> np.ndarray:
        """The elements at ``positions`` (ints in ``[0, size)``) of this order, as ``int64``."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= self.size):
            raise IndexError(f"positions must lie in [0, {self.size})")
        values = self._encrypt(positions.astype(np.uint64))
        outside = values >= np.uint64(self.size)
        while outside.any():  # cycle-walking: the walk from a value inside [0, size) returns inside
            values[outside] = self._encrypt(values[outside])
            outside = values >= np.uint64(self.size)
        return values.astype(np.int64)
