"""Tool calls read out of an answer's text as it streams: content and `tool_calls` deltas as OpenAI streams them.

One parser serves both ways of answering, so that a streamed answer assembles to exactly the non-streamed one: the
non-streamed message is the parser's state after the whole text in one piece (`ToolCallParser.parse`).

The text a choice produces (serving/tools.py says which grammar constrains it):

- `named`: the text is the function's arguments. The call's first delta (index, id, type, function name, empty
  arguments) goes out with the first text, every later piece of text as an argument fragment.
- `required`: a JSON array `[{"name": ..., "arguments": ...}, ...]`. Each item's first delta goes out once its
  name and the first character of its arguments are read, then the arguments' text as it comes, up to the end of
  their JSON value (strings, escapes and nesting followed character by character).
- `auto` (Hermes format): free text with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. Text is
  content; a possible start of `<tool_call>` is held back until it is one or is not. A block whose head is not
  `{"name": <a given tool>, "arguments": {` is content after all. Whitespace next to a call is dropped, except,
  between two texts, the whitespace before the call, which keeps them apart (whitespace is held back until
  non-whitespace text follows).

An answer cut short (max_tokens) keeps the calls it began, their arguments cut too (finish_reason stays "length",
as OpenAI's); a `required` answer cut before its first call is content.
"""

from __future__ import annotations

import secrets

TRIGGER = "<tool_call>"
CLOSE = "</tool_call>"
_MORE, _NO = "more", "no"  # a piece of markup not read yet / not there
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")  # OpenAI's name rule
_SCALAR_END = frozenset(",}] \t\r\n")


def _markup(text: str, pos: int, pieces: tuple[str, ...]) -> int | str:
    """Read `pieces` (literals, whitespace allowed before each) from text[pos:]: the position after them, _MORE when
    the text ends inside them, _NO when it holds something else."""
    for piece in pieces:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        rest = text[pos:pos + len(piece)]
        if rest != piece:
            return _MORE if piece.startswith(rest) and pos + len(rest) == len(text) else _NO
        pos += len(piece)
    return pos


def _head(text: str, pos: int, names, value_starts: str | None) -> tuple[str, int] | str:
    """Read a call's head `{"name": "<name>", "arguments": ` from text[pos:] and the first character of the
    arguments: (name, the arguments' position), _MORE or _NO (also a name not in `names`, or arguments not starting
    with one of `value_starts` when given)."""
    pos = _markup(text, pos, ("{", '"name"', ":", '"'))
    if isinstance(pos, str):
        return pos
    end = pos
    while end < len(text) and text[end] in _NAME_CHARS:
        end += 1
    if end == len(text):
        return _MORE
    name = text[pos:end]
    after = _markup(text, end, ('"', ",", '"arguments"', ":"))
    if isinstance(after, str) or name not in names:
        return _NO if name not in names or after == _NO else _MORE
    while after < len(text) and text[after].isspace():
        after += 1
    if after == len(text):
        return _MORE
    if value_starts is not None and text[after] not in value_starts:
        return _NO
    return name, after


