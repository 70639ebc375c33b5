"""The shape of the house: no import cycles, no private reach-ins, a light core import.

Import edges are read from the source with `ast`, every import counts: module
level, inside functions, and under `if TYPE_CHECKING:` (a cycle hidden behind a
guard is still a cycle in the design). `from a.b import c` depends on `a.b.c`
when that is a module, else on the package `a.b`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "agentkv": ROOT / "agentkv",
    "agentkv_langchain": ROOT / "integrations" / "agentkv_langchain",
    "agentkv_langgraph": ROOT / "integrations" / "agentkv_langgraph",
    "agentkv_bench": ROOT / "benchmarks" / "agentkv_bench",
}


def _modules() -> dict[str, Path]:
    """Dotted module name → file, for every project module."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _resolve(module: str, level: int, current: str, is_package: bool) -> str:
    if level == 0:
        return module
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `name` imports (anywhere in the file)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, name, is_package)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                targets.add(child if child in modules else base)
    edges = set()
    for target in targets:
        # `import a.b.c` of a module we do not know (a name): the nearest known module.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def import_graph() -> dict[str, set[str]]:
    """Project module → project modules it imports."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_graph_sees_function_level_and_type_checking_imports() -> None:
    graph = import_graph()
    assert "agentkv.lifecycle.manager" in graph["agentkv.backend.session"]
    # cli imports the benchmarks inside its commands, and they are edges too.
    assert any(m.startswith("agentkv_bench") for m in graph["agentkv.cli"])
    # `if TYPE_CHECKING:` imports count (the port names the table only there).
    assert "agentkv.lifecycle.table" in graph["agentkv.lifecycle.port"]


def test_the_product_never_imports_the_benchmarks() -> None:
    """Only the CLI's `bench` dispatch names the benchmark package; it installs apart."""
    graph = import_graph()
    offenders = sorted(
        (m, t)
        for m, targets in graph.items()
        if not m.startswith("agentkv_bench") and m != "agentkv.cli"
        for t in targets
        if t.startswith("agentkv_bench")
    )
    assert not offenders, f"product modules importing the benchmarks: {offenders}"


def test_the_product_packages_ship_no_workloads() -> None:
    """`pip install .` installs the product only: the benches' JSON lives in `benchmarks/`."""
    shipped = [ROOT / "agentkv", ROOT / "integrations"]
    data = sorted(str(p.relative_to(ROOT)) for folder in shipped for p in folder.rglob("*.json"))
    assert not data, f"workload or data files inside the product packages: {data}"


def test_the_cycle_finder_finds_a_loop() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles among project modules: " + "; ".join(" <-> ".join(c) for c in cycles)


PRIVATE_REACH = re.compile(r"\b(session|handler|parent|child|backend|manager|store)\._[a-z]\w*")


def test_no_private_reach_into_sessions_or_handlers() -> None:
    """No module touches another object's `_private` state (`session._x`, `handler._x`, ...)."""
    offenders = []
    for path in [*ROOT.joinpath("agentkv").rglob("*.py"), *ROOT.joinpath("integrations").rglob("*.py")]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if PRIVATE_REACH.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("heavy", ["matplotlib", "rich"])
def test_importing_the_core_does_not_import_benchmark_dependencies(heavy: str) -> None:
    loaded = f"any(m == {heavy!r} or m.startswith({heavy + '.'!r}) for m in sys.modules)"
    code = f"import sys, agentkv; print({loaded})"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "False", f"`import agentkv` imported {heavy}"


def test_lifecycle_modules_stay_small() -> None:
    sizes = {
        path.name: len(path.read_text(encoding="utf-8").splitlines())
        for path in ROOT.joinpath("agentkv", "lifecycle").glob("*.py")
    }
    assert max(sizes.values()) <= 350, sizes


MAX_MODULE_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    """A module that outgrows one reader's sitting is split (issue 12: no module over ~600 lines)."""
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in _modules().items()}
    offenders = {name: n for name, n in sorted(sizes.items()) if n > MAX_MODULE_LINES}
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines (split them): {offenders}"


LIFECYCLE = "agentkv.lifecycle"
PLACEMENT_PEERS = ("budget", "recall", "exact_recall")


def _lifecycle_graph() -> dict[str, set[str]]:
    """Lifecycle module → the lifecycle modules it imports (the package's `__init__` included)."""
    graph = import_graph()
    inside = {m for m in graph if m == LIFECYCLE or m.startswith(LIFECYCLE + ".")}
    return {m: graph[m] & inside for m in inside}


def test_the_lifecycle_sees_the_store_only_through_its_protocol() -> None:
    graph = import_graph()
    offenders = sorted(m for m in _lifecycle_graph() if "agentkv.store.kvstore" in graph[m])
    assert not offenders, f"lifecycle modules importing KVStore: {offenders}"
    for path in ROOT.joinpath("agentkv", "lifecycle").glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert ".physical" not in text, f"{path.name} reads the physical cache"
        assert "getattr(self.port" not in text, f"{path.name} looks a port service up by name"


def test_placement_peers_do_not_import_each_other() -> None:
    """Budget, recall and exact recall ask the placement service; the manager wires them."""
    graph = _lifecycle_graph()
    peers = {f"{LIFECYCLE}.{name}" for name in PLACEMENT_PEERS}
    crossings = sorted((m, t) for m in peers for t in graph[m] & peers)
    assert not crossings, f"placement peers importing each other: {crossings}"


def test_the_lifecycle_is_at_most_six_floors_high() -> None:
    """A module stands one floor above the highest module it imports; the ground floor imports none."""
    graph = _lifecycle_graph()
    floors: dict[str, int] = {}

    def floor(module: str) -> int:
        if module not in floors:
            floors[module] = 1 + max((floor(m) for m in graph[module]), default=0)
        return floors[module]

    height = max(floor(m) for m in graph)
    assert height <= 6, sorted(floors.items(), key=lambda item: -item[1])


