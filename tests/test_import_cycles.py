"""The project's modules import one another without cycles, along the layers of
docs/architecture.md ("Layout"), and core's pure modules (core/pure.py) import no grpc, no redis and
nothing of the services, the orchestrator or the CLI.

Every ``.py`` file of every package that pyproject.toml installs is parsed with ``ast``; every
``import`` and ``from ... import`` anywhere in it counts: module level, inside functions, and under
``if TYPE_CHECKING:`` too. A cycle that only a function-level or type-checking import closes is
still a cycle: it works today because of import order, and it ties two modules that should depend
one way. (Nothing in the package needs a TYPE_CHECKING import to break a cycle; when one would,
move the shared types down a layer instead.)

Module names come from pyproject's ``[tool.setuptools]`` packages and package-dir mapping
(``specdec.core`` lives in core/, ``specdec.draft`` in services/draft/, ...), read at test time.
"""
from __future__ import annotations

import ast
import tomllib
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

from specdec.core.pure import PURE_MODULES

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- modules
def package_dirs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Path]:
    """Installed package name -> its folder, as setuptools maps it: a package's own package-dir
    entry, else its nearest listed ancestor's folder plus the rest of the name."""
    setuptools = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = setuptools.get("package-dir", {})
    out = {}
    for package in setuptools["packages"]:
        parts = package.split(".")
        for n in range(len(parts), -1, -1):
            base = ".".join(parts[:n])
            if base in mapping:
                out[package] = ROOT / mapping[base] / Path(*parts[n:])
                break
        else:
            out[package] = ROOT / Path(*parts)
    return out


def project_modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every .py directly in each package's folder (subpackages are listed
    in pyproject themselves); a package's ``__init__.py`` is the package's own name."""
    modules = {}
    for package, folder in packages.items():
        assert (folder / "__init__.py").is_file(), f"{package}: no {folder / '__init__.py'}"
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imported_names(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """(absolute dotted name, line) for everything the file imports, anywhere in it. For
    ``from X import Y`` both X and X.Y are given (Y may be a submodule or just a name in X)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importing module's package, up level - 1 more
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            if not (is_package and base == module):  # a package's `from . import sub`: not itself
                yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def ancestors(name: str) -> list[str]:
    """"a.b.c" -> ["a", "a.b"]."""
    parts = name.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: first line}. Importing a.b.c runs a and a.b too, so
    those count, except the importer's own ancestors (already running when the importer runs)."""
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        own = set(ancestors(module))
        for name, line in imported_names(path, module):
            for dep in (*ancestors(name), name):
                if dep in modules and dep not in own and not (dep == module and name != module):
                    graph[module].setdefault(dep, line)
    return graph


# ----------------------------------------------------------------------------- cycles
def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in no particular order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    out.append(sorted(component))
    return out


def cycle_in(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """One cycle through the component's first module (shortest, by breadth-first search)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for dep in sorted(graph[node]):
                if dep == start:
                    return paths[node] + [start]
                if dep in members and dep not in paths:
                    paths[dep] = paths[node] + [dep]
                    nxt_frontier.append(dep)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle through {start} in {component}")


def describe(cycle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    return "\n    ".join(f"{a} ({modules[a].relative_to(ROOT)}:{graph[a][b]}) imports {b}" for a, b in zip(cycle, cycle[1:]))


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected component of more than one module, or of one that imports itself."""
    return [c for c in strongly_connected(graph) if len(c) > 1 or c[0] in graph[c[0]]]


# ----------------------------------------------------------------------------- tests
MODULES = project_modules(package_dirs())
GRAPH = import_graph(MODULES)


def test_the_walk_sees_the_whole_package():
    """A stale mapping would find nothing and pass: check it found every layer."""
    for package in ("specdec", "specdec.core", "specdec.draft", "specdec.target", "specdec.orchestrator", "specdec.v1"):
        assert package in MODULES, package
    assert len(MODULES) > 60, sorted(MODULES)
    # Function-level imports are edges too: the CLI imports the roles only inside its commands.
    assert "specdec.roles" in GRAPH["specdec.cli"]


def test_no_import_cycles():
    found = cycles(GRAPH)
    report = [f"{', '.join(c)}; one cycle among them:\n    {describe(cycle_in(c, GRAPH), GRAPH, MODULES)}" for c in found]
    assert not found, "import cycles (function-level and TYPE_CHECKING imports count):\n  " + "\n  ".join(report)


def imports_of(prefix: str) -> Iterable[tuple[str, str, int]]:
    for module, deps in GRAPH.items():
        if module == prefix or module.startswith(prefix + "."):
            for dep, line in deps.items():
                yield module, dep, line


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_core_imports_no_service_orchestrator_or_command():
    """The core never imports a service, the orchestrator or the CLI (the composition root);
    nor the adapters around the services (the gRPC edge, metrics, the client, the autoscaler)."""
    outward = ("specdec.draft", "specdec.target", "specdec.orchestrator", "specdec.cli", "specdec.cli_common",
               "specdec.roles", "specdec.bench", "specdec.rpc", "specdec.autoscale", "specdec.client", "specdec.metrics")
    bad = [f"{m} ({MODULES[m].relative_to(ROOT)}:{line}) imports {dep}" for m, dep, line in imports_of("specdec.core")
           if under(dep, outward) or dep.startswith("specdec.bench_")]
    assert not bad, "\n".join(bad)


def test_services_import_no_orchestrator_or_command():
    """Dependencies point one way, core <- services <- orchestrator <- CLI."""
    outward = ("specdec.orchestrator", "specdec.cli", "specdec.cli_common", "specdec.roles", "specdec.bench", "specdec.autoscale")
    bad = [f"{m} ({MODULES[m].relative_to(ROOT)}:{line}) imports {dep}"
           for service in ("specdec.draft", "specdec.target") for m, dep, line in imports_of(service)
           if under(dep, outward) or dep.startswith("specdec.bench_")]
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- pure modules
# What a pure module may not load, itself or through anything it imports: transports and stores...
IMPURE_PACKAGES = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "redis", "starlette", "uvicorn",
                   "httpx", "prometheus_client", "kubernetes", "transformers")
