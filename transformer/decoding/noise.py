"""The noise of noised back-translation (Edunov et al. 2018, "Understanding Back-Translation at Scale", §3,
after Lample et al. 2018): each word of a synthetic source is deleted with probability 0.1 or replaced by a
filler token with probability 0.1, and the words are then shuffled locally, no word ending more than three
positions from where it was (`decode.noise=true`, applied to the translations translate.py writes).

A line's noise is a function of (decode.seed, its line number, the n-best rank) alone, like sampling's draws.
"""

from __future__ import annotations

import random

DELETE, REPLACE, MAX_SHIFT = 0.1, 0.1, 3


def noisy(text: str, *, seed: int, line: int, rank: int = 0, filler: str = "<blank>", delete: float = DELETE,
          replace: float = REPLACE, max_shift: int = MAX_SHIFT) -> str:
    """`text` with its words deleted, replaced by `filler` and shuffled as the module docstring says.

    The shuffle sorts the positions i + U(0, max_shift + 1) (Lample et al.): a word moves at most
    `max_shift` places. A line whose every word would be deleted keeps its first word."""
    rng = random.Random(f"{seed}:{line}:{rank}")  # rank: the translation's place in the line's n-best list
    words = text.split()
    kept = []
    for word in words:
        draw = rng.random()
        if draw < delete:
            continue
        kept.append(filler if draw < delete + replace else word)
    if not kept and words:
        kept = [words[0]]
    keys = [i + rng.uniform(0, max_shift + 1) for i in range(len(kept))]
    return " ".join(word for _, word in sorted(zip(keys, kept), key=lambda pair: pair[0]))
