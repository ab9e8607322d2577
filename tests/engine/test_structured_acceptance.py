"""Issue 28's acceptance, smaller: scripts/structured_acceptance.py's workloads with the real SmolLM2 in one engine
(a nested JSON schema, and `tool_choice: "required"` with two tools; greedy and sampled, each workload one batch):
every answer parses and validates (jsonschema). The script runs all 50 prompts and records the result in
benchmarks/results/structured_acceptance.json; here COUNT of them keep the test short on a 2-core CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "structured_acceptance.py"
COUNT = 12


@pytest.fixture(scope="module")
def acceptance(smollm2_path):
    spec = importlib.util.spec_from_file_location("structured_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_schema_answer_and_every_required_tool_call_validates_greedy_and_sampled(acceptance):
    result = acceptance.run(acceptance.engine_for(COUNT), COUNT)
    for name, part in result.items():
        assert part["answers"] == 2 * COUNT and part["failures"] == [], name
        assert part["valid"] == 2 * COUNT
    # the sampled answers are not the greedy ones replayed
    assert result["json_schema"]["examples"]["greedy"] != result["json_schema"]["examples"]["sampled"]
    greedy = json.loads(result["json_schema"]["examples"]["greedy"])
    assert greedy["name"] == "Paris" and 1 <= len(greedy["landmarks"]) <= 2


def test_the_checks_refuse_what_the_schema_and_the_tools_do_not_allow(acceptance):
    from omni_backend.serving.tools import requested_tools

    ok = {"name": "Oslo", "kind": "city", "location": {"country": "Norway", "continent": "Europe"},
          "landmarks": [{"name": "Opera", "type": "monument"}], "population": 700000}
    assert acceptance.json_failures(json.dumps(ok), "stop") is None
    assert acceptance.json_failures(json.dumps({**ok, "kind": "hamlet"}), "stop").startswith("ValidationError")
    assert acceptance.json_failures(json.dumps({**ok, "landmarks": []}), "stop").startswith("ValidationError")
    assert acceptance.json_failures('{"name": "Oslo"', "length") == "finish_reason length"
    tools = requested_tools(acceptance.TOOLS, "required", False)
    call = '[{"name": "get_time", "arguments": {"city": "Oslo", "format": "24h"}}]'
    assert acceptance.tool_failures(tools, call, "stop") is None
    assert acceptance.tool_failures(tools, call.replace("24h", "25h"), "stop").startswith("ValidationError")
    assert acceptance.tool_failures(tools, "[]", "stop") == "finish_reason stop, 0 calls"
