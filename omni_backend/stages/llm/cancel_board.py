"""Cancels by key that have not found their generation yet.

The streaming entry points end a generation by sending the llm model a `cancel` request carrying the generation's
`stream_key` (stages/llm/triton_io.py). Two things can make that request miss: it can overtake the generation it
names (the entry point's watch sent it before the generation reached the engine), and with one llm instance per GPU
(`device: cuda`, a KIND_GPU instance group) Triton hands it to any instance, not the one holding the generation.
So a cancel that finds nothing is kept for REMEMBER_S, and posted as an empty file named after its key in a folder
that every llm instance of the same tritonserver reads (`shared_folder`); the instance that holds the generation, or
comes to hold it within that time, ends it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Iterable

REMEMBER_S = 30.0  # longer than a request waits for its generation to start in any queue seen here


def shared_folder() -> Path:
    """The folder the llm instances of the tritonserver that started this stub process (its parent) share:
    `/dev/shm/omni-llm-cancels-<server pid>` (tmpfs: no disk writes), else under the temp folder."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"omni-llm-cancels-{os.getppid()}"


def _name(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).hexdigest()[:32]


class CancelBoard:
    """Keys cancelled here or (with `folder`) by another instance that no held request has answered yet.

    Args:
        folder: the instances' shared folder (`shared_folder`), created if missing; None: this process only.
        remember_s: how long an unanswered cancel is kept.
    """

    def __init__(self, folder: Path | None = None, remember_s: float = REMEMBER_S):
        self.folder, self.remember_s = folder, remember_s
        self._posted: dict[str, float] = {}  # file name -> time.monotonic() when posted here
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)

    def post(self, key: str) -> None:
        """A cancel for `key` found no held request here."""
        name = _name(key)
        self._posted[name] = time.monotonic()
        if self.folder is not None:
            try:
                (self.folder / name).touch()
            except OSError:  # the folder is gone (the server is stopping): this process still remembers it
                pass

    def claim(self, held: Iterable[str]) -> list[str]:
        """The held request ids a remembered or posted cancel names; those cancels are used up. Forgets cancels
        older than `remember_s`."""
        now = time.monotonic()
        self._posted = {name: at for name, at in self._posted.items() if now - at < self.remember_s}
        posted = set(self._posted)
        if self.folder is not None:
            posted |= self._folder_names(now)
        if not posted:
            return []
        claimed = [request_id for request_id in held if _name(request_id) in posted]
        for request_id in claimed:
            name = _name(request_id)
            self._posted.pop(name, None)
            if self.folder is not None:
                (self.folder / name).unlink(missing_ok=True)
        return claimed

    def close(self) -> None:
        """Remove the shared folder if no instance has a cancel waiting there (the last one to stop removes it)."""
        if self.folder is not None:
            try:
                self.folder.rmdir()
            except OSError:  # not empty, or already gone
                pass

    def _folder_names(self, now: float) -> set[str]:
        names = set()
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return names
        wall = time.time()
        for entry in entries:
            try:
                if wall - entry.stat().st_mtime > self.remember_s:
                    os.unlink(entry.path)  # nobody held it in time
                else:
                    names.add(entry.name)
            except OSError:  # claimed by another instance meanwhile
                continue
        return names
