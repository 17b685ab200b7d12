"""The engine is the one owner of row computation: every engine kind answers the Engine verbs, the
verb callers append rows with lives in the engine package, and the runtime's imports form no circle."""

import ast
import inspect
from pathlib import Path

import networkx as nx
import pytest
import torch

import kvmemory
from kvmemory import kvcache
from kvmemory.engine import Engine, engine_for, forward_rows
from kvmemory.engine.graphs import GraphDecoder
from kvmemory.engine.llama import QuantizedLlama
from kvmemory.engine.reference import TransformersEngine
from support import tiny_model

ENGINE_KINDS = (TransformersEngine, QuantizedLlama, GraphDecoder)
VERBS = [name for name in dir(Engine) if not name.startswith("_") and callable(getattr(Engine, name))]


@pytest.mark.parametrize("kind", ENGINE_KINDS, ids=lambda k: k.__name__)
def test_every_engine_kind_answers_the_engine_verbs_with_their_signatures(kind):
    assert set(VERBS) == {"unsupported_reason", "forward_rows", "refresh_rows", "gather_rows", "block_linears"}
    for verb in VERBS:
        expected = list(inspect.signature(getattr(Engine, verb)).parameters)
        assert list(inspect.signature(getattr(kind, verb)).parameters) == expected, (kind.__name__, verb)


def test_the_transformers_forward_and_the_graph_traversal_are_engines_that_agree():
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (12,))
    reference, graph = TransformersEngine(model), GraphDecoder(model, capture=False)
    assert isinstance(reference, Engine) and isinstance(graph, Engine)
    assert engine_for(model, kvcache.new_cache(model.config)).kind == "transformers"  # nothing attached
    caches = [kvcache.new_cache(model.config) for _ in range(2)]
    logits = [engine.forward_rows(cache, ids, 0, every_row=True) for engine, cache in zip((reference, graph), caches)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    rows = torch.tensor([0, 1, -1, 5])
    gathered = [engine.gather_rows(cache, rows) for engine, cache in zip((reference, graph), caches)]
    for (k, v), (k2, v2) in zip(*(kvcache.layer_tensors(g) for g in gathered)):
        torch.testing.assert_close(k2, k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v, atol=1e-5, rtol=1e-5)
    assert reference.refresh_rows(caches[0], ids[:2], torch.tensor([3, 11])) is None  # the packed executor runs it
    assert reference.block_linears(1) is None and graph.block_linears(1) is None
    assert reference.unsupported_reason(caches[0]) is None and graph.unsupported_reason(caches[1]) is None


def test_forward_rows_is_the_engine_verb():
    assert forward_rows.__module__ == "kvmemory.engine.registry"
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (6,))
    cache = kvcache.new_cache(model.config)
    torch.testing.assert_close(forward_rows(model, cache, ids, 0), TransformersEngine(model).forward_rows(
        kvcache.new_cache(model.config), ids, 0), atol=0, rtol=0)
    assert kvcache.cache_length(cache) == 6


def _runtime_imports() -> nx.DiGraph:
    """kvmemory's module graph: an edge for every import of another kvmemory module, at the top of
    a module or inside a function (an import hidden in a function still closes a circle);
    ``if TYPE_CHECKING`` imports do not run and are left out."""
    root = Path(kvmemory.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _executed_imports(ast.parse(path.read_text())):
            for target in _targets(node, package, modules):
                if target in modules and target != name:
                    graph.add_edge(name, target)
    return graph


def _executed_imports(tree: ast.AST):
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped]


def _targets(node, package: str, modules) -> list[str]:
    """The modules an import runs: ``from a import b`` runs ``a.b`` when that is a module, else ``a``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def test_the_runtime_imports_form_no_circle():
    graph = _runtime_imports()
    assert graph.number_of_nodes() > 50
    assert graph.has_edge("kvmemory.executors.sequential", "kvmemory.engine")  # the walk sees relative imports
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert circles == []
