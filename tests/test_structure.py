"""The code's structure, checked: no import cycles, no import running up a layer, every setting declared once,
every Triton tensor name and the operator's header spelt only in the vocabulary, every architecture named only in
the model registry and listed with its equivalence tests in docs/architecture.md, every Python model's finalize
ending in release_python_objects.

Layers, lowest first (a module may import its own layer and those below, never one above):

    foundation   kernels/, omni_backend/paths.py, omni_backend/settings.py
    ops          omni_backend/ops/
    engine       omni_backend/engine/, omni_backend/checkpoints.py
    vocabulary   omni_backend/vocabulary.py, tensor_names.py, operator_key.py
    stages       omni_backend/stages/
    serving      omni_backend/serving/, launch/, setup/, repository.py
    glue         model_repository/*/1/model.py, scripts/
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from omni_backend import repository, settings
from omni_backend import tensor_names as T
from omni_backend.engine.models import registry
from omni_backend.vocabulary import PROMPT_TENSORS, SAMPLING_FIELDS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "omni_backend"
LAYERS = (
    ("foundation", ("kernels", "omni_backend.paths", "omni_backend.settings")),
    ("ops", ("omni_backend.ops",)),
    ("engine", ("omni_backend.engine", "omni_backend.checkpoints")),
    ("vocabulary", ("omni_backend.vocabulary", "omni_backend.tensor_names", "omni_backend.operator_key")),
    ("stages", ("omni_backend.stages",)),
    ("serving", ("omni_backend.serving", "omni_backend.launch", "omni_backend.setup", "omni_backend.repository")),
    ("glue", ("model_repository", "scripts")),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    """Module name -> file, for omni_backend, kernels, the model glue and the scripts."""
    files = [*(ROOT / PACKAGE).rglob("*.py"), *(ROOT / "kernels").glob("*.py"),
             *(ROOT / "model_repository").glob("*/1/model.py"), *(ROOT / "scripts").glob("*.py")]
    return {module_name(p): p for p in files if "__pycache__" not in p.parts}


def import_graph(files: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the project modules it imports (`from a.b import c` counts as a.b.c when c is a module, else
    a.b; `import a.b` as a.b); relative imports resolved."""
    files = files or source_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> int:
    for level, (_, prefixes) in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return level
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def test_the_import_graph_has_no_cycles():
    graph = import_graph()
    assert len(graph) > 50 and graph["omni_backend.serving.app"], "the graph was not read"
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_runs_up_a_layer():
    graph = import_graph()
    upward = sorted(f"{source} ({LAYERS[layer_of(source)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})"
                    for source, targets in graph.items() for target in targets
                    if layer_of(target) > layer_of(source))
    assert upward == []


def test_the_layer_check_sees_an_upward_import():
    assert layer_of("omni_backend.ops.governor") < layer_of("omni_backend.vocabulary") < layer_of(
        "omni_backend.stages.llm.service")


# ---------------------------------------------------------------------------------------------------------
# Settings

def _templates() -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in (ROOT / "model_repository").glob("*/config.pbtxt")}


def setting_groups() -> list[type]:
    """Every settings dataclass of the package (`settings.SettingGroup` and its subclasses), every module imported."""
    import importlib
    import pkgutil

    import omni_backend

    for module in pkgutil.walk_packages(omni_backend.__path__, "omni_backend."):
        importlib.import_module(module.name)
    found, todo = [], [settings.SettingGroup]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def test_no_template_declares_a_setting_by_hand():
    """A model config gets an operator setting's value from its placeholder (or the llm's generated block), and
    any other declared setting from its declaration (an absent key keeps the default), never as a literal that
    would drift from the declaration."""
    names = set(repository.Settings.load(environ={}).as_strings())
    fields = {f.name for cls in setting_groups() for f, _ in settings.declared(cls)}
    assert {"max_steps", "max_image_bytes", "threads", "max_queued_requests"} <= fields, "the groups were not found"
    literal = re.compile(r'parameters\s*\{\s*key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')
    found = [(model, key, value) for model, text in _templates().items() for key, value in literal.findall(text)
             if (key in names or key in fields) and not re.fullmatch(r"\$\{\w+\}", value)]
    assert found == []
    assert "parameters {" not in re.sub(r"#.*", "", _templates()["llm"])  # the llm's block is generated


PARAMETER_DICTS = {"parameters", "setting", "settings", "params", "p"}  # names the glue gives string parameters


def test_no_module_redeclares_a_setting():
    """A class-level field named like a declared setting lives only in the class that declares it; a Python
    literal default for one (`parameters.get("threads", "0")`) would be a second declaration too."""
    groups = setting_groups()
    declaring = {cls.__module__ for cls in groups}
    names = {settings.operator_name(f, spec, prefix) for cls, prefix in repository.SETTING_GROUPS
             for f, spec in settings.declared(cls) if spec.operator}
    names |= {f.name for cls in groups for f, _ in settings.declared(cls)}
    found = []
    for module, path in source_files().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and module not in declaring:
                found += [f"{module}.{node.name}.{item.target.id}" for item in node.body
                          if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                          and item.target.id in names and item.value is not None]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and getattr(node.func.value, "id", None) in PARAMETER_DICTS and len(node.args) == 2 \
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in names:
                found.append(f"{module}:{node.lineno} .get({node.args[0].value!r}, <default>)")
    assert found == []


