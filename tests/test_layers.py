"""The import graph of ``src/lessmem`` follows the layers of ``docs/architecture.md``.

Every ``import`` / ``from ... import`` in the package is read from the source (module level
and inside functions alike: a lazy import is still an arrow), then checked:

- no arrow from a lower layer to a higher one, and none between two packages of one layer;
- no circle among modules.

A subcommand module (``cli.py``, ``*_cli.py``) and the command line's own helpers
(``_cli*.py``, ``_console.py``) belong to the command-line layer whatever folder they sit
in: they are imported only when a subcommand runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lessmem"

# Lower number = lower layer. A module may import its own package and lower layers only.
LAYERS = {
    "base": 0,        # torch-free vocabulary: units, tier-spec grammar, GGUF rules, corpus
    "formats": 1,     # tensor <-> codes
    "kernels": 2,     # fused compute on quantized data
    "offload": 3,     # tiers, block storage
    "weights": 3,     # weight quantization (a sibling of offload: neither imports the other)
    "kvcache": 4,     # the KV caches (tiered one on top of offload)
    "decode": 5,      # the lean decode step (walks a model's layers over the caches and weights)
    "models": 6,      # loading models (uses weights for GGUF files, switches on the lean step)
    "plan": 7,        # arithmetic on paper (imports base only; torch-free)
    "eval": 8,        # measurement over everything below
    "serve": 8,       # the serving engine and server (a sibling of eval: neither imports the other)
    "facade": 9,      # ``lessmem/__init__``: public names resolved lazily (strings, no arrows)
    "cli": 10,        # the command line
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    name = parts[-1]
    if name in ("cli", "__main__", "_console") or name.endswith("_cli") or name.startswith("_cli"):
        return "cli"
    if len(parts) == 1:
        return "facade"
    return parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The lessmem modules ``path`` imports (``from pkg import name`` counts as ``pkg.name``
    when that is a module, else as ``pkg``)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "lessmem":
                continue
            named = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")]
            out.update(named or [target])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "lessmem")
    return out


def _is_module(name: str) -> bool:
    p = SRC.parent.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(SRC.rglob("*.py"))}


def test_layers_table_covers_every_package():
    names = {layer_of(m) for m in graph()}
    assert names <= set(LAYERS), f"packages without a layer: {sorted(names - set(LAYERS))}"


def test_no_arrow_to_a_higher_or_sibling_layer():
    bad = []
    for src, targets in graph().items():
        a = layer_of(src)
        for dst in sorted(targets):
            b = layer_of(dst)
            if b == a:
                continue
            if LAYERS[b] >= LAYERS[a]:
                bad.append(f"{src} ({a}) -> {dst} ({b})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_circle():
    g = graph()
    # a package's __init__ re-exporting its own modules is not a circle of dependencies
    def edges(m):
        return {t for t in g.get(m, ()) if t in g and not m.startswith(t + ".")}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges(m)):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_base_and_plan_import_no_torch():
    """``base`` imports no other lessmem layer and neither it nor ``plan`` imports torch."""
    for p in sorted(SRC.rglob("*.py")):
        mod = module_name(p)
        if layer_of(mod) not in ("base", "plan"):
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            assert not any(n.split(".")[0] in ("torch", "numpy") for n in names), f"{mod} imports {names}"
