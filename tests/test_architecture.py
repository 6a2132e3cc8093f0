"""The package's floor plan, checked: arrows one way (no import circle, function-level imports
included), cheap top-level imports, every public exception in ``sparkjet.errors``, the README's
imports working, and the snapshot store reaching storage only through its backend."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sparkjet

PACKAGE = Path(sparkjet.__file__).parent
README = Path(__file__).resolve().parents[1] / "README.md"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["sparkjet", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
COMPILED = {"sparkjet._native"}  # the extension: it imports only sparkjet.errors


def _known(name: str) -> str | None:
    """The package module a dotted name is, or is inside of (None: not the package's, or the
    compiled extension)."""
    if name in COMPILED:
        return None
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path):
    """(imported module, line, at module level) for each import of the package's own code,
    those under ``if TYPE_CHECKING:`` included (a module that needs another's type for its
    annotations depends on it: a circle of them is a design circle, broken by a Protocol);
    imports inside a module's ``__getattr__`` (PEP 562 lazy attributes, run only after the
    module is loaded) are left out."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and top \
                    and child.name == "__getattr__":
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    target = _known(alias.name)
                    if target:
                        yield target, child.lineno, top
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    target = (None if full in COMPILED else
                              full if full in MODULES else _known(base))
                    if target:
                        yield target, child.lineno, top
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            yield from visit(child, inner)

    yield from visit(tree, True)


