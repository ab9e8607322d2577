"""The README smoke step of `scripts/test.sh`: run every command of README.md as a user would.

Starts `scripts/serve.sh` (on free ports, through the OMNI_*_PORT variables, so it runs beside other servers),
waits until the front door's `/health` says ready, runs each `bash` block's commands and each `python` block
with the README's ports replaced by these, checks the output the README shows in its `# ...` comments (`...`
stands for anything), then stops the server with Ctrl-C (SIGINT) and expects it to exit 0. `scripts/test.sh`,
the README's other command, is what runs this step.

Usage: python scripts/readme_smoke.py [--readme README.md] [--ready-timeout 900]
Exit status 0 when every command ran and printed what the README says.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

from omni_backend.launch.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
README_PORTS = {"9000": "OMNI_OPENAI_PORT", "8000": "OMNI_HTTP_PORT", "8001": "OMNI_GRPC_PORT",
                "8002": "OMNI_METRICS_PORT"}
LAUNCHERS = ("scripts/serve.sh", "scripts/test.sh")  # started by this step / running it


class Block(NamedTuple):
    """One fenced code block of the README: its language, text and first line number."""

    language: str
    text: str
    line: int


def blocks(readme: str) -> list[Block]:
    """The README's fenced code blocks."""
    found = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", readme, re.M | re.S):
        found.append(Block(match.group(1), match.group(2), readme[:match.start()].count("\n") + 1))
    return found


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """(command, expected output fragments) of a bash block: a command may continue over `\\` lines, and the
    `# ...` comment lines after it are its output, `...` standing for anything; the launchers are skipped.

    Raises:
        ValueError: a block in another language than bash or python.
    """
    if block.language == "python":
        expected = [m.group(1).strip() for m in re.finditer(r"print\(.*\)\s+#\s*(.+)$", block.text, re.M)]
        return [(block.text, expected)]
    if block.language != "bash":
        raise ValueError(f"README line {block.line}: a ```{block.language} block; the smoke step runs bash and "
                         "python blocks only")
    found: list[tuple[str, list[str]]] = []
    pending = ""
    for line in block.text.splitlines():
        if line.startswith("#") and found:
            found[-1][1].extend(part for part in line[1:].strip().split("...") if part)
            continue
        pending += line + "\n"
        if not line.endswith("\\"):
            if pending.strip() and pending.strip() not in LAUNCHERS:
                found.append((pending, []))
            pending = ""
    return found


def with_ports(text: str, ports: dict[str, int]) -> str:
    """`text` with the README's ports (localhost:9000, ...) replaced by this run's."""
    return re.sub(r"localhost:(\d{4})\b", lambda m: f"localhost:{ports.get(m.group(1), m.group(1))}", text)


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"scripts/serve.sh exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} was not ready within {timeout_s:.0f} s")


def run(block_command: str, expected: list[str], python: bool, ports: dict[str, int]) -> str | None:
    """Run one command; None when it printed every expected fragment in order, else what went wrong."""
    source = with_ports(block_command, ports)
    argv = [sys.executable, "-c", source] if python else ["bash", "-c", source]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    if result.returncode != 0:
        return f"exit status {result.returncode}: {result.stderr[-1000:]}"
    position = 0
    for fragment in expected:
        found = result.stdout.find(fragment, position)
        if found < 0:
            return f"output lacks {fragment!r}: {result.stdout[-1000:]}"
        position = found + len(fragment)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    readme = Path(args.readme).read_text()
    planned = [(command, expected, block.language == "python") for block in blocks(readme)
               for command, expected in commands(block)]
    ports = dict(zip(README_PORTS, free_ports(len(README_PORTS))))
    env = dict(os.environ, **{README_PORTS[p]: str(port) for p, port in ports.items()})
    print(f"[readme-smoke] scripts/serve.sh on ports {ports}", flush=True)
    server = subprocess.Popen(["bash", str(ROOT / "scripts/serve.sh")], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    failures = []
    try:
        wait_ready(f"http://localhost:{ports['9000']}/health", server, args.ready_timeout)
        for command, expected, python in planned:
            problem = run(command, expected, python, ports)
            shown = command.strip().splitlines()[0][:100]
            print(f"[readme-smoke] {'ok  ' if problem is None else 'FAIL'} {shown}", flush=True)
            if problem is not None:
                failures.append(f"{shown}: {problem}")
    except RuntimeError as exc:
        failures.append(str(exc))
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)  # Ctrl-C, as the README says
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
                failures.append("scripts/serve.sh did not stop within 120 s of Ctrl-C")
    if server.returncode not in (0, None) and not failures:
        failures.append(f"scripts/serve.sh exited with {server.returncode} after Ctrl-C")
    for failure in failures:
        print(f"[readme-smoke] {failure}", file=sys.stderr)
    print(f"[readme-smoke] {len(planned)} commands, {len(failures)} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
