"""Turning Triton input arrays into Python values, with errors that name the tensor.

Triton hands a Python-backend model numpy arrays: STRING/BYTES tensors as object arrays of `bytes`, numeric
ones as arrays of their dtype. Per-request settings are shape [1] tensors. (What touches `pb_utils` itself is
`triton_glue.py`.)
"""

from __future__ import annotations

import numpy as np

from omni_backend.vocabulary import FieldError


def one_value(arrays: dict, name: str, kind: type, default=None):
    """The single value of the shape [1] tensor `name` as a Python `kind` (int, float, bool or str).

    Args:
        arrays: tensor name -> numpy array; an absent name gives `default`.
        name: tensor name (used in error messages).
        kind: Python type wanted; `str` decodes bytes as UTF-8.

    Raises:
        FieldError: the tensor holds more or fewer than one value, or str bytes are not UTF-8.
    """
    array = arrays.get(name)
    if array is None:
        return default
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise FieldError(name, f"must hold exactly one value, got {flat.size}")
    value = flat[0]
    if kind is str:
        return as_text(value, name)
    if kind is bool:
        return bool(value)
    if kind is int:
        if isinstance(value, (float, np.floating)):
            raise FieldError(name, f"must be an integer, got {value!r}")
        return int(value)
    return kind(value)


def text_list(arrays: dict, name: str) -> list[str] | None:
    """All values of the STRING tensor `name` as UTF-8 decoded strings, or None when absent.

    Raises:
        FieldError: a value is not valid UTF-8.
    """
    array = arrays.get(name)
    if array is None:
        return None
    return [as_text(value, name) for value in np.asarray(array, dtype=object).reshape(-1)]


def as_text(value, name: str) -> str:
    """Decode one STRING tensor element (bytes, or str when called from Python) strictly as UTF-8.

    Raises:
        FieldError: invalid UTF-8, naming the tensor and the first bad byte's position.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FieldError(
                name, f"is not valid UTF-8 (byte 0x{bytes(value)[exc.start]:02x} at offset {exc.start})"
            ) from None
    raise FieldError(name, f"must be a string, got {type(value).__name__}")


def string_tensor(*values: str) -> np.ndarray:
    """A 1-D object array of UTF-8 bytes, the form Triton expects for STRING outputs (shape [len(values)])."""
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)
