"""A model never learns about the engine: no engine code (compiler/, runtime/) sets a model module's state; the
parallelizer wraps or hooks the model's modules instead."""

from __future__ import annotations

import ast

from tests.test_architecture import _our_modules

ENGINE_PACKAGES = ("compiler", "runtime")
_MODULE_BASES = ("Module", "nn.Module", "torch.nn.Module")


def model_module_classes(trees: list[ast.Module]) -> set[str]:
    """The names of the ``nn.Module`` subclasses defined in ``trees`` (directly or through one another)."""
    bases = {node.name: [ast.unparse(b) for b in node.bases]
             for tree in trees for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    modules: set[str] = set()
    while grown := {name for name, of in bases.items() if name not in modules
                    and any(b in _MODULE_BASES or b.rpartition(".")[2] in modules for b in of)}:
        modules |= grown
    return modules


def _is_none(value: ast.expr) -> bool:
    return isinstance(value, ast.Constant) and value.value is None


def _holds_modules(value: ast.expr, modules: set[str]) -> bool:
    """``value`` builds a submodule or a parameter: ``nn.Linear(...)``, ``SwiGLU(...) if w else None``."""
    if isinstance(value, ast.IfExp):
        branches = (value.body, value.orelse)
        return all(_is_none(v) or _holds_modules(v, modules) for v in branches) and not all(map(_is_none, branches))
    if isinstance(value, ast.Call):
        called = ast.unparse(value.func)
        return called.startswith(("nn.", "torch.nn.")) or called.rpartition(".")[2] in modules
    return False


def _assignments(tree: ast.AST):
    """(target, value) of every assignment in ``tree``: tuple targets unpacked, ``x.a += v`` as an assignment."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        stack = list(targets)
        while stack:
            target = stack.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                stack.extend(target.elts)
            else:
                yield target, value


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def model_state_names(trees: list[ast.Module]) -> set[str]:
    """Attributes a model module keeps as plain state: names a module class of ``trees`` sets on ``self`` with a
    value that is neither a submodule nor a parameter (None included: ``self.hook = None``), unless it is given a
    submodule or parameter elsewhere (None then stands for an absent submodule)."""
    modules = model_module_classes(trees)
    plain, held = set(), set()
    for tree in trees:
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef) and cls.name in modules:
                for target, value in _assignments(cls):
                    if isinstance(target, ast.Attribute) and _is_self(target.value):
                        (held if _holds_modules(value, modules) else plain).add(target.attr)
    return plain - held


def model_state_writes(tree: ast.Module, names: set[str]) -> list[str]:
    """Lines of ``tree`` that set one of ``names`` on an object other than ``self``: ``m.name = v``,
    ``m.name += v`` or ``setattr(m, "name", v)``."""
    found = [f"line {target.lineno}: {ast.unparse(target)} = ..." for target, _ in _assignments(tree)
             if isinstance(target, ast.Attribute) and target.attr in names and not _is_self(target.value)]
    found += [f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names
              and not _is_self(node.args[0])]
    return sorted(found, key=lambda line: int(line.split()[1].rstrip(":")))


def _parsed(package: str) -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in _our_modules().items()
            if name.split(".")[0] == package}


def test_the_engine_sets_no_state_on_a_model_module():
    """The parallelizer changes a model by wrapping or hooking its modules (torchtitan's ``parallelize_module``,
    ``fully_shard``, ``checkpoint_wrapper``), never by setting attributes the model then reads."""
    names = model_state_names(list(_parsed("models").values()))
    assert {"coef", "n_experts"} <= names, "the walker found none of the MoE block's own state"
    writes = {name: found for package in ENGINE_PACKAGES for name, tree in _parsed(package).items()
              if (found := model_state_writes(tree, names))}
    assert not writes, f"engine code sets a model module's state (wrap or hook the module instead): {writes}"


def test_the_model_state_check_sees_a_planted_write():
    models = ast.parse("class Block(nn.Module):\n    def __init__(self):\n        self.mlp = MLP()\n"
                       "        self.scale = 1.0\n        self.bias = nn.Parameter(x) if b else None\n"
                       "        self.hook = None\n        self.norm = None\n"
                       "class MLP(Block):\n    def forward(self, x):\n        self.seen = x\n"
                       "        self.norm = nn.LayerNorm(4)\n"
                       "class Plain:\n    def __init__(self):\n        self.kept = 1\n")
    assert model_state_names([models]) == {"scale", "seen", "hook"}
    engine = ast.parse("def apply(block):\n    block.scale = 2.0\n    block.mlp = Wrapper(block.mlp)\n"
                       "    block.mlp.seen += 1\n    setattr(block, 'scale', 3)\n    self.scale = 4\n"
                       "    a, block.seen = 1, 2\n")
    assert [w.split(":")[0] for w in model_state_writes(engine, model_state_names([models]))] == [
        "line 2", "line 4", "line 5", "line 7"]
