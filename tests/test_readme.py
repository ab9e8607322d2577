"""README.md stays the front page (at most 150 lines), and every command in it is one the README smoke step of
scripts/test.sh runs (scripts/readme_smoke.py): a command added to the README without being run fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("readme_smoke", ROOT / "scripts" / "readme_smoke.py")
readme_smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_smoke)


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert text.startswith("# ")
    for doc in ("docs/api.md", "docs/architecture.md", "docs/operations.md", "docs/gpus.md", "docs/engine.md",
                "docs/benchmarks.md", "docker/README.md"):
        assert doc in text and (ROOT / doc).is_file(), doc


def test_every_readme_command_is_run_by_the_smoke_step():
    blocks = readme_smoke.blocks((ROOT / "README.md").read_text())
    languages = [block.language for block in blocks]
    assert languages.count("bash") >= 2 and languages.count("python") >= 1, languages
    planned = [command for block in blocks for command in readme_smoke.commands(block)]
    launchers = [line.strip() for block in blocks if block.language == "bash" for line in block.text.splitlines()
                 if line.strip() in readme_smoke.LAUNCHERS]
    assert sorted(launchers) == sorted(readme_smoke.LAUNCHERS)  # serve.sh is started by the step, test.sh runs it
    curl = next(command for command, _ in planned if command.startswith("curl"))
    assert "localhost:9000" in curl and "\\\n" in curl  # a continued line stays one command
    expected = dict(planned)
    assert any("The capital of France is Paris." in fragments for fragments in expected.values())


def test_ports_are_replaced_and_unknown_blocks_refused():
    assert readme_smoke.with_ports("curl localhost:9000/v1 localhost:8000/v2", {"9000": 1234}) == \
        "curl localhost:1234/v1 localhost:8000/v2"
    try:
        readme_smoke.commands(readme_smoke.Block("yaml", "a: 1\n", 3))
    except ValueError as exc:
        assert "line 3" in str(exc)
    else:
        raise AssertionError("a yaml block was accepted")
