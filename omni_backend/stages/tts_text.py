"""Cutting a stream of LLM text deltas into chunks worth speaking, so audio can start before the text ends.

A speech synthesizer needs whole phrases (its prosody looks at the sentence), while an LLM streams a few
characters at a time. `SentenceChunker` collects deltas and releases a chunk when a sentence ends, except for
the first chunk of a stream, which is released early (at the first clause boundary, or after a few words when
none comes) so the listener hears something while the model is still writing. Chunks joined in order give
back exactly the text that went in (spaces included), which is what lets a speech response's transcript
equal the text reply.

Boundaries:
- a sentence ends at `.`, `!`, `?` or `…` (closing quotes/brackets included) followed by whitespace, or at a
  newline; "Dr." and similar short abbreviations do not end one (nor does "3.14": no whitespace follows);
- the first chunk also ends at `,` `;` `:` followed by whitespace once it has `first_min_words` words, or at
  the whitespace after `first_max_words` words;
- any chunk longer than `max_chars` is cut at its last clause boundary or space (a synthesizer's cost and
  latency grow with its input).

A boundary needs the character after the punctuation, so text ending in "." waits for the next delta (or the
end of the stream) before it is released.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SENTENCE_END = re.compile(r"""(?:[.!?…]+["'”’)\]]*)(?=\s)|\n""")
_CLAUSE_END = re.compile(r"""[,;:]["'”’)\]]*(?=\s)""")
_ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "no", "fig", "mt", "inc", "ltd",
})


@dataclass
class SentenceChunker:
    """Accumulates text deltas of one stream and hands out speakable chunks.

    Args:
        first_min_words: words the first chunk needs before a clause boundary (`,` `;` `:`) may end it.
        first_max_words: the first chunk ends at the first space after this many words even without punctuation.
        max_chars: longest chunk; longer text is cut at its last clause boundary or space.
    """

    first_min_words: int = 2
    first_max_words: int = 6
    max_chars: int = 300
    chunks_out: int = 0
    _buffer: str = field(default="", repr=False)

    def push(self, delta: str) -> list[str]:
        """Add a text delta; return the chunks that are now complete (possibly none)."""
        self._buffer += delta
        chunks = []
        while True:
            cut = self._next_cut()
            if cut is None:
                break
            chunks.append(self._take(cut))
        return chunks

    def flush(self) -> list[str]:
        """End of stream: whatever is left, as one chunk (none when nothing is left)."""
        if not self._buffer:
            return []
        return [self._take(len(self._buffer))]

    @property
    def pending(self) -> str:
        """Text received but not yet released."""
        return self._buffer

    def _take(self, cut: int) -> str:
        # Whitespace right after the cut goes with this chunk, so the next one starts at a word.
        while cut < len(self._buffer) and self._buffer[cut] in " \t\r\n":
            cut += 1
        chunk, self._buffer = self._buffer[:cut], self._buffer[cut:]
        self.chunks_out += 1
        return chunk

    def _next_cut(self) -> int | None:
        text = self._buffer
        if not text.strip():
            return None
        for match in _SENTENCE_END.finditer(text):
            if match.group(0) == "\n" or not _is_abbreviation(text, match.start()):
                if text[: match.end()].strip():
                    return match.end()
        if self.chunks_out == 0:
            for match in _CLAUSE_END.finditer(text):
                if _word_count(text[: match.end()]) >= self.first_min_words:
                    return match.end()
            words = list(re.finditer(r"\S+(?=\s)", text))
            if len(words) >= self.first_max_words:
                return words[self.first_max_words - 1].end()
        if len(text) > self.max_chars:
            window = text[: self.max_chars]
            clauses = [m.end() for m in _CLAUSE_END.finditer(window)]
            if clauses:
                return clauses[-1]
            space = window.rstrip().rfind(" ")
            return space if space > 0 else self.max_chars
        return None


def _word_count(text: str) -> int:
    return len(text.split())


def _is_abbreviation(text: str, dot: int) -> bool:
    """True when the punctuation at `dot` is the "." of a short abbreviation ("Dr.", "e.g.")."""
    if text[dot] != ".":
        return False
    word = re.search(r"([A-Za-z.]+)$", text[:dot])
    return bool(word) and word.group(1).lower().strip(".") in _ABBREVIATIONS
