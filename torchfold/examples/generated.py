"""SST-format trees generated with labels that follow a simple, learnable rule, for when the real data is not at hand."""

from __future__ import annotations

import random

from torchfold._validate import check_int
from torchfold.examples.sst import NUM_FINE_LABELS, Tree

__all__ = ["generate_sst", "generate_sst_lines"]


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Word -> sentiment score in -2..2 (label = score + 2). Modifiers score 0 on their own and act
# on the phrase to their right: a negator turns it mildly to the opposite sign, an intensifier
# doubles it. Otherwise a node's score is the sum of its children's, clipped to -2..2.
_NEUTRAL_WORDS = _words(
    """the a an this that it its his her their film movie story plot script director actors actor cast
    characters ending music score scenes dialogue camera audience screen picture drama comedy thriller
    is was seems feels looks becomes remains and but of with to in on for by as about from than year
    time hour minutes world life love family city night people , . 's"""
)
_POLAR_WORDS = {
    **dict.fromkeys(
        _words(
            """good funny charming clever fine pleasant solid warm likable engaging smart sweet fresh
            enjoyable touching honest lively entertaining"""
        ),
        1,
    ),
    **dict.fromkeys(
        _words("brilliant wonderful masterful superb moving great beautiful terrific stunning"), 2
    ),
    **dict.fromkeys(
        _words("dull bad slow flat silly weak bland tedious predictable thin messy forgettable clumsy"), -1
    ),
    **dict.fromkeys(_words("awful terrible dreadful unwatchable painful worst boring pointless"), -2),
}
_POSITIVE_WORDS = tuple(w for w, s in _POLAR_WORDS.items() if s > 0)
_NEGATIVE_WORDS = tuple(w for w, s in _POLAR_WORDS.items() if s < 0)
_NEGATORS = ("not", "never", "hardly", "n't")
_INTENSIFIERS = ("very", "really", "truly", "remarkably", "so")
_MODIFIER_PROBABILITY = 0.2


def _clip(score: int) -> int:
    return max(-2, min(2, score))


class _TreeGenerator:
    """Draws trees and labels them by the rule above; ``label_noise`` blurs the labels shown."""

    def __init__(self, rng: random.Random, label_noise: float) -> None:
        self.rng = rng
        self.label_noise = label_noise

    def label(self, score: int) -> int:
        """The label written for a span of this score: off by one with probability ``label_noise``."""
        label = score + 2
        if self.label_noise and self.rng.random() < self.label_noise:
            step = self.rng.choice((-1, 1))
            label = label + step if 0 <= label + step < NUM_FINE_LABELS else label - step
        return label

    def tree(self, num_words: int) -> tuple[Tree, int]:
        """A random tree over ``num_words`` words and its true score (parents use true scores)."""
        rng = self.rng
        if num_words == 1:
            r = rng.random()
            word = rng.choice(_NEUTRAL_WORDS if r < 0.6 else _POSITIVE_WORDS if r < 0.8 else _NEGATIVE_WORDS)
            score = _POLAR_WORDS.get(word, 0)
            return Tree(self.label(score), word), score
        if rng.random() < _MODIFIER_PROBABILITY:
            negate = rng.random() < 0.5
            modifier = Tree(self.label(0), rng.choice(_NEGATORS if negate else _INTENSIFIERS))
            phrase, phrase_score = self.tree(num_words - 1)
            if negate:
                score = -1 if phrase_score > 0 else 1 if phrase_score < 0 else 0
            else:
                score = _clip(2 * phrase_score)
            return Tree(self.label(score), None, (modifier, phrase)), score
        split = rng.randint(1, num_words - 1)
        left, left_score = self.tree(split)
        right, right_score = self.tree(num_words - split)
        score = _clip(left_score + right_score)
        return Tree(self.label(score), None, (left, right)), score


def generate_sst(
    num_trees: int, *, seed: int = 0, min_words: int = 2, max_words: int = 20, label_noise: float = 0.1
) -> list[Tree]:
    """Random binary sentiment trees whose labels follow a simple, learnable rule.

    Words come from a small lexicon of neutral, positive and negative words (scores -2..2,
    label = score + 2). A node's score is the sum of its children's, clipped to -2..2, except
    after a modifier: a negator (``not``, ``never``, ...) turns the phrase to its right mildly
    to the opposite sign and an intensifier (``very``, ...) doubles it. With probability
    ``label_noise`` a node's written label is off by one (its parent still uses the true
    score), so accuracy tops out below 100% as on real data. ``str(tree)`` is the SST line
    for a tree and :func:`parse_tree` reads it back to an equal tree.

    Args:
        num_trees: how many trees.
        seed: the same seed gives the same trees.
        min_words: the fewest words in a sentence (>= 1).
        max_words: the most words in a sentence (>= ``min_words``); lengths are uniform.
        label_noise: probability in [0, 1) that a node's label is moved one step (default 0.1).

    >>> from torchfold.examples.sst import parse_tree
    >>> trees = generate_sst(3, seed=1)
    >>> [parse_tree(str(t)) == t for t in trees]
    [True, True, True]
    """
    check_int("num_trees", num_trees, 0)
    for name, value in (("seed", seed), ("min_words", min_words), ("max_words", max_words)):
        check_int(name, value, None)  # (the words' range is checked below, naming both)
    if not 1 <= min_words <= max_words:
        raise ValueError(
            f"need 1 <= min_words <= max_words, got min_words={min_words}, max_words={max_words}"
        )
    if not 0.0 <= label_noise < 1.0:
        raise ValueError(f"label_noise must be in [0, 1), got {label_noise!r}")
    rng = random.Random(seed)
    generator = _TreeGenerator(rng, label_noise)
    return [generator.tree(rng.randint(min_words, max_words))[0] for _ in range(num_trees)]


def generate_sst_lines(
    num_trees: int, *, seed: int = 0, min_words: int = 2, max_words: int = 20, label_noise: float = 0.1
) -> list[str]:
    """The SST-format lines of :func:`generate_sst` (same arguments), e.g. to write a data file.

    >>> generate_sst_lines(1, seed=3, max_words=3, label_noise=0.0)
    ['(3 (2 city) (3 charming))']
    """
    trees = generate_sst(
        num_trees, seed=seed, min_words=min_words, max_words=max_words, label_noise=label_noise
    )
    return [str(tree) for tree in trees]
