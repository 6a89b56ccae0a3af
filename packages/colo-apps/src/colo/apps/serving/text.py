"""Token ids to the text a client sees, incrementally: what may be streamed now, and the final text cut before the
stop string the engine matched.

`IncrementalText` decodes only the tokens since the last settled character, as vLLM's incremental detokenizer
does: each step decodes the window from the previous read point and keeps what it adds to that point's text (a
token's text can depend on its neighbours: a word's leading space, byte-level tokens forming one UTF-8 character
over several steps; a window ending in U+FFFD, an unfinished character, waits for the next token). A step costs the
window, not the whole completion. The part past what was already sent is the delta, less a held-back tail: with
stop strings, the last ``len(longest stop) - 1`` characters (they could be the start of a stop string the next
token completes, and text sent cannot be taken back); stop strings are searched only in the new text and the
``len(longest stop) - 1`` characters before it. The final text is decoded once, whole, so the deltas of a stream add
up to exactly the non-streamed text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalText:
    """The text of a growing list of token ids, decoding only the window since the last settled character.

    Args:
        decode: ``decode(ids) -> str``.

    Attributes:
        token_ids (list[int]): the ids so far.
        text (str): their settled text (an unfinished character at the end is not in it yet).
    """

    def __init__(self, decode) -> None:
        self._decode = decode
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0  # the window starts here: the tokens before it are settled and not decoded again
        self._read = 0  # the tokens before it are in ``text``

    def add(self, new_ids: Sequence[int]) -> str:
        """Take tokens; return the text they settled (maybe empty)."""
        self.token_ids.extend(new_ids)
        if self._read == len(self.token_ids):
            return ""
        before = self._decode(self.token_ids[self._prefix : self._read])
        after = self._decode(self.token_ids[self._prefix :])
        if after.endswith(REPLACEMENT):  # an unfinished character: wait for the tokens that complete it
            return ""
        delta = after[len(before) :]
        self.text += delta
        self._prefix, self._read = self._read, len(self.token_ids)
        return delta


def find_stop(text: str, stop: Sequence[str], start: int) -> tuple[int, str] | None:
    """The first ``(position, stop string)`` in ``text`` at or after ``start``, or ``None``."""
    found = [(at, s) for at, s in ((text.find(s, start), s) for s in stop) if at >= 0]
    return min(found) if found else None


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
        self._incremental = IncrementalText(tokenizer.decode)
        self._fed = 0  # token_ids given to _incremental
        self._searched = 0  # characters of _incremental.text searched for stop strings
        self._stop_at: int | None = None  # where the first stop string starts, once one occurred

    def _decode(self) -> str:
        return self._tokenizer.decode([i for i in self.token_ids if i not in self._hidden])

    def _cut(self, text: str) -> str:
        """``text`` before the first stop string in it (whole text when none occurs)."""
        positions = [p for p in (text.find(s) for s in self._stop) if p >= 0]
        return text[: min(positions)] if positions else text

    def add(self, new_ids: Sequence[int]) -> str:
        """Take this step's tokens; return the text that can be sent now (maybe empty)."""
        self.token_ids.extend(int(i) for i in new_ids)
        self._incremental.add([i for i in self.token_ids[self._fed :] if i not in self._hidden])
        self._fed = len(self.token_ids)
        text = self._incremental.text
        if self._stop and self._stop_at is None:
            found = find_stop(text, self._stop, max(0, self._searched - self._holdback))
            self._searched = len(text)
            if found is not None:
                self._stop_at = found[0]
        if self._stop_at is not None:
            text = text[: self._stop_at]
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