def _graph(*, packages: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports. With ``packages``, also an edge to each
    package whose ``__init__`` runs before the module (the root package excepted: every
    import starts there)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, _, _ in _imports(module, path):
            if target != module:
                edges[module].add(target)
    if packages:
        for module in MODULES:
            parent = module.rpartition(".")[0]
            while parent and parent != "sparkjet":
                if parent in MODULES:
                    edges[module].add(parent)
                parent = parent.rpartition(".")[0]
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_the_circle_finder_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    assert _within_one_package(["p", "p.x", "p.y.z"])
    assert not _within_one_package(["p", "p.x", "q.y"])


def test_no_import_circle_among_the_package_modules():
    circles = _circles(_graph())
    assert not circles, "import circles (function-level imports included): " + "; ".join(
        " <-> ".join(c) for c in circles)


def _within_one_package(circle: list[str]) -> bool:
    return any(all(m == p or m.startswith(p + ".") for m in circle) for p in circle)


def test_no_circle_through_a_package_init():
    """A package's ``__init__`` runs before any of its modules: a module that imports one
    whose package ``__init__`` leads back to it is a circle at import time. A package whose
    ``__init__`` re-exports its own modules makes harmless circles inside the package; only
    those that leave it count."""
    circles = [c for c in _circles(_graph(packages=True)) if not _within_one_package(c)]
    assert not circles, "import circles through package __init__ modules: " + "; ".join(
        " <-> ".join(c) for c in circles)


def test_function_level_imports_of_the_package_say_why():
    """An import of the package's own code inside a function is there to save import cost
    (a heavy or optional dependency, or code that must load where it runs): a comment on its
    line or above it, in its group of imports, says so."""
    unexplained = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for target, lineno, top in _imports(module, path):
            if top or "#" in lines[lineno - 1]:
                continue
            above = lineno - 2
            while above >= 0 and (not lines[above].strip() or lines[above].lstrip().startswith(
                    ("import ", "from ", "#", ")")) or lines[above].rstrip().endswith(",")):
                if lines[above].lstrip().startswith("#"):
                    break
                above -= 1
            if above < 0 or not lines[above].lstrip().startswith("#"):
                unexplained.append(f"{path.relative_to(PACKAGE)}:{lineno} imports {target}")
    assert not unexplained, "function-level imports without a comment:\n" + "\n".join(unexplained)


@pytest.mark.parametrize("statement", ["import sparkjet", "import sparkjet.hash",
                                       "import sparkjet.errors",
                                       "from sparkjet import Pipeline, partition_ids"])
def test_top_level_imports_stay_cheap(statement):
    """``import sparkjet`` and ``import sparkjet.hash`` load neither the job runtime nor pyspark."""
    code = (f"{statement}\nimport sys\n"
            "print(sorted(m for m in sys.modules if m.startswith(('sparkjet.runtime', 'pyspark'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{statement} loaded {out.stdout.strip()}"


def test_lazy_top_level_names_resolve():
    for name in sparkjet.__all__:
        assert getattr(sparkjet, name) is not None


def _exceptions():
    """(module, name, class) of every public exception class defined in the package."""
    import importlib

    for module in sorted(MODULES):
        if module.endswith("__main__") or module == "sparkjet.campaign":
            continue
        mod = importlib.import_module(module)
        for name, value in vars(mod).items():
            if isinstance(value, type) and issubclass(value, BaseException) \
                    and not name.startswith("_") and value.__module__ == module:
                yield module, name, value


def test_every_public_exception_is_in_errors_under_the_one_base():
    from sparkjet.errors import SparkjetError

    elsewhere = [f"{m}.{n}" for m, n, _ in _exceptions() if m != "sparkjet.errors"]
    assert not elsewhere, f"public exceptions outside sparkjet.errors: {elsewhere}"
    loose = [n for m, n, cls in _exceptions()
             if not issubclass(cls, (SparkjetError, Warning))]
    assert not loose, f"exceptions not derived from SparkjetError: {loose}"


def _readme_imports() -> list[str]:
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    statements = set()
    for block in blocks:
        for line in block.splitlines():
            if re.match(r"(from sparkjet\S* import [\w, ]+|import sparkjet\S*)\s*(#.*)?$", line):
                statements.add(line.split("#")[0].strip())
    return sorted(statements)


def test_the_readme_has_imports_to_check():
    assert len(_readme_imports()) >= 10


@pytest.mark.parametrize("statement", _readme_imports())
def test_each_import_the_readme_uses_works(statement):
    namespace: dict = {}
    exec(statement, namespace)
    names = statement.split(" import ", 1)[1].split(",") if " import " in statement \
        else [statement.split()[1].split(".")[0]]
    for name in names:
        name = name.split(" as ")[-1].strip()
        assert namespace.get(name) is not None, f"{statement!r} bound no {name!r}"


def test_the_snapshot_store_reaches_storage_only_through_its_backend():
    """snapshot/store.py may touch files only through StorageBackend: no os, shutil,
    pathlib, pyarrow.fs or sparkjet._fs, and no builtin open()."""
    path = PACKAGE / "snapshot" / "store.py"
    tree = ast.parse(path.read_text())
    banned = {"os", "shutil", "pathlib", "pyarrow.fs", "sparkjet._fs", "tempfile", "io"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in banned]
        elif isinstance(node, ast.ImportFrom):
            if node.module in banned or any(f"{node.module}.{a.name}" in banned
                                            for a in node.names):
                found.append(node.module)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "open":
            found.append(f"open() at line {node.lineno}")
    assert not found, f"the store reaches storage around its backend: {found}"


def test_a_store_runs_on_another_backend(tmp_path):
    """The seam: a store over a StorageBackend of another kind (here one that counts the
    operations it serves) writes, commits and restores without knowing what it is on."""
    import collections

    import pyarrow as pa

    from sparkjet.snapshot import SnapshotStore
    from sparkjet.snapshot.backend import FileSystemBackend, StorageBackend

    calls = collections.Counter()

    class Counting(FileSystemBackend):
        def __getattribute__(self, name):
            if name in StorageBackend.__abstractmethods__:
                calls[name] += 1
            return super().__getattribute__(name)

    backend = Counting(str(tmp_path))
    assert isinstance(backend, StorageBackend)
    store = SnapshotStore(backend, job_id=5)
    store.register_execution(1)
    writer = store.writer(snapshot_id=0, execution_id=1)
    table = pa.table({"key": pa.array(range(100), pa.int64()), "n": pa.array(range(100))})
    writer.write_table("counts", table, key="key")
    store.commit(0, 1, [writer.finish()])
    restored = store.restore("counts").table
    assert restored.sort_by("key").equals(table)
    assert calls["create_exclusive"] >= 2 and calls["open_write"] >= 1 and calls["read"] >= 1
    assert SnapshotStore.jobs(backend) == [5]


#: Dotted names the docs may show that are not Python objects: a logger, and the names
#: under which Cython code cimports the C API.
NOT_PYTHON = {"sparkjet.job", "sparkjet._merkle", "sparkjet.libsparkjet"}


@pytest.mark.parametrize("doc", ["README.md", "ARCHITECTURE.md", "bench/README.md"])
def test_every_module_and_name_the_docs_show_exists(doc):
    """A name like `sparkjet.snapshot.store.SnapshotStore` in the docs resolves to a module
    and attribute of the package (docs that name moved code mislead)."""
    import importlib

    text = (README.parent / doc).read_text()
    missing = []
    # (a name followed by "→" is an old name, shown with its new one)
    for name in sorted(set(re.findall(r"`(sparkjet(?:\.[A-Za-z_]\w*)+)`(?! →)", text)) - NOT_PYTHON):
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:k]))
                break
            except ImportError:
                continue
        try:
            for attr in parts[k:]:
                obj = getattr(obj, attr)
        except AttributeError:
            missing.append(name)
    assert not missing, f"{doc} names what does not exist: {missing}"


@pytest.mark.parametrize("doc", ["README.md", "ARCHITECTURE.md"])
def test_every_source_file_the_docs_name_exists(doc):
    root = README.parent
    text = (root / doc).read_text()
    named = set(re.findall(r"`((?:pysrc/sparkjet/|native/|bindings/|bench/|tests/)[\w/.-]+\.\w+)`", text))
    for p in re.findall(r"`([\w/]+\.py)`", text):
        if p.startswith("sparkjet/"):
            named.add(f"pysrc/{p}")
        elif "/" in p and not p.startswith(("pysrc/", "tests/", "bench/")):
            named.add(f"pysrc/sparkjet/{p}")    # ARCHITECTURE.md names modules by package path
        elif "/" not in p and not (root / p).exists() and not any(PACKAGE.rglob(p)):
            named.add(p)
    missing = sorted(p for p in named if not (root / p).exists())
    assert not missing, f"{doc} names files that do not exist: {missing}"
