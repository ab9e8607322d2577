"""What text a voice can speak: format characters removed, control characters and text without a word refused.

A synthesizer (Piper's phonemizer) drops what it cannot pronounce, so text of only punctuation, symbols or
invisible characters ("-", "…", two zero-width spaces) would come back as zero samples of audio, and a NUL or
another control character inside a request is a client fault, not something to read aloud. Letters and digits
(Unicode categories L* and N*) are what a voice speaks; format characters (category Cf: zero-width spaces and
joiners, direction marks, the BOM) are removed; control characters (category Cc) other than tab, newline and
carriage return are refused.
"""

from __future__ import annotations

import unicodedata

_ALLOWED_CONTROLS = frozenset("\t\n\r")


def unspeakable_reason(text: str) -> str | None:
    """Why `text` cannot be spoken, or None: "contains the control character U+0000 at offset 5", or "has
    nothing to speak (no letter or digit)"."""
    for offset, char in enumerate(text):
        if unicodedata.category(char) == "Cc" and char not in _ALLOWED_CONTROLS:
            return f"contains the control character U+{ord(char):04X} at offset {offset}"
    if not any(unicodedata.category(char)[0] in "LN" for char in text):
        return "has nothing to speak (no letter or digit)"
    return None


def speech_text(text: str) -> str:
    """`text` without format characters (category Cf) and control characters other than tab, newline and
    carriage return: what is handed to a synthesizer."""
    return "".join(char for char in text if unicodedata.category(char) not in ("Cf", "Cc")
                   or char in _ALLOWED_CONTROLS)
