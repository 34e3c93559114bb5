"""Streaming detokenizer: token ids in, text that is safe to show out, stop strings caught.

Two things make streaming text harder than decoding the finished sequence:

- A token is not a character. Byte-level BPE splits an emoji into several tokens; the
  first ones decode to U+FFFD ("?") until the last byte arrives. And SentencePiece-style
  decoders drop the leading space of the first token they see, so decoding one token at a
  time loses spaces. The fix (from vLLM and HF's TextStreamer): decode a short window of
  recent ids twice, with and without the new ones, and emit the difference; when the
  result ends in U+FFFD, wait for more tokens.
- A stop string can straddle tokens ("</an" + "swer>"). Text that could still turn out
  to be the start of a stop string is held back until it cannot, and the stop string and
  everything after it are never emitted.

Each push decodes only the window since the last complete character: O(new tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qinfer.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    tokenizer: the `qinfer.Tokenizer` (anything with `decode(ids, skip_special_tokens)`).
    stop: strings that end the text; the first one found is cut off with all after it.
    skip_special_tokens: leave `<|im_end|>` and friends out of the text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] | None = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop or () if s)
        self.skip_special_tokens = skip_special_tokens
        self.stopped = False
        self.matched_stop: str | None = None  # which stop string ended the text
        self.text = ""  # everything emitted so far
        self._ids: list[int] = []
        # ids[_prefix:_read] decoded to text already emitted (or held); the window for the
        # next decode starts at _prefix so the decoder sees the context of the new ids.
        self._prefix = 0
        self._read = 0
        self._held = ""  # decoded text not emitted yet: it may start a stop string

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text that became safe to emit (maybe "")."""
        if self.stopped:
            return ""
        self._ids.append(int(token_id))
        new_text = self._decode_new()
        if new_text is None:
            return ""
        return self._emit(self._held + new_text)

    def finish(self) -> str:
        """End of generation: emit what was held back, up to a stop string if one is in it.

        Ids whose bytes never completed a character come out as U+FFFD, as a full decode
        shows them. Returns "" once a stop string has matched.
        """
        if self.stopped:
            return ""
        pending = self._held
        if self._read < len(self._ids):
            prefix_text = self._window_text(self._prefix, self._read)
            pending += self._window_text(self._prefix, len(self._ids))[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)
        return self._emit(pending, final=True)

    def _decode_new(self) -> str | None:
        """Text added by the ids since `_read`, or None while it ends mid-character."""
        prefix_text = self._window_text(self._prefix, self._read)
        full_text = self._window_text(self._prefix, len(self._ids))
        if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
            # An incomplete UTF-8 sequence, or a token that adds no text yet (a skipped
            # special token, a decoder that merges on the next piece): wait.
            return None
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]

    def _window_text(self, start: int, end: int) -> str:
        if start == end:
            return ""
        return self.tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self.skip_special_tokens
        )

    def _emit(self, pending: str, final: bool = False) -> str:
        """Split pending text into what can go out now and what must wait; handle stops.

        final: no more text will come, so nothing is held back for a stop string.
        """
        cut, matched = _first_stop(pending, self.stop)
        if matched is not None:
            self.stopped, self.matched_stop = True, matched
            out, self._held = pending[:cut], ""
        else:
            keep = 0 if final else partial_match_length(pending, self.stop)
            out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str | None]:
    """(index, stop string) of the earliest stop string in text, or (-1, None)."""
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    return min(found) if found else (-1, None)


def partial_match_length(text: str, targets: Sequence[str]) -> int:
    """Length of the longest tail of text that is a proper start of some target: text a
    stream must hold back, since the next delta may complete the target."""
    longest = 0
    for target in targets:
        for length in range(min(len(target) - 1, len(text)), longest, -1):
            if target.startswith(text[-length:]):
                longest = length
                break
    return longest
