"""Streaming detokenization with stop strings.

Byte-level BPE tokens can split a multi-byte character, so text is emitted only up to the last
complete character (a trailing U+FFFD is held back until the next token completes it). Decoding is
incremental (TGI's prefix/read offsets): each step decodes only the last few tokens, so a long
generation costs O(n), not O(n^2), in the tokenizer. Stop strings
are searched in the whole text; text that could still be the start of a stop string is held back so
a stop string is never partly streamed.
"""
from __future__ import annotations

from collections.abc import Sequence

# Byte-level tokens can straddle characters for a while (emoji sequences), so hold back generously; past this many
# tokens the replacement character is shown. Bounds each step's decode, so it may run on the event loop.
MAX_HELD_BACK_TOKENS = 32


class Detokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._text = ""  # decoded text of self._ids[:self._read], complete characters only
        self._prefix = 0  # tokens before this index are never decoded again
        self._read = 0  # tokens before this index are in self._text
        self._emitted = 0  # characters of the decoded text already returned
        self.stopped = False

    def _decode_ids(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode(self, flush: bool = False) -> str:
        """The text of all tokens so far; without ``flush``, an incomplete trailing character waits."""
        if self._read < len(self._ids):
            # Decode from a few tokens back so byte-level merges across the boundary come out right.
            before = self._decode_ids(self._ids[self._prefix : self._read])
            after = self._decode_ids(self._ids[self._prefix :])
            if flush or not after.endswith("\ufffd") or len(self._ids) - self._read >= MAX_HELD_BACK_TOKENS:
                self._text += after[len(before) :]
                self._prefix, self._read = self._read, len(self._ids)
        return self._text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new text that is safe to show. Sets ``stopped`` on a stop string."""
        self._ids.extend(token_ids)
        text = self._decode()
        # The earliest match of any stop string, not the first stop string in the list that matches.
        hits = [at for s in self._stop if (at := text.find(s, max(0, self._emitted - len(s) + 1))) != -1]
        if hits:
            at = min(hits)
            self.stopped = True
            text = text[:at] if at >= self._emitted else text[: self._emitted]
            return self._take(text, len(text))
        safe = len(text)  # _decode already holds back an incomplete trailing character
        for s in self._stop:  # hold back a suffix that may grow into a stop string
            for n in range(min(len(s) - 1, safe - self._emitted), 0, -1):
                if text[safe - n : safe] == s[:n]:
                    safe -= n
                    break
        return self._take(text, safe)

    def finish(self) -> str:
        """Whatever text is still held back (call once, when generation ends without a stop string)."""
        if self.stopped:
            return ""
        text = self._decode(flush=True)
        return self._take(text, len(text))

    def _take(self, text: str, end: int) -> str:
        piece = text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return piece
