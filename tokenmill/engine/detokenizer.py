"""Incremental detokenization and stop-string handling for one request (used by engine/output_processor.py)."""

from __future__ import annotations

from tokenmill.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns output tokens into text a step at a time. Text that could still become a stop string is held
    back until it is certain; a stop string ends the output and is not included."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tok = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far (stop string cut off once found)
        self.emitted = 0  # chars of text already returned

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token; returns the stop string if it completed one (looked for only with `check_stop`:
        before `min_tokens` a stop string stays in the text)."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
            return None
        new = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if not new:
            return None
        start = max(0, len(self.text) - self.hold)
        self.text += new
        if not check_stop:
            return None
        hits = [(pos, s) for s in self.stop if (pos := self.text.find(s, start)) >= 0]
        if hits:
            pos, s = min(hits)
            self.text = self.text[:pos]
            return s
        return None

    def take(self, finished: bool) -> str:
        """The new text that is safe to emit now (all of it once finished)."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
