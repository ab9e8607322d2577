"""Token ids of a one-message chat prompt, for engine tests that feed the engine directly."""

from __future__ import annotations


def chat_ids(tokenizer, text: str) -> list[int]:
    """The user message `text` rendered by the tokenizer's chat template with the assistant's turn opened."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
