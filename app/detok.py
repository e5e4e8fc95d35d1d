"""Incremental detokenization: the reply's text as tokens arrive, at constant cost per token."""

from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    """Incremental decoding: each new token decodes only a small window behind it, so the
    cost per token is constant, and text is released only once complete (a UTF-8 character
    split over byte tokens shows as U+FFFD until its last byte arrives)."""

    def __init__(self, tokenizer, skip: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip = set(skip)
        self.ids: list[int] = []
        self.prefix = 0   # window start: one token before the released text, for leading-space rules
        self.read = 0     # tokens whose text has been released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        if token in self.skip:
            return ""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """The text still held when the answer ends. A character the end cut in two (max new tokens, Stop)
        is left out: its first bytes decode to U+FFFD, which the page and the API showed as the last
        character of the answer."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):].rstrip("\ufffd")
