"""The house rules, checked: imports go down only (models <- compiler <- runtime <- commands <- run.py),
no import cycles, small modules, a short README whose code-layout section matches the tree."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from tests.paths import ROOT

PACKAGES = ("models", "compiler", "runtime")
MAX_MODULE_LINES = 400
MAX_README_LINES = 300


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _our_modules() -> dict[str, Path]:
    files = [ROOT / "run.py", *(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))]
    return {_module_name(p): p for p in files}


def layer(module: str) -> int:
    """models 0 < compiler 1 < runtime (the engine) 2 < runtime.commands and runtime.lab 3 < run 4."""
    if module == "run":
        return 4
    if module.split(".")[:2] in (["runtime", "commands"], ["runtime", "lab"]):
        return 3
    return {"models": 0, "compiler": 1, "runtime": 2}[module.split(".")[0]]


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of ours that ``path`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module itself.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            # ``import a.b.c`` loads a, a.b and a.b.c; the deepest of ours is what the code uses.
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _our_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_only_go_down_the_layers():
    upward = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
              for a, targets in import_graph().items() for b in sorted(targets) if layer(b) > layer(a)]
    assert not upward, "\n".join(upward)


def family_modules(modules) -> set[str]:
    """The modules of model families (models/<family>/...): everything in models/ but the registry and the
    spec protocol, which is all the rest of the code may import."""
    return {m for m in modules if m.startswith("models.") and m not in ("models.spec",)}


def test_nothing_outside_models_imports_a_family_module():
    graph = import_graph()
    families = family_modules(graph)
    assert families, "no model family modules found"
    leaks = [f"{a} imports {b}" for a, targets in graph.items() if not a.startswith("models")
             for b in sorted(targets & families)]
    assert not leaks, "import the registry (models) or the protocol (models.spec) instead:\n" + "\n".join(leaks)


SHARED_MODEL_CODE = "common"  # models/common/: parts the families share, not a family


def test_every_family_folder_is_registered():
    from models import FAMILIES

    folders = {p.name for p in (ROOT / "models").iterdir() if (p / "__init__.py").exists()} - {SHARED_MODEL_CODE}
    assert folders == set(FAMILIES), "a family is one folder of models/ and one registry entry"


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_checks_see_imports_inside_functions_and_cycles(tmp_path):
    # The walker must find function-level imports (the usual way to hide a cycle) ...
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from runtime.engine import step\n    import compiler.partition\n")
    modules = _our_modules()
    assert imports_of(source, modules) == {"runtime.engine.step", "compiler.partition"}
    # ... and the cycle finder must report a cycle when there is one.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("runtime.lab.study.cli") > layer("runtime.engine.step") > layer("compiler.cost") > layer("models.spec")


def test_modules_stay_small():
    big = {name: n for name, path in _our_modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES


def _layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Code layout", 1)[1]
    return section.split("```", 2)[1]


def layout_paths(block: str) -> set[str]:
    """Paths the layout block names. A folder at the start of a line ("runtime/") sets the top folder; a
    folder within a line ("engine/") prefixes the files after it on that line."""
    paths: set[str] = set()
    top = ""
    for line in block.splitlines():
        sub = ""
        for i, token in enumerate(re.findall(r"[\w./*-]+", line)):
            if not (token.endswith("/") or token.endswith((".py", ".json", ".md"))):
                continue
            if token.endswith("/") and i == 0 and not line.startswith(" "):
                top = token
                paths.add(top)
            elif token.endswith("/"):
                sub = token
                paths.add(top + sub)
            elif token == "run.py" or token.startswith(("models/", "compiler/", "runtime/", "tests/")):
                paths.add(token)
            else:
                paths.add(top + sub + token)
    return paths


def test_readme_code_layout_matches_the_tree():
    """Every folder and file the layout names exists, and every module of ours is named."""
    listed = layout_paths(_layout_block())
    assert "runtime/engine/step.py" in listed, "the README has no code layout block in the expected form"
    missing = sorted(p for p in listed if "*" not in p and not (ROOT / p).exists())
    assert not missing, f"the README's layout names paths that do not exist: {missing}"
    unlisted = sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                      if p.name != "__init__.py" and str(p.relative_to(ROOT)) not in listed)
    assert not unlisted, f"modules missing from the README's code layout: {unlisted}"


# --- private torch APIs: through compiler/torch_compat.py only ------------------------------------------

SHIM = "compiler.torch_compat"
_PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")  # _name, not __dunder__


def private_torch_uses(path: Path) -> list[str]:
    """Private torch modules or names ``path`` imports, and ``torch.<...>._name`` attributes it reads."""
    tree = ast.parse(path.read_text())
    roots, found = {"torch"}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            roots.update(a.asname or a.name for a in node.names)
            if any(_PRIVATE.match(p) for p in node.module.split(".")) or any(_PRIVATE.match(a.name) for a in node.names):
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and any(_PRIVATE.match(p) for p in alias.name.split(".")):
                    found.append(f"line {node.lineno}: import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _PRIVATE.match(node.attr):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in roots:
                found.append(f"line {node.lineno}: {base.id}.{'.'.join(reversed(chain))}")
    return found


def test_private_torch_apis_go_through_the_one_shim():
    """torch 2.11 and 2.13 differ in private internals: they are reached only in compiler/torch_compat.py."""
    uses = {name: found for name, path in _our_modules().items() if name != SHIM and (found := private_torch_uses(path))}
    assert not uses, f"private torch APIs outside {SHIM}: {uses}"


def test_the_private_api_check_sees_imports_and_attributes(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("import torch\nfrom torch.distributed.pipelining.schedules import _Action\n"
                      "from torch.distributed.tensor import _api\nx = torch._dynamo.config\ny = torch.nn.Linear\n")
    assert [use.split(":")[0] for use in private_torch_uses(source)] == ["line 2", "line 3", "line 4"]


# --- rooms by audience: users' commands, the lab, the planner ---------------------------------------------

def command_modules() -> set[str]:
    """The modules run.py dispatches to: training, the users' subcommands and the lab's."""
    import run

    return {run.TRAIN, *run.SUBCOMMANDS.values()}


def command_imports(graph: dict[str, set[str]], commands: set[str]) -> list[str]:
    """Imports of a command by any module of ours but run.py (a command imports flags and launch helpers, never
    another command)."""
    return [f"{a} imports {b}" for a, targets in graph.items() if a != "run" for b in sorted(targets & commands)]


def test_no_command_imports_another_command():
    commands = command_modules()
    assert {"runtime.commands.train", "runtime.commands.eval", "runtime.lab.study.cli"} <= commands
    leaks = command_imports(import_graph(), commands)
    assert not leaks, "share the code through a helper module instead:\n" + "\n".join(leaks)


def test_the_command_check_sees_a_planted_import():
    graph = {"run": {"runtime.commands.plan"}, "runtime.commands.train": {"runtime.commands.plan",
                                                                          "runtime.commands.flags"}}
    assert command_imports(graph, {"runtime.commands.plan", "runtime.commands.train"}) == [
        "runtime.commands.train imports runtime.commands.plan"]


# What a plain training run must not load: the lab, the planner's search and its tools, the other commands.
NOT_LOADED_BY_TRAINING = ("runtime.lab", "compiler.planner.search", "compiler.planner.auto", "compiler.planner.advice",
                          "compiler.planner.reproduce", "compiler.planner.published", "compiler.planner.measured",
                          "compiler.planner.validation", "compiler.planner.fit", "compiler.planner.block_benchmark",
                          "compiler.planner.precision_probe", "runtime.commands.auto", "runtime.commands.plan",
                          "runtime.commands.eval", "runtime.commands.export", "runtime.commands.generate",
                          "runtime.commands.tokenize", "runtime.tokenizer.chat")


def loaded_modules(module: str) -> list[str]:
    """Our modules a fresh interpreter holds after importing ``module`` (and run.py)."""
    code = (f"import sys, run, {module}; print('\\n'.join(m for m in sys.modules "
            f"if m.split('.')[0] in ('models', 'compiler', 'runtime')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def unwanted(loaded: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_the_training_command_loads_no_lab_search_or_other_command():
    loaded = loaded_modules("runtime.commands.train")
    assert "runtime.engine.build" in loaded and "compiler.planner.memory_model" in loaded  # what it does need
    assert not unwanted(loaded, NOT_LOADED_BY_TRAINING), "import it where it is used, not in the training command"


def test_the_loaded_module_check_sees_the_lab():
    assert unwanted(loaded_modules("runtime.lab.study.cli"), NOT_LOADED_BY_TRAINING)
