"""Incremental, UTF-8-safe detokenization with stop strings.

Decoding token by token breaks multi-byte characters (a CJK character or emoji often spans several byte-level
BPE tokens) and word-initial spaces (SentencePiece). The offsets method used here decodes a short window of
previous tokens together with the new ones and emits only the text beyond the window's old end, holding back
text that ends in U+FFFD (an incomplete UTF-8 sequence); it follows the prefix/read offset scheme of vLLM's
`detokenize_incrementally` (vllm/transformers_utils/detokenizer_utils.py), re-implemented here.

Stop strings: text that could still become a stop string (a suffix equal to a stop string's prefix) is held
back, so no character of a stop string is ever released; on a match the text is cut before it.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 6  # tokens of left context re-decoded with each new token (covers merges and spaces)


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into released text deltas.

    Args:
        tokenizer: a transformers tokenizer (only `decode` is used, skip_special_tokens=True).
        prompt_token_ids: ids preceding the output, used as left context for the first tokens.
        stop: stop strings.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.tokens: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # all decoded output text so far (after a stop match, cut before it)
        self.released = 0  # characters of `text` already handed out

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> bool:
        """Append one generated token. Returns True when a stop string matched (text is cut before it)."""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset:])
        if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
            return False  # incomplete character (or nothing visible yet): wait for more tokens
        new_text = full_text[len(prefix_text):]
        self.prefix_offset = max(self.read_offset, len(self.tokens) - CONTEXT_TOKENS)
        self.read_offset = len(self.tokens)
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += new_text
        matches = [at for at in (self.text.find(stop, search_from) for stop in self.stop) if at != -1]
        if matches:
            self.text = self.text[:min(matches)]  # the earliest stop string wins, whatever the list order
            return True
        return False

    def release(self, final: bool) -> str:
        """Text safe to send now: everything when `final`, else all but a possible stop-string prefix."""
        end = len(self.text)
        if not final and self.stop:
            end -= self._held_back_length()
        end = max(end, self.released)
        delta = self.text[self.released:end]
        self.released = end
        return delta

    def _held_back_length(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        tail = self.text[-self.max_stop_len:] if self.max_stop_len else ""
        for length in range(min(len(tail), self.max_stop_len - 1), 0, -1):
            suffix = tail[-length:]
            if any(stop.startswith(suffix) for stop in self.stop):
                return length
        return 0
