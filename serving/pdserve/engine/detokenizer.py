"""Incremental detokenisation for streaming.

Decoding token by token is wrong for BPE tokenizers in two ways: a character can span several tokens (byte
fallback ``<0xE6><0x97><0xA5>`` or byte-level pieces), and decoders strip or add spaces depending on what comes
before (sentencepiece's leading "▁"). So, as text-generation-inference and vLLM do, each step decodes a short
window of recent tokens twice -- without and with the new tokens -- and emits the difference, but only once that
difference no longer ends in U+FFFD (an incomplete UTF-8 sequence). Seed it with the tail of the prompt so the
first generated token gets its context (e.g. its leading space).
"""

from __future__ import annotations

from collections.abc import Sequence

from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 6  # prompt tokens kept as decoding context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back (an unfinished character decodes as U+FFFD). Call once, at the end."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