def test_the_settings_table_in_the_docs_is_the_declarations():
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert repository.settings_table() in docs, "run: python -m omni_backend.repository --table"


# ---------------------------------------------------------------------------------------------------------
# Tensor names and the operator's header

def config_tensor_names() -> set[str]:
    """Every input and output of the model configs and every name in the ensembles' maps (names starting with
    "_" are an ensemble's own, never seen outside its config)."""
    names = set()
    for text in _templates().values():
        text = re.sub(r"#.*", "", text)
        for block in re.findall(r"(?:input|output)\s*\[(.*?)\n\]", text, re.S):
            names.update(re.findall(r'name:\s*"(\w+)"', block))
        for key, value in re.findall(r'(?:input_map|output_map)\s*\{\s*key:\s*"(\w+)"\s*value:\s*"(\w+)"', text):
            names.update((key, value))
    return {name for name in names if not name.startswith("_")}


VOCABULARY_NAMES = ({value for name, value in vars(T).items() if name.isupper()}
                    | {f.tensor for f in SAMPLING_FIELDS} | set(PROMPT_TENSORS))
OWNERS = ("omni_backend.tensor_names", "omni_backend.vocabulary", "omni_backend.operator_key")
# Calls, and variables holding tensors by name, whose string arguments or keys are tensor names.
TENSOR_CALLS = {"Tensor", "get_input_tensor_by_name", "get_output_tensor_by_name", "InferInput",
                "InferRequestedOutput", "as_numpy", "one_value", "text_list", "FieldError", "_one_string"}
TENSOR_DICTS = {"arrays", "outputs", "tensors", "out", "prepared", "response", "phrase", "inputs"}


def holds_tensors(node) -> bool:
    """A variable that holds tensors by name: one of TENSOR_DICTS, or a name ending in one (`llm_inputs`)."""
    name = getattr(node, "id", None)
    return name is not None and (name in TENSOR_DICTS or name.endswith(tuple("_" + n for n in TENSOR_DICTS)))
ARRAY_MAKERS = {"array", "asarray", "zeros", "ones", "string_tensor", "ascontiguousarray", "full"}


