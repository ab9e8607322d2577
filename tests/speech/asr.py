"""Speech recognition for checking that synthesized speech is intelligible: pocketsphinx's bundled US-English
model (offline), 16 kHz input, and word recall against the text that was spoken."""

from __future__ import annotations

import difflib
import re
import numpy as np

from omni_backend.stages.tts_audio import resample

ASR_RATE = 16000


def _decoder():
    """A fresh decoder per clip: pocketsphinx carries its cepstral-mean estimate from one utterance to the next,
    which made a clip's first words depend on the clips before it."""
    from pocketsphinx import Decoder

    return Decoder(samprate=ASR_RATE, loglevel="FATAL")


def transcribe(samples: np.ndarray, sample_rate: int) -> str:
    """int16 mono speech -> lower-case words recognized by pocketsphinx."""
    audio = resample(samples, sample_rate, ASR_RATE)
    decoder = _decoder()
    decoder.start_utt()
    decoder.process_raw(audio.astype("<i2").tobytes(), full_utt=True)
    decoder.end_utt()
    hypothesis = decoder.hyp()
    return hypothesis.hypstr if hypothesis is not None else ""


_CONTRACTIONS = {"n't": " not", "'re": " are", "'m": " am", "'ll": " will", "'ve": " have", "'d": " would",
                 "'s": " is"}
"""'s is read as "is" (seen: "the weather is nice" heard as "the weather's nice"); for recall an extra "is"
after a possessive costs nothing, since only the reference's words are counted."""


def words(text: str) -> list[str]:
    """Lower-case words with contractions spelled out ("we're" -> "we are"), as word-error-rate scoring does."""
    text = text.lower().replace("’", "'")
    for short, long in _CONTRACTIONS.items():
        text = text.replace(short, long)
    return re.findall(r"[a-z']+", text)


def word_recall(reference: str, hypothesis: str) -> float:
    """Share of the reference's words found, in order, in the hypothesis (longest matching alignment)."""
    ref, hyp = words(reference), words(hypothesis)
    if not ref:
        return 1.0
    matcher = difflib.SequenceMatcher(a=ref, b=hyp, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks()) / len(ref)