# -- tests go through the public API ---------------------------------------------------------------

PHYSICAL_READ = re.compile(r"\.physical\b")
MANAGER_REACH = re.compile(r"\.manager\.[a-z_]+")
PHYSICAL_READERS: dict[str, str] = {
    "tests/unit/test_architecture.py": "names the attribute it forbids",
    "tests/unit/test_attended_tier.py": "tests the store's attended quantized tier",
    "tests/unit/test_key_planes.py": "tests the store's key planes",
    "tests/unit/test_rehydration_mask.py": "tests the store's masks",
    "tests/unit/test_kvstore.py": "tests the KVStore and its physical cache",
    "tests/unit/store_accounting.py": "the independent oracle of the store's byte accounting",
    "tests/unit/test_faults.py": "the fault helper patches layers; a half-way quantization shows only there",
}
"""Test files that may read a store's physical cache (`.physical`): the store's own tests."""
MANAGER_READERS: dict[str, str] = {
    "tests/unit/test_architecture.py": "names the reach-in it forbids",
    "tests/unit/test_key_planes.py": "the placer's floor estimate against the store's key planes",
    "tests/unit/test_rehydration_mask.py": "the mask of the mover's eager recompute is the subject",
    "tests/unit/test_exact_recall.py": "the port's page recompute is the subject (and is made to fail)",
    "tests/unit/test_recompute_score.py": "a span marked recallable as budget pressure would leave it",
    "tests/unit/test_recall_floor.py": "a span marked recallable as budget pressure would leave it",
    "tests/unit/window_models.py": "recallable as budget pressure leaves it; the eager recompute of a window",
    "tests/unit/test_recall_words.py": "the port's background distribution is the subject",
    "tests/unit/test_faults.py": "the mover's eager recompute of an evicted span, which only recall reaches",
    "tests/unit/test_properties.py": "every mover move is recorded; evicted spans recomputed eagerly",
}
"""Test files that may reach into the lifecycle manager (`session.manager.x`), and why."""


def _test_files_matching(pattern: re.Pattern[str]) -> set[str]:
    return {
        str(path.relative_to(ROOT))
        for path in ROOT.joinpath("tests").rglob("*.py")
        if pattern.search(path.read_text(encoding="utf-8"))
    }


@pytest.mark.parametrize(
    ("pattern", "allowed"), [(PHYSICAL_READ, PHYSICAL_READERS), (MANAGER_REACH, MANAGER_READERS)]
)
def test_tests_reach_in_only_from_the_allow_list(pattern: re.Pattern[str], allowed: dict[str, str]) -> None:
    """Everything else asserts through the public API (stats, check, spans, the store protocol,
    events); an allowed file that no longer reaches in leaves the list, so it only shrinks."""
    found = _test_files_matching(pattern)
    assert not found - set(allowed), f"reach-ins outside the allow-list: {sorted(found - set(allowed))}"
    assert not set(allowed) - found, (
        f"allow-list entries that no longer reach in: {sorted(set(allowed) - found)}"
    )


MOVER = ROOT / "agentkv" / "lifecycle" / "mover.py"
MOVER_FIELDS = frozenset({"tier", "state"})
"""A span's fields that only the mover writes: where its KV is, and its lifecycle state."""


def _field_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """`(line, field)` of every assignment to an attribute in `MOVER_FIELDS`, and every `setattr` of one."""
    writes: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in MOVER_FIELDS
        ):
            writes.append((node.lineno, str(node.args[1].value)))
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Attribute) and target.attr in MOVER_FIELDS:
                writes.append((target.lineno, target.attr))
    return writes


def test_the_field_writes_finder_sees_assignments_tuples_and_setattr() -> None:
    tree = ast.parse("span.tier = t\na, b.state = x\nsetattr(span, 'tier', t)\nspan.kept = None\n")
    assert sorted(_field_writes(tree)) == [(1, "tier"), (2, "state"), (3, "tier")]


def test_only_the_mover_writes_a_span_s_tier_and_state() -> None:
    """`span.tier` and `span.state` change in one place: store verbs return the tier, the mover writes it."""
    offenders = []
    for path in [*ROOT.joinpath("agentkv").rglob("*.py"), *ROOT.joinpath("integrations").rglob("*.py")]:
        if path == MOVER:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        offenders += [f"{path.relative_to(ROOT)}:{line}: .{field} =" for line, field in _field_writes(tree)]
    assert not offenders, "span fields written outside the mover:\n" + "\n".join(offenders)


STORE_MOVE_VERBS = (
    "archive|restore_many|drop|compress|cut|adopt_recomputed|keep_attended|recompute_lazily"
    "|quantize_attended_until|coarsen_attended_until|recompute_pending"
)
STORE_MOVE_CALL = re.compile(rf"\bstore\.({STORE_MOVE_VERBS})\(")
MOVER_HELPERS = {MOVER, ROOT / "agentkv" / "lifecycle" / "rehydration.py"}
"""The mover and the rehydration helpers only it imports."""


def test_only_the_mover_calls_the_store_s_move_verbs() -> None:
    """Every move of KV between rungs goes through the mover (stores implement the verbs, never call them)."""
    offenders = []
    for path in [*ROOT.joinpath("agentkv").rglob("*.py"), *ROOT.joinpath("integrations").rglob("*.py")]:
        if path in MOVER_HELPERS or ROOT.joinpath("agentkv", "store") in path.parents:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if STORE_MOVE_CALL.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "store move verbs called outside the mover:\n" + "\n".join(offenders)
