"""The front door fuzzed from its own published schema (`GET /openapi.json`) with schemathesis, on the session's
server: the document is valid OpenAPI 3.1; every operation, positive and negative cases (serving/openapi.py states
the limits the routes check).

Checks: no 5xx (`not_a_server_error`); statuses, content types and JSON bodies as the document says
(`status_code_conformance`, `content_type_conformance`, `response_schema_conformance`); a request the schema allows
is accepted (`positive_data_acceptance`; not on Triton's `/v2`, whose answer depends on the named model: its path
parameter is any name) and one it forbids is refused (`negative_data_rejection`). Afterwards an
ordinary greedy chat request gets its exact answer (`followed_by_a_normal_request`).

Bounded by time: SCHEMA_FUZZ_S seconds (`OMNI_SCHEMA_FUZZ_S` raises it: fuzzing repeats until the time is spent),
one worker (schemathesis' threads tripped a hypothesis SystemError here), a fixed seed. Generations are kept short
and media parts get real files by tests/helpers/schema_fuzz_hooks.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from openapi_spec_validator import validate

pytestmark = pytest.mark.usefixtures("followed_by_a_normal_request")

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_FUZZ_S = int(os.environ.get("OMNI_SCHEMA_FUZZ_S") or 60)
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "positive_data_acceptance", "negative_data_rejection")
CONFIG = "\n".join([
    "[checks]", *(f"{name}.enabled = {'true' if name in CHECKS else 'false'}" for name in (
        *CHECKS, "response_headers_conformance", "use_after_free", "ensure_resource_availability",
        "missing_required_header", "ignored_auth", "unsupported_method")),
    "", "[[operations]]", 'include-path-regex = "^/v2"',
    "checks.positive_data_acceptance.enabled = false", ""])


def test_the_front_door_obeys_its_own_schema(front_door, tmp_path):
    document = requests.get(front_door.url + "/openapi.json", timeout=120).json()
    validate(document)  # OpenAPI 3.1, with the running pipeline's limits filled in
    operations = sum(method != "parameters" for path in document["paths"].values() for method in path)
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    command = [str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(config), "run",
               front_door.url + "/openapi.json", "--seed", "1", "--max-time", str(SCHEMA_FUZZ_S), "--workers", "1",
               "--request-timeout", "60", "--no-shrink", "--output-sanitize", "false"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "helpers.schema_fuzz_hooks",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True,  # its cache goes there
                         timeout=SCHEMA_FUZZ_S + 300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-12000:]
    assert re.search(rf"Tested: {operations}\b", out), out[-3000:]  # every operation ran