PURE_HOME = "specdec.core"  # ...and of the project, anything outside this package (services, orchestrator, CLI, rpc, v1)


def shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def impure_imports(pure: Iterable[str], modules: dict[str, Path], graph: dict[str, dict[str, int]],
                   home: str = PURE_HOME, impure: tuple[str, ...] = IMPURE_PACKAGES) -> list[str]:
    """Every forbidden import a pure module makes, itself or through the project modules it loads
    (its packages' ``__init__`` included), each as the chain of imports that reaches it."""
    project, found = home.split(".")[0], []
    for start in sorted(pure):
        # module -> (the module that imports it, line): the first way the walk reached it
        via: dict[str, tuple[str, int] | None] = {m: None for m in (*ancestors(start), start) if m in modules}
        queue = deque(via)

        def chain(module: str, name: str, line: int) -> str:
            steps = [f"{module} ({shown(modules[module])}:{line}) imports {name}"]
            while via[module] is not None:
                module, line = via[module]
                steps.append(f"{module} ({shown(modules[module])}:{line}) imports")
            return " ".join(reversed(steps))

        while queue:
            module = queue.popleft()
            lines = set()  # one finding a statement (``from X import Y`` gives X and X.Y)
            for name, line in imported_names(modules[module], module):
                if line not in lines and (under(name, impure) or
                                          (under(name, (project,)) and name != project and not under(name, (home,)))):
                    lines.add(line)
                    found.append(chain(module, name, line))
            for dep, line in graph[module].items():
                if dep not in via and under(dep, (home,)):
                    via[dep] = (module, line)
                    queue.append(dep)
    return found


def test_pure_modules_import_no_transport_store_service_or_command():
    """docs/architecture.md ("Layout"): the algorithms (core/pure.py) import no grpc and no redis,
    no service, orchestrator or command, directly, inside a function, or through another module."""
    pure = {f"{PURE_HOME}.{name}" for name in PURE_MODULES}
    assert pure <= MODULES.keys(), f"core/pure.py names modules that are not in core: {sorted(pure - MODULES.keys())}"
    bad = impure_imports(pure, MODULES, GRAPH)
    assert not bad, "pure modules load what they must not:\n  " + "\n  ".join(bad)


# ----------------------------------------------------------------------------- the checker itself
def test_the_checker_finds_a_cycle_closed_inside_a_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import thing\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "pkg" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.c\n")
    modules = project_modules({"pkg": tmp_path / "pkg"})
    graph = import_graph(modules)
    found = cycles(graph)
    assert sorted(map(tuple, found)) == [("pkg.a", "pkg.b"), ("pkg.c",)]
    assert cycle_in(["pkg.a", "pkg.b"], graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_the_purity_checker_follows_imports_through_other_modules_and_functions(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "core").mkdir()
    (tmp_path / "pkg" / "core" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "core" / "rule.py").write_text("from pkg.core import helper\n")
    (tmp_path / "pkg" / "core" / "helper.py").write_text("def f():\n    import redis.asyncio\n")
    (tmp_path / "pkg" / "core" / "clean.py").write_text("import math\nfrom pkg.core import errors\n")
    (tmp_path / "pkg" / "core" / "errors.py").write_text("")
    (tmp_path / "pkg" / "core" / "outward.py").write_text("def g():\n    from ..cli import main\n")
    (tmp_path / "pkg" / "cli.py").write_text("import grpc\n")
    modules = project_modules({"pkg": tmp_path / "pkg", "pkg.core": tmp_path / "pkg" / "core"})
    graph = import_graph(modules)
    assert impure_imports(["pkg.core.clean"], modules, graph, home="pkg.core", impure=("redis",)) == []
    (found,) = impure_imports(["pkg.core.rule"], modules, graph, home="pkg.core", impure=("redis",))
    assert found.startswith("pkg.core.rule (") and "pkg.core.helper (" in found and found.endswith("imports redis.asyncio"), found
    # Outside the pure modules' package, inside a function: the CLI (which imports grpc, never walked).
    flagged = impure_imports(["pkg.core.outward"], modules, graph, home="pkg.core", impure=("redis",))
    assert flagged and all("pkg.cli" in line for line in flagged), flagged


def test_pure_modules_import_only_pure_modules_of_the_core():
    """No model code either: a pure module's project imports are pure modules themselves (not the
    runners, KV caches, kernels or model loading of core/), so the set closes on itself."""
    pure = {f"{PURE_HOME}.{name}" for name in PURE_MODULES}
    bad = [f"{module} imports {dep} ({shown(MODULES[module])}:{line})" for module in sorted(pure)
           for dep, line in GRAPH[module].items() if under(dep, (PURE_HOME,)) and dep != PURE_HOME and dep not in pure]
    assert not bad, "pure modules import model runtime or adapters:\n  " + "\n  ".join(bad)
