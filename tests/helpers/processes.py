"""Processes seen through /proc: whether one still runs, which run below another (tests that check for orphans)."""

from __future__ import annotations

import os
import time


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an exited process nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def gone(pid: int, within_s: float) -> bool:
    """Wait up to `within_s` seconds for process `pid` to end; whether it has."""
    deadline = time.monotonic() + within_s
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not running(pid)


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every process below `pid` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
    below, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - below
        below |= frontier
    lines = {}
    for child in below:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                lines[child] = cmdline.read().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):
            continue
    return lines
