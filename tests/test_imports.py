"""Imports flow one way: every module of `src/qinfer` imports only from its own layer or the
layers under it, and no two modules (nor two packages) import each other, even through
others. Every import counts: at the top of a file, inside a function (a lazy import is
still a dependency) and under `if TYPE_CHECKING:` (a type named is a type depended on).

The layers, from the bottom, each one package of `src/qinfer` (docs/ARCHITECTURE.md):

    core        errors, the model's config, features, checkpoint paths, the module base,
                a tensor-parallel rank's share; no other qinfer package
    kernels     the compiled CPU kernels (torch ops) and their loader
    linear      the Linear kinds
    models      the family adapters: config.json / GGUF keys -> ModelConfig
    weights     checkpoint readers; loading a built model's slots
    attention   attention arithmetic, its backends and their KV storage
    layers      norm, RoPE, MLP, MoE, the Attention layer (which calls a backend)
    model       the Transformer, the batch it runs, load_model
    lora        LoRA adapters read and held resident on a loaded model
    vision      images in: decoding, patches, the vision towers
    text        tokenizer, templates, prompts, detokenizer, reasoning
    analysis    looking into a model: inspection, heatmap, perplexity
    request     one request's decoding: sampling, grammar, stop strings, tool calls,
                scores, pooling, its state
    runtime     one step over the KV pools, on every rank (tensor-parallel groups too)
    engine      scheduling, blocks, speculation, the offline and async fronts, `generate`,
                the engine's command-line flags
    server      the HTTP APIs
    bench       `qinfer bench`
    cli         the `qinfer` command, and the package's face (`qinfer/__init__.py`,
                whose names load what they name on first use)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qinfer

SOURCE = Path(qinfer.__file__).parent

#: Layers from the bottom: the units (subpackages, root modules) each holds.
LAYERS = {
    "core": {"core"},
    "kernels": {"kernels"},
    "linear": {"linear"},
    "models": {"models"},
    "weights": {"weights"},
    "attention": {"attention"},
    "layers": {"layers"},
    "model": {"model"},
    "lora": {"lora"},
    "vision": {"vision"},
    "text": {"text"},
    "analysis": {"analysis"},
    "request": {"request"},
    "runtime": {"runtime"},
    "engine": {"engine"},
    "server": {"server"},
    "bench": {"bench"},
    "cli": {"cli", "qinfer"},  # "qinfer": the package's face, `qinfer/__init__.py`
}
FACE = "qinfer"
LEVEL = {unit: level for level, units in enumerate(LAYERS.values()) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, tuple[str, bool]]:
    """{module: (its source, whether it is a package's __init__)} of every file in src."""
    return {
        module_name(path): (path.read_text(), path.name == "__init__.py")
        for path in sorted(SOURCE.rglob("*.py"))
    }


def import_edges(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: the qinfer modules it imports}, every import statement of its source
    counted (relative ones resolved; `from package import name` is the submodule `name`
    where there is one, else the package)."""
    edges: dict[str, set[str]] = {}
    for module, (text, is_package) in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module.split(".")[: len(module.split(".")) - (not is_package)]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join([*package, *([base] if base else [])])
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    targets.add(name if name in modules else base)
        edges[module] = set()
        for target in targets:
            while target not in modules and "." in target:  # a name inside a module
                target = target.rsplit(".", 1)[0]
            if target in modules and target != module:
                edges[module].add(target)
    return edges


def unit(module: str) -> str:
    """The subpackage or root module `module` belongs to (FACE for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACE


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every import of a module into a higher layer than its own."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in edges.items()
        for b in targets
        if LEVEL[unit(b)] > LEVEL[unit(a)]
    )


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def unit_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same imports between units (a unit's own imports left out)."""
    graph: dict[str, set[str]] = {}
    for a, targets in edges.items():
        graph.setdefault(unit(a), set()).update(unit(b) for b in targets if unit(b) != unit(a))
    return graph


@pytest.fixture(scope="module")
def edges():
    return import_edges(sources())


def test_every_unit_has_a_layer(edges):
    assert sorted({unit(m) for m in edges} - set(LEVEL)) == []
    assert sorted(set(LEVEL) - {unit(m) for m in edges}) == []  # no stale entry


def test_imports_go_to_the_same_layer_or_down(edges):
    assert upward_imports(edges) == []


def test_no_import_circle_between_modules_or_packages(edges):
    assert circles(edges) == []
    assert circles(unit_graph(edges)) == []


@pytest.mark.parametrize(
    ("planted", "expected"),
    [
        (
            "from qinfer.engine.engine import Engine",
            "qinfer.attention.planted -> qinfer.engine.engine",
        ),
        ("from ..runtime import runner", "qinfer.attention.planted -> qinfer.runtime.runner"),
        ("import qinfer.server.app", "qinfer.attention.planted -> qinfer.server.app"),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from qinfer.model.transformer import Transformer",
            "qinfer.attention.planted -> qinfer.model.transformer",
        ),
        ("def f():\n    from qinfer import layers", "qinfer.attention.planted -> qinfer.layers"),
    ],
)
def test_a_planted_upward_import_is_found(planted, expected):
    """An attention module that imports from above (absolute, relative, plain, type-only,
    lazy) is reported; once `attention.sdpa` imports it, so is the circle it closes."""
    modules = sources()
    modules["qinfer.attention.planted"] = (planted, False)
    edges = import_edges(modules)
    assert upward_imports(edges) == [expected]
    sdpa = modules["qinfer.attention.sdpa"][0]  # what the layers and the model import
    modules["qinfer.attention.sdpa"] = (sdpa + "\nfrom qinfer.attention import planted\n", False)
    assert any("qinfer.attention.planted" in c for c in circles(import_edges(modules)))