class _Value:
    """Where one JSON value ends, read character by character (assumes JSON: the grammar made it so)."""

    def __init__(self):
        self.depth, self.in_string, self.escaped, self.started, self.done = 0, False, False, False, False

    def take(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them while it goes on; `done` once ended)."""
        for i, char in enumerate(text):
            if not self.started:
                self.started = True
                if char == '"':
                    self.in_string = True
                elif char in "{[":
                    self.depth = 1
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if self.depth == 0:  # a number, true, false or null: ends before a delimiter
                if char in _SCALAR_END:
                    self.done = True
                    return i
                continue
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolCallParser:
    """Reads one choice's text, piece by piece, into content and tool calls.

    Args:
        choice: "auto", "required" or "named" (serving/tools.py's ToolRequest.choice).
        names: the functions the request gives.
        named: the function of a "named" choice.

    Attributes:
        content: the content so far; calls: the calls so far, OpenAI's shape ({"id", "type": "function",
            "function": {"name", "arguments"}}), arguments as read so far.
    """

    def __init__(self, choice: str, names, named: str | None = None):
        self.choice, self.names, self.named = choice, frozenset(names), named
        self.content, self.calls = "", []
        self._pending = ""  # text read but not yet placed
        self._state = {"auto": "text", "required": "open", "named": "named"}[choice]
        self._value: _Value | None = None
        self._space = ""  # auto: whitespace after content, held until non-whitespace content follows
        self._after_call = False  # auto: whitespace right after a call is dropped
        self._raw = ""  # required: the whole text, the content of an answer cut before its first call
        self._deltas: list[dict] = []
        self._said = ""

    @classmethod
    def parse(cls, choice: str, names, named: str | None, text: str) -> tuple[str | None, list[dict]]:
        """A whole answer's (content or None, calls)."""
        parser = cls(choice, names, named)
        parser.feed(text)
        parser.finish()
        return parser.content or None, parser.calls

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Read the next piece of text: (the content it adds, its `delta.tool_calls` entries: a call's first entry
        with index, id, type and function name and arguments, later ones with index and an argument fragment)."""
        self._pending += text
        if self.choice == "required":
            self._raw += text
        if self.choice == "named":
            if not self.calls:
                self._begin(self.named)
            self._arguments(self._pending)
            self._pending = ""
        else:
            while self._pending and self._step():
                pass
        return self._out()

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the answer: what was held back, placed (content, deltas)."""
        if self.choice == "auto":
            if self._state in ("text", "head"):
                self._say((TRIGGER if self._state == "head" else "") + self._pending)
            if not self._after_call:  # the content's own trailing whitespace, not a call's surroundings
                self._said += self._space
                self.content += self._space
            self._space = ""
        elif self.choice == "required" and not self.calls:
            self._said += self._raw
            self.content += self._raw
        elif self.choice == "named" and not self.calls:
            self._begin(self.named)
        self._pending = ""
        return self._out()

    def _out(self) -> tuple[str, list[dict]]:
        said, deltas = self._said, self._deltas
        self._said, self._deltas = "", []
        merged: list[dict] = []
        for delta in deltas:  # one entry per call per piece: a head and its first fragments go out together
            if merged and merged[-1]["index"] == delta["index"] and "id" not in delta:
                merged[-1]["function"]["arguments"] += delta["function"]["arguments"]
            else:
                merged.append(delta)
        return said, merged

    def _begin(self, name: str) -> None:
        call = {"id": "call_" + secrets.token_hex(12), "type": "function",
                "function": {"name": name, "arguments": ""}}
        self._deltas.append({"index": len(self.calls), **call, "function": {"name": name, "arguments": ""}})
        self.calls.append(call)

    def _arguments(self, text: str) -> None:
        if text:
            self.calls[-1]["function"]["arguments"] += text
            self._deltas.append({"index": len(self.calls) - 1, "function": {"arguments": text}})

    def _say(self, text: str) -> None:
        """Content outside the calls, whitespace next to a call dropped (module docstring)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        self._said += body
        self.content += body

    def _step(self) -> bool:
        """Place what `_pending` allows; False when it must wait for more text."""
        text, state = self._pending, self._state
        if state == "text":
            start = text.find(TRIGGER)
            if start < 0:
                keep = next((k for k in range(min(len(TRIGGER) - 1, len(text)), 0, -1)
                             if TRIGGER.startswith(text[-k:])), 0)
                self._say(text[:len(text) - keep])
                self._pending = text[len(text) - keep:]
                return False
            self._say(text[:start])
            self._pending, self._state = text[start + len(TRIGGER):], "head"
            return True
        if state == "open":
            return self._read(_markup(text, 0, ("[",)), "head")
        if state == "head":
            head = _head(text, 0, self.names, "{" if self.choice == "auto" else None)
            if head == _MORE:
                return False
            if head == _NO:
                if self.choice == "auto":  # not a call after all: the block is text
                    self._say(TRIGGER)
                    self._state = "text"
                else:
                    self._state = "rest"
                return True
            name, start = head
            if self.choice == "auto" and not self.content:
                self._space = ""  # whitespace before a first call: no text before it to keep apart
            self._begin(name)
            self._pending, self._state, self._value = text[start:], "arguments", _Value()
            return True
        if state == "arguments":
            taken = self._value.take(text)
            self._arguments(text[:taken])
            self._pending = text[taken:]
            if not self._value.done:
                return False
            self._state = "close" if self.choice == "auto" else "item end"
            return True
        if state == "close":
            after = _markup(text, 0, ("}", CLOSE))
            if after == _MORE:
                return False
            # the call stands; text after it (or an odd end to its block) is content again
            self._pending, self._state = text[after:] if after != _NO else text, "text"
            self._after_call = True
            return True
        if state == "item end":
            after = _markup(text, 0, ("}",))
            if isinstance(after, int):
                more = _markup(text, after, (",",))
                if isinstance(more, int):
                    self._pending, self._state = text[more:], "head"
                    return True
                return self._read(_markup(text, after, ("]",)), "rest")
            return self._read(after, "rest")
        self._pending = ""  # "rest": after the array (nothing, in a constrained answer)
        return False

    def _read(self, after: int | str, then: str) -> bool:
        """`required`: go on to state `then` after markup read up to `after`; wait on _MORE; on _NO (not the
        array the grammar allows), read no further."""
        if after == _MORE:
            return False
        if after == _NO:
            self._state = "rest"
            return True
        self._pending, self._state = self._pending[after:], then
        return True
