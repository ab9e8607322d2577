"""Reading a request body: its media type, its content coding and its size limit, in the order a client can act on.

`Content-Encoding` (RFC 9110 section 8.4): `gzip` (also `x-gzip`), `deflate` (the zlib format; a raw deflate
stream, which some clients send, is accepted too) and `identity`; any other coding is 415, as RFC 7694 advises.
The size limit applies to the body as decoded, so a small compressed body that expands past it (a "zip bomb")
is refused with 413 as soon as the limit is crossed, without holding more than the limit in memory.
"""

from __future__ import annotations

import json
import re
import zlib

from starlette.requests import Request

from omni_backend.serving.errors import OpenAIError, invalid

_JSON_TYPE = re.compile(r"^application/([a-z0-9.+-]*\+)?json$")
CODINGS = ("gzip", "x-gzip", "deflate", "identity")


def too_large(limit: int) -> OpenAIError:
    """413 naming the limit."""
    return OpenAIError(413, f"request body is larger than the limit of {limit} bytes (after decompression)",
                       "invalid_request_error", None, "request_too_large")


class _Decoder:
    """Decodes one content coding chunk by chunk and fails once the decoded size passes `limit`."""

    def __init__(self, coding: str, limit: int):
        self.coding, self.limit, self.size = coding, limit, 0
        self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS) if coding in ("gzip", "x-gzip") else None

    def feed(self, data: bytes) -> bytes:
        if self.coding == "identity":
            return self._count(data)
        if self._zlib is None:  # deflate: zlib-wrapped (RFC 9110) unless the first bytes are no zlib header
            wrapped = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._zlib = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
        out = []
        try:
            while data:
                piece = self._zlib.decompress(data, self.limit - self.size + 1)
                out.append(self._count(piece))
                data = self._zlib.unconsumed_tail
        except zlib.error:
            raise self.mislabelled() from None
        return b"".join(out)

    def finish(self) -> bytes:
        if self.coding == "identity":
            return b""
        if self._zlib is None or not self._zlib.eof:
            raise self.mislabelled()
        return b""

    def _count(self, data: bytes) -> bytes:
        self.size += len(data)
        if self.size > self.limit:
            raise too_large(self.limit)
        return data

    def mislabelled(self) -> OpenAIError:
        return invalid(f"the request body is not valid {self.coding} data, as its Content-Encoding says",
                       None, "invalid_content_encoding")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, decoded per its `Content-Encoding`.

    Raises:
        OpenAIError: 415 for an unsupported content coding, 413 when the body (decoded) is over `limit` bytes,
            400 when it is not what its coding says (e.g. plain JSON labelled gzip, or a truncated gzip stream).
    """
    coding = request.headers.get("content-encoding", "identity").strip().lower() or "identity"
    if coding not in CODINGS:
        raise OpenAIError(415, f"Unsupported Content-Encoding '{coding}': send the body as gzip, deflate or "
                          "identity", "invalid_request_error", None, "unsupported_content_encoding")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    decoder = _Decoder(coding, limit)
    chunks, received = [], 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise too_large(limit)
        chunks.append(decoder.feed(chunk))
    chunks.append(decoder.finish())
    return b"".join(chunks)


def media_type(request: Request) -> str:
    """The request's media type, lower case, without parameters ("" when there is no Content-Type)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object.

    Raises:
        OpenAIError: 415 unless the content type is JSON or the content coding is supported, 413 over `limit`
            bytes (decoded), 400 for a body its coding does not match, bad JSON (also nested too deeply, or with
            an integer of more than 4300 digits) or a body that is not an object.
    """
    kind = media_type(request)
    if not _JSON_TYPE.match(kind):
        shown = f"'{kind}'" if kind else "no Content-Type"
        raise OpenAIError(415, f"Unsupported media type {shown}: send the body as application/json",
                          "invalid_request_error", None, "unsupported_media_type")
    return parse_json_object(await read_body(request, limit))


def parse_json_object(data: bytes) -> dict:
    """`data` parsed as a JSON object.

    Raises:
        OpenAIError: 400 for bad JSON or a value that is not an object.
    """
    try:
        body = json.loads(data)
    except RecursionError:  # e.g. 100,000 '[': the decoder recurses once per level
        raise invalid("We could not parse the JSON body of your request: it is nested too deeply", None,
                      "invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        reason = str(exc).split(";")[0]  # the digit limit's advice (sys.set_int_max_str_digits) is not for clients
        raise invalid(f"We could not parse the JSON body of your request: {reason}", None, "invalid_json") from None
    if not isinstance(body, dict):
        shown = type(body).__name__ if body is not None else "null"
        raise invalid(f"the request body must be a JSON object, got {shown}", None, "invalid_body")
    return body
