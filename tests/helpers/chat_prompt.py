"""Token ids of a one-message chat prompt, for engine tests that feed the engine directly."""

from __future__ import annotations


def chat_ids(tokenizer, text: str) -> list[int]:
    """The user message `text` rendered by the tokenizer's chat template with the assistant's turn opened."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def tool_chat_ids(tokenizer, messages: list[dict], tools: list[dict]) -> list[int]:
    """OpenAI chat `messages` (tool calls and results included) with OpenAI `tools`, in the default Hermes
    rendering of a template without tool support (stages/tool_prompt.py), the assistant's turn opened."""
    from omni_backend.stages.tool_prompt import default_rendering, tool_call_fields

    shown = [{**m, **tool_call_fields(m, f"messages[{i}]", str)} for i, m in enumerate(messages)]
    return tokenizer.apply_chat_template(default_rendering(shown, tools, str), add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
