"""Token ids to the text a client sees, incrementally: what may be streamed now, and the final text cut before the
stop string the engine matched.

Every step the whole completion so far is decoded again (a token's text can depend on its neighbours: byte-level
tokens form one UTF-8 character over several steps) and the part past what was already sent is the delta, less a
held-back tail: trailing U+FFFD (an unfinished multi-byte character) and, with stop strings, the last
``len(longest stop) - 1`` characters (they could be the start of a stop string the next token completes, and text
sent cannot be taken back). The deltas of a stream therefore add up to exactly the non-streamed text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """The text of one request's new tokens, as it grows.

    Args:
        tokenizer: ``decode(ids)`` (special tokens skipped).
        stop (Sequence[str]): the request's stop strings.
        hidden_ids (Iterable[int]): ids never shown (the eos and stop-token ids that end a completion).
    """

    def __init__(self, tokenizer, *, stop: Sequence[str] = (), hidden_ids: Iterable[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._hidden = frozenset(hidden_ids)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self._sent = 0

    def _decode(self) -> str:
        return self._tokenizer.decode([i for i in self.token_ids if i not in self._hidden])

    def _cut(self, text: str) -> str:
        """``text`` before the first stop string in it (whole text when none occurs)."""
        positions = [p for p in (text.find(s) for s in self._stop) if p >= 0]
        return text[: min(positions)] if positions else text

    def add(self, new_ids: Sequence[int]) -> str:
        """Take this step's tokens; return the text that can be sent now (maybe empty)."""
        self.token_ids.extend(int(i) for i in new_ids)
        text = self._cut(self._decode())
        end = len(text) - self._holdback if self._stop else len(text)
        while end > self._sent and text[end - 1] == REPLACEMENT:
            end -= 1
        if end <= self._sent:
            return ""
        delta, self._sent = text[self._sent : end], end
        return delta

    def finish(self, stop_string: str | None = None) -> str:
        """The rest of the text once the request has finished (cut before ``stop_string`` or any stop string)."""
        text = self._decode()
        if stop_string:
            position = text.find(stop_string)
            text = text[:position] if position >= 0 else text
        text = self._cut(text)
        delta, self._sent = text[self._sent :], max(self._sent, len(text))
        return delta

    def text(self, stop_string: str | None = None) -> str:
        """The whole final text (for a non-streamed response)."""
        self._sent = 0
        return self.finish(stop_string)