def tensor_name_literals(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every string literal used as a tensor name: an argument of a tensor call, a key of a
    tensors-by-name variable, an element of a `*_NAMES` tuple, or a dict key whose value builds an array."""
    found = []

    def note(node) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append((node.lineno, node.value))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in TENSOR_CALLS:
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    note(arg)
            if func == "get" and isinstance(node.func, ast.Attribute) and holds_tensors(node.func.value) and node.args:
                note(node.args[0])
            for keyword in node.keywords:
                if keyword.arg == "requested_output_names" and isinstance(keyword.value, (ast.List, ast.Tuple)):
                    for element in keyword.value.elts:
                        note(element)
        elif isinstance(node, ast.Subscript) and holds_tensors(node.value):
            note(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and \
                any(holds_tensors(c) for c in node.comparators):
            note(node.left)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", "").endswith("NAMES") for t in node.targets) \
                and isinstance(node.value, (ast.Tuple, ast.List)):
            for element in node.value.elts:
                note(element)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(value, ast.Call):
                    func = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
                    if func in ARRAY_MAKERS:
                        note(key)
    return found


def test_every_tensor_of_the_model_configs_is_in_the_vocabulary_and_no_other():
    assert config_tensor_names() - VOCABULARY_NAMES == set()
    assert VOCABULARY_NAMES - config_tensor_names() == set()
    assert len(config_tensor_names()) > 50, "the configs were not read"


def test_no_module_spells_out_a_tensor_name_or_the_operator_header():
    names = config_tensor_names()
    found = []
    for module, path in source_files().items():
        if module in OWNERS:
            continue
        tree = ast.parse(path.read_text())
        found += [f"{module}:{line} {name!r}" for line, name in tensor_name_literals(tree, names)]
        found += [f"{module}:{node.lineno} {node.value!r} (operator_key)" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value.removeprefix("triton-grpc-protocol-") == "omni-admin-key"]
    assert found == []


def test_the_literal_finder_finds_literals():
    code = ('x = one_value(arrays, "text_output", str)\ny = {"input_ids": np.array([1])}\n'
            'INPUT_NAMES = ("prompt_embeds",)\nz = arrays["stream_key"]\nok = {"image": "kind"}\n'
            'llm_inputs["cancel"] = key\nw = response.get("finish_reason")\n')
    assert sorted(name for _, name in tensor_name_literals(ast.parse(code), config_tensor_names())) == [
        "cancel", "finish_reason", "input_ids", "prompt_embeds", "stream_key", "text_output"]


# ---------------------------------------------------------------------------------------------------------
# Architectures: named only in the model registry, each with its equivalence tests in docs/architecture.md

REGISTRY = "omni_backend.engine.models.registry"
ARCHITECTURE_SHAPE = re.compile(r"\w+For(?:CausalLM|ConditionalGeneration)\b")


def architecture_literals(tree: ast.AST, names: set[str], model_types: set[str]) -> list[tuple[int, str]]:
    """(line, literal) of every string outside a docstring that tells architectures apart: a registered name or
    its start (`name.startswith("Llava")`), anything shaped like `...ForCausalLM` / `...ForConditionalGeneration`,
    and a registered text model_type in a comparison (`config.model_type == "qwen2"`)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            value = node.value
            if ARCHITECTURE_SHAPE.search(value) or (len(value) >= 4 and value.isidentifier()
                                                    and any(name.startswith(value) for name in names)):
                found.append((node.lineno, value))
        elif isinstance(node, ast.Compare):
            found += [(c.lineno, c.value) for c in (node.left, *node.comparators)
                      if isinstance(c, ast.Constant) and c.value in model_types]
    return found


def _registered() -> tuple[set[str], set[str]]:
    return set(registry.ARCHITECTURES), {a.model_type for a in registry.ARCHITECTURES.values() if a.model_type}


def test_no_module_but_the_registry_tells_architectures_apart():
    found = [f"{module}:{line} {value!r}" for module, path in source_files().items() if module != REGISTRY
             for line, value in architecture_literals(ast.parse(path.read_text()), *_registered())]
    assert found == []


def test_the_architecture_finder_finds_names():
    code = ('"""Idefics3ForConditionalGeneration in a docstring is prose."""\n'
            'a = name == "LlavaForConditionalGeneration"\nb = name.startswith("Idefics3")\n'
            'c = {"MistralForCausalLM": 1}\nd = config.model_type != "qwen2"\ne = "qwen2"\nf = "Llama 3 rope"\n')
    assert sorted(architecture_literals(ast.parse(code), *_registered())) == [
        (2, "LlavaForConditionalGeneration"), (3, "Idefics3"), (4, "MistralForCausalLM"), (5, "qwen2")]


def registry_docs_rows() -> dict[str, list[str]]:
    """Architecture -> the test ids its row of docs/architecture.md's "Model registry" table lists."""
    section = (ROOT / "docs" / "architecture.md").read_text().split("\n## Model registry", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if match := re.match(r"\| `(\w+)` \|", line):
            rows[match.group(1)] = re.findall(r"`(tests/[\w/]+\.py::[^`]+)`", line)
    return rows


def test_every_registered_architecture_has_its_equivalence_tests_in_the_docs():
    """The "add an architecture" recipe's last step, kept: a row per registered architecture, and pytest collects
    every test the rows list."""
    rows = registry_docs_rows()
    assert sorted(rows) == sorted(registry.ARCHITECTURES)
    assert all(rows.values()), rows
    ids = [test for tests in rows.values() for test in tests]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert {line for line in out.stdout.splitlines() if "::" in line} == set(ids)


def _releases_in_finally(function: ast.FunctionDef) -> bool:
    """Whether `function` calls release_python_objects in the `finally` of a try (so a failing shutdown still
    releases)."""
    return any(isinstance(node, ast.Try) and any(
        isinstance(call, ast.Call) and getattr(call.func, "id", "") == "release_python_objects"
        for statement in node.finalbody for call in ast.walk(statement)) for node in ast.walk(function))


def _finalize_of(class_node: ast.ClassDef, imports: dict[str, str]) -> ast.FunctionDef | None:
    """The finalize a model.py class runs: its own, else the first one up its bases (classes of omni_backend)."""
    for node in class_node.body:
        if isinstance(node, ast.FunctionDef) and node.name == "finalize":
            return node
    for base in class_node.bases:
        module = imports.get(getattr(base, "id", ""))
        if module is None:
            continue
        source = ROOT.joinpath(*module.split(".")).with_suffix(".py")
        tree = ast.parse(source.read_text())
        module_imports = {alias.asname or alias.name: node.module for node in ast.walk(tree)
                          if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == base.id:
                found = _finalize_of(node, {**module_imports, **{c.name: module for c in tree.body
                                                                 if isinstance(c, ast.ClassDef)}})
                if found is not None:
                    return found
    return None


def test_every_python_model_releases_its_objects_when_it_finalizes():
    """tritonserver 2.51's stub segfaults destroying a pb_utils.MetricFamily left for the interpreter's exit
    (python_backend#429); every model.py's finalize ends in triton_glue.release_python_objects, in a finally."""
    models = sorted(ROOT.glob("model_repository/*/1/model.py"))
    assert models
    for path in models:
        tree = ast.parse(path.read_text())
        imports = {alias.asname or alias.name: node.module for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
        model = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "TritonPythonModel")
        finalize = _finalize_of(model, imports)
        assert finalize is not None and _releases_in_finally(finalize), f"{path}: finalize without release"


def test_the_release_check_sees_a_finalize_without_it():
    tree = ast.parse("def finalize(self):\n    try:\n        stop()\n    finally:\n        log()\n")
    assert not _releases_in_finally(tree.body[0])
    tree = ast.parse("def finalize(self):\n    try:\n        stop()\n"
                     "    finally:\n        release_python_objects(self)\n")
    assert _releases_in_finally(tree.body[0])
