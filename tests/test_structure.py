"""The shape of the package: imports run one way (no cycle, no layer importing a layer above it) and
only optional heavy dependencies are imported inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "sparkrl"

# Optional or heavy dependencies that may be imported where they are used (each only costs when needed).
# FSDP2 (torch.distributed.fsdp / .tensor): about a second of start-up, needed only by --shard-policy fsdp.
# torch.utils.cpp_extension: the compiled kernels' build (setuptools and the compiler tooling), loaded when first wanted
LAZY_OK = {"matplotlib", "transformers", "datasets", "pyarrow", "math_verify", "huggingface_hub",
           "torch.distributed.fsdp", "torch.distributed.tensor", "torch.utils.cpp_extension"}


def lazy_ok(module: str) -> bool:
    """A listed package or one of its submodules."""
    return any(module == m or module.startswith(m + ".") for m in LAZY_OK)

# Layers, bottom to top: a module may import only from its own layer or below.
LAYERS = [
    {"errors", "config", "native", "kernels", "logprobs", "model", "sampling", "weights", "rewards", "grpo", "checkpoint", "export", "machine", "precision",
     "distributed", "sharding", "__init__"},
    {"verify", "data", "features"},
    {"drafters.base", "drafters.tree", "drafters.eagle3", "drafters.dflash", "drafters.selfdraft", "drafters.__init__",
     "spark", "draft_train"},
    {"rollout", "budget"},
    {"speculative", "analysis"},
    {"build", "pretrain", "trainer"},
    {"bench", "trl_rollout"},
    {"cli", "__main__"},
]


def modules() -> dict[str, ast.Module]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name] = ast.parse(p.read_text(), str(p))
    return out


def internal_imports(tree: ast.Module, top_level_only: bool) -> set[str]:
    """sparkrl modules imported (drafters/__init__ as 'drafters.__init__')."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sparkrl"):
            mod = node.module[len("sparkrl."):] if node.module != "sparkrl" else "__init__"
            out.add(mod + ".__init__" if mod == "drafters" else mod)
        elif isinstance(node, ast.Import):
            out |= {a.name[len("sparkrl."):] for a in node.names if a.name.startswith("sparkrl.")}
    return out


def layer_of(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"sparkrl/{name}.py is in no layer of tests/test_structure.py: place it in LAYERS")


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
    assert not bad, "function-level imports (move them to the top, or list an optional dependency in LAZY_OK):\n" + \
        "\n".join(sorted(set(bad)))


def test_imports_run_one_way_down_the_layers():
    mods = modules()
    for name, tree in mods.items():
        for dep in internal_imports(tree, top_level_only=False):
            assert dep in mods, f"sparkrl/{name}.py imports unknown module sparkrl.{dep}"
            assert layer_of(dep) <= layer_of(name), f"sparkrl/{name}.py (layer {layer_of(name)}) imports " \
                                                    f"sparkrl.{dep} from the layer above it ({layer_of(dep)})"


def test_import_graph_has_no_cycle():
    graph = {name: internal_imports(tree, top_level_only=False) for name, tree in modules().items()}
    state: dict[str, int] = {}

    def visit(n, path):
        if state.get(n) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
        if state.get(n) == 2:
            return
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            visit(d, path + [n])
        state[n] = 2

    for n in graph:
        visit(n, [])
