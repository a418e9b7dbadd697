"""The shape of the package: imports run one way (no cycle, no layer importing a layer above it) and
only optional heavy dependencies are imported inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "sparkrl"

# Optional or heavy dependencies that may be imported where they are used (each only costs when needed).
# FSDP2 (torch.distributed.fsdp / .tensor): about a second of start-up, needed only by --shard-policy fsdp.
# torch.utils.cpp_extension: the compiled kernels' build (setuptools and the compiler tooling), loaded when first wanted
# vllm: an optional extra (sparkrl[vllm]), 10 s to import, only for --engine vllm and its plugin
LAZY_OK = {
    "matplotlib",
    "transformers",
    "datasets",
    "pyarrow",
    "math_verify",
    "huggingface_hub",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.utils.cpp_extension",
    "vllm",
}


def lazy_ok(module: str) -> bool:
    """A listed package or one of its submodules."""
    return any(module == m or module.startswith(m + ".") for m in LAZY_OK)


# Layers, bottom to top, by package: a module may import from its own package and from the layers below. Two
# packages in one layer do not import each other: the CPU layer is an add-on beside the drafters, and nothing
# below `train` (where `precision.inference_copy` composes it) imports it.
LAYERS = [
    {"errors", "config", "machine", "__init__"},  # what every layer reads
    {"model"},  # the Transformer, weights, export, log-probabilities: the reference semantics
    {"engine"},  # sampling, verification, AR and speculative rounds, budget, SPARK, records
    {"drafters", "cpu"},  # what proposes tokens; the CPU speed layer
    {"vllm"},  # sparkrl's drafters in vLLM: their export, the plugin
    {"train"},  # GRPO, data, trainer, draft training, checkpoints, ranks, assembly of a rollout
    {"commands"},  # the command line, bench, analysis, TRL adapter
    {"__main__"},  # python -m sparkrl
]


def package_of(name: str) -> str:
    """'model.transformer' -> 'model'; a top-level module is its own package."""
    return name.split(".")[0]


def modules() -> dict[str, ast.Module]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name] = ast.parse(p.read_text(), str(p))
    return out


def internal_imports(tree: ast.Module, top_level_only: bool) -> set[str]:
    """sparkrl modules imported, dotted below sparkrl ('cpu.native'; a package's own file as 'drafters.__init__')."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sparkrl"):
            mod = node.module[len("sparkrl.") :] if node.module != "sparkrl" else ""
            folder = ROOT.joinpath(*mod.split(".")) if mod else ROOT
            if folder.is_dir():  # `from sparkrl.cpu import native`: a module of the package, or its __init__'s names
                out |= {
                    f"{mod}.{a.name}".lstrip(".")
                    if (folder / f"{a.name}.py").exists()
                    else f"{mod}.__init__".lstrip(".")
                    for a in node.names
                }
            else:
                out.add(mod)
        elif isinstance(node, ast.Import):
            out |= {a.name[len("sparkrl.") :] for a in node.names if a.name.startswith("sparkrl.")}
    return out


def layer_of(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package_of(name) in layer:
            return i
    raise AssertionError(
        f"sparkrl/{name.replace('.', '/')}.py is in no layer of tests/test_structure.py: place its package in LAYERS"
    )


def test_no_function_level_imports_but_optional_heavy_ones():
    bad = []
    for name, tree in modules().items():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    roots = {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    roots = {node.module or ""}
                else:
                    continue
                if not all(lazy_ok(r) for r in roots):
                    bad.append(f"sparkrl/{name}.py:{node.lineno} imports {', '.join(sorted(roots))} inside {fn.name}")
    assert not bad, (
        "function-level imports (move them to the top, or list an optional dependency in LAZY_OK):\n"
        + "\n".join(sorted(set(bad)))
    )


def test_imports_run_one_way_down_the_layers():
    mods = modules()
    for name, tree in mods.items():
        for dep in internal_imports(tree, top_level_only=False):
            assert dep in mods, f"sparkrl/{name}.py imports unknown module sparkrl.{dep}"
            same = package_of(dep) == package_of(name) or layer_of(dep) == layer_of(name) == 0  # base modules
            assert same or layer_of(dep) < layer_of(name), (
                f"sparkrl.{name} (layer {layer_of(name)}) imports sparkrl.{dep} (layer {layer_of(dep)}): not below it"
            )


def test_the_model_and_the_engine_never_import_the_cpu_layer():
    """The eager model is the reference; the CPU layer is composed in from above (`cpu.accelerate`)."""
    for name, tree in modules().items():
        if package_of(name) in ("model", "engine"):
            bad = {d for d in internal_imports(tree, top_level_only=False) if package_of(d) == "cpu"}
            assert not bad, f"sparkrl.{name} imports {sorted(bad)}"


def test_import_graph_has_no_cycle():
    graph = {name: internal_imports(tree, top_level_only=False) for name, tree in modules().items()}
    state: dict[str, int] = {}

    def visit(n, path):
        if state.get(n) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(n) :] + [n]))
        if state.get(n) == 2:
            return
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            visit(d, path + [n])
        state[n] = 2

    for n in graph:
        visit(n, [])


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60


def test_modules_and_functions_stay_readable():
    """No module over 500 lines; no function over 60 unless its docstring says why it is one piece ("One piece:")."""
    bad = []
    for name, tree in modules().items():
        lines = len((ROOT / (name.replace(".", "/") + ".py")).read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            bad.append(f"sparkrl/{name.replace('.', '/')}.py has {lines} lines (at most {MAX_MODULE_LINES})")
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = fn.end_lineno - fn.lineno + 1
                if n > MAX_FUNCTION_LINES and "One piece:" not in (ast.get_docstring(fn) or ""):
                    bad.append(
                        f"sparkrl/{name.replace('.', '/')}.py: {fn.name} has {n} lines (at most "
                        f"{MAX_FUNCTION_LINES}, or say why in its docstring: 'One piece: ...')"
                    )
    assert not bad, "\n".join(bad)
