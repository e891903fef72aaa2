"""Copies from the context: transformers' prompt lookup, on the host copy of the committed ids.

`PromptLookupCandidateGenerator` searches the sequence on its device, which costs a host sync per n-gram size
and per match tried (`nonzero`, then reading each match index) on an accelerator. The loop keeps the committed
ids on the host anyway (it reads each step's tokens once), so the same search runs there, on an index of the
first occurrence of every n-gram kept up to date as tokens are committed: O(1) per step instead of a scan.
"""

from __future__ import annotations


class ContextLookup:
    """The continuation that transformers' prompt lookup (`max_matching_ngram_size`, `num_output_tokens`, no EOS
    and no logits processors) proposes for `tokens`: for the longest n-gram size first, the first earlier
    occurrence of the sequence's last n tokens that has a continuation, and up to `num_output_tokens` tokens after it.

    Args:
        num_output_tokens (`int`): the longest continuation.
        max_matching_ngram_size (`int`, defaults to 2): the longest n-gram matched.
    """

    def __init__(self, num_output_tokens: int, max_matching_ngram_size: int = 2):
        self.num_output_tokens, self.max_ngram = num_output_tokens, max_matching_ngram_size
        self.tokens: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> where its first occurrence starts

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                self.first.setdefault(tuple(self.tokens[end - n :]), end - n)

    def find(self, max_length: int) -> tuple[int, list[int]]:
        """`(where it starts, the continuation to copy)` (empty: none), as long as `max_length` total tokens allow."""
        length = len(self.tokens)
        if max_length == length + 1:  # as prompt lookup: no candidates when only the target's own token fits
            return 0, []
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            start = self.first.get(tuple(self.tokens[length - n :]))
            # the first occurrence is the leftmost match; only the sequence's own end has nothing after it
            if start is not None and start + n < min(length, max_length):
                return start + n, self.tokens[start + n : min(start + n + self.num_output_tokens, length, max_length)]
        return 0, []


__all__ = ["ContextLookup"]
