"""The package is layered: a module never imports one above it, not even inside a function."""

import ast
from pathlib import Path

import dflash_hf

PACKAGE = Path(dflash_hf.__file__).parent
# (modeling, packed) <- (targets, kernels, hardware) <- generation <- evaluation <- (training, bench, embedded, export)
# <- cli
LAYERS = {
    "modeling_dflash": 0,
    "packed": 0,
    "targets": 1,
    "kernels": 1,
    "hardware": 1,
    "generation": 2,
    "evaluation": 3,
    "training": 4,
    "bench": 4,
    "embedded": 4,
    "export": 4,
    "cli": 5,
    "__init__": 6,
    "__main__": 6,
}


def _component(module: str) -> str:
    """`dflash_hf.generation.decoding` -> `generation`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    return "dflash_hf." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every dflash_hf module that `source` (the text of `module`) imports, wherever the statement is."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("dflash_hf")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("dflash_hf"):
                # `from . import x` imports the module x; `from .x import y`, the module x
                found |= {f"{name}.{alias.name}" for alias in node.names} if not node.module else {name}
    return found


def _sources():
    """The package's modules; `assets/` is package data (a shipped drafter's remote-code copy)."""
    return sorted(path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] != "assets")


def test_every_module_has_a_layer():
    components = {_component(_module_name(path)) for path in _sources()}
    assert components <= set(LAYERS), components - set(LAYERS)


def test_no_module_imports_a_higher_layer():
    violations = []
    for path in _sources():
        module = _module_name(path).removesuffix(".__init__")
        own = _component(_module_name(path))
        for imported in _imports(path.read_text(), module, is_package=path.name == "__init__.py"):
            other = _component(imported)
            if other != own and LAYERS[other] >= LAYERS[own]:
                violations.append(f"{path.relative_to(PACKAGE)} imports {imported}")
    assert not violations, "\n".join(violations)


def test_the_checker_sees_imports_inside_functions():
    source = "def f():\n    from ..cli import main\n    import dflash_hf.bench\n    from .. import embedded\n"
    assert _imports(source, "dflash_hf.generation.probe") == {"dflash_hf.cli", "dflash_hf.bench", "dflash_hf.embedded"}
