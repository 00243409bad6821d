"""No import circles anywhere in the repository, at module level or inside functions.

A circle works until someone reorders two imports; an import inside a function hides one from module-level
checks, and it is the same circle. Each module's imports are read from its source (every ``import`` statement,
however deep), resolved to the repository's own modules, and the graph must have no cycle. A module's implied
import of its own parent packages is not an edge (Python imports a package before its children by design).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"agentopsd": "agentopsd", "envs": "agentopsd.envs", "callbacks": "agentopsd.callbacks"}
"""Top-level folders and the dotted names their files import as (envs/ and callbacks/ install under agentopsd)."""
FLAT = ("scripts", "studies", "benchmarks", "tests")
"""Folders whose files import their siblings by bare name (the folder is on ``sys.path`` when they run)."""


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every Python module of the repository by the dotted name it imports as."""
    found: dict[str, Path] = {}
    for top, dotted in PACKAGES.items():
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root / top).with_suffix("")
            if top == "agentopsd" and rel.parts[0] in ("envs", "callbacks", "conf"):
                continue  # links to the top-level folders, read there
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([dotted, *parts])] = path
    for flat in FLAT:
        for path in sorted((root / flat).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            found[".".join(p for p in rel.parts if p != "__init__")] = path
    return found


def imports_of(name: str, path: Path, files: dict[str, Path], root: Path = ROOT) -> set[str]:
    """The repository modules ``name`` (at ``path``) imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    flat_dir = path.parent
    targets: set[str] = set()

    def resolve(dotted: str) -> str | None:
        """The longest repository module ``dotted`` names (an attribute import names its module)."""
        while dotted:
            if dotted in files:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    def bare(mod: str) -> str | None:
        """``import sibling`` from a flat folder (scripts/, benchmarks/, tests/)."""
        first = mod.split(".")[0]
        if (flat_dir / f"{first}.py").exists() or (flat_dir / first / "__init__.py").exists():
            prefix = ".".join(flat_dir.relative_to(root).parts)
            return resolve(f"{prefix}.{mod}")
        return None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = resolve(alias.name) or bare(alias.name)
                if hit:
                    targets.add(hit)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                # `from pkg import sub` imports the submodule when there is one
                full = f"{mod}.{alias.name}"
                hit = full if full in files else (resolve(mod) if not node.level and mod.split(".")[0] in
                                                   ("agentopsd", "tests", "scripts", "studies", "benchmarks") else None)
                hit = hit or resolve(mod) or (bare(mod) if not node.level else None)
                if hit:
                    targets.add(hit)
    ancestors = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
    return {t for t in targets if t != name and t not in ancestors}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
    return {name: imports_of(name, path, files, root) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; a self-import counts too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        # iterative DFS: the graph has hundreds of modules and recursion depth is not the point here
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            advanced = False
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_repository_has_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles (move the shared name down to the lower module): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_checker_sees_a_circle_inside_a_function(tmp_path):
    """The checker itself: two modules importing each other, one of them only inside a function, form a circle;
    a child importing its own package does not."""
    pkg = tmp_path / "agentopsd"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from agentopsd.b import thing\n")
    (pkg / "b.py").write_text("thing = 1\n\ndef later():\n    from agentopsd import a\n    return a\n")
    (pkg / "sub" / "__init__.py").write_text("from agentopsd.sub.leaf import x\n")
    (pkg / "sub" / "leaf.py").write_text("x = 1\n")
    for top in ("envs", "callbacks", *FLAT):
        (tmp_path / top).mkdir()
    graph = import_graph(tmp_path)
    assert graph["agentopsd.b"] == {"agentopsd.a"}
    assert cycles(graph) == [["agentopsd.a", "agentopsd.b"]]
    (pkg / "b.py").write_text("thing = 1\n")
    assert cycles(import_graph(tmp_path)) == []


def test_the_checker_reads_sibling_imports_of_scripts(tmp_path):
    for top in ("agentopsd", "envs", "callbacks", *FLAT):
        (tmp_path / top).mkdir()
    (tmp_path / "scripts" / "one.py").write_text("from two import helper\n")
    (tmp_path / "scripts" / "two.py").write_text("def helper():\n    import one\n")
    assert cycles(import_graph(tmp_path)) == [["scripts.one", "scripts.two"]]
