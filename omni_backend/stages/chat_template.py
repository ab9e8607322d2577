"""Chat prompts in which only the chat template writes control tokens.

A client's text may hold the strings of a model's control tokens: `"hello<|im_end|>\\n<|im_start|>system\\n..."`,
or a media placeholder such as `"<image>"`. Tokenized the way the template's own output is, those strings would
become the tokens themselves, so a user could end their turn and open a system turn, or an image slot, from plain
text. transformers guards against this in `apply_chat_template(..., sanitize_control_tokens=True)`: the control-token
strings inside the client's strings are wrapped in private-use markers before the template runs, and the tokenizer
encodes a marked string as the text it is (`tokenizer(text, sanitize_control_tokens=True)`), so only the control
tokens the template writes are tokens. `ChatTemplate` does the same in two steps, marking each client string as the
stages parse it (`mark`), so that the stages can still write their own control text into the messages afterwards
(media placeholders) and tokenize the rendered chat in pieces (`encode`).

Control tokens are transformers' choice: the tokenizer's special tokens, plus the added tokens the chat template's
own text holds. A client's text without any of them tokenizes exactly as the template's plain output does; one with
them costs the ids of their text pieces ("<|im_end|>" is 7 SmolLM2 tokens, never the end-of-turn id 2).
"""

from __future__ import annotations

from transformers.utils.chat_template_utils import _get_control_token_patterns, mark_control_tokens

from omni_backend import tensor_names as T
from omni_backend.stages.tool_prompt import default_rendering
from omni_backend.vocabulary import FieldError


class ChatTemplate:
    """A checkpoint's chat template and tokenizer, with client text kept as text.

    Args:
        tokenizer: the checkpoint's transformers tokenizer (a fast one: transformers encodes marked text with it).
        renderer: what renders the template: the tokenizer itself, or a multimodal checkpoint's processor.

    Raises:
        ValueError: the renderer has no chat template.
    """

    def __init__(self, tokenizer, renderer=None):
        self.tokenizer = tokenizer
        self.renderer = renderer if renderer is not None else tokenizer
        template = self.renderer.chat_template
        if isinstance(template, dict):  # named templates: the one transformers picks when none is named
            template = template.get("default")
        if not template:
            raise ValueError("the checkpoint has no (default) chat template")
        # transformers' own marking: what apply_chat_template(..., sanitize_control_tokens=True) applies to the
        # messages all at once (transformers 5.24; pinned in requirements.txt)
        self._control, _ = _get_control_token_patterns(tokenizer._get_control_tokens(template))
        self.takes_tools = "tools" in template  # else tools get the default rendering (stages/tool_prompt.py)

    def mark(self, text: str) -> str:
        """A client string with each control-token string in it marked as text (see the module docstring)."""
        return mark_control_tokens(text, self._control)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None) -> str:
        """The chat as the template writes it, client strings still marked (transformers' `apply_chat_template`
        semantics: with `continue_final_message` the text ends inside the last message, without its end of turn).
        `tools` (OpenAI tool definitions) and the messages' tool calls and results go to a template that reads
        tools, else they are written as text first (`tool_prompt.default_rendering`).

        Raises:
            FieldError: the template rejected the messages (`text_input`).
        """
        extra = {}
        if tools or any("tool_calls" in m or m["role"] == "tool" for m in messages):
            if self.takes_tools:
                extra["tools"] = tools
            else:
                messages = default_rendering(messages, tools, self.mark)
        try:
            return self.renderer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     continue_final_message=continue_final_message, tokenize=False,
                                                     **extra)
        except Exception as exc:  # jinja2 TemplateError and friends: the template refused these messages
            raise FieldError(T.TEXT_INPUT, f"messages were rejected by the chat template: {exc}") from None

    def encode(self, rendered: str) -> list[int]:
        """Token ids of a piece of rendered chat: the template's control tokens as tokens, marked text as text; no
        tokens added around it (the template writes its own).

        Raises:
            FieldError: a marked string the tokenizer turns back into its control token even as plain text.
        """
        try:
            return list(self.tokenizer(rendered, add_special_tokens=False, sanitize_control_tokens=True).input_ids)
        except ValueError as exc:  # transformers: "Can't sanitize '<tok>': the tokenizer produces it from plain text"
            raise FieldError(T.TEXT_INPUT, f"holds text this model cannot read as text: {exc}") from None
