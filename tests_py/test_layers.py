"""The package's layering rule, checked on the source: every module has a
layer (docs/design.md draws them), imports go only to lower layers (so there
is no import circle), every import of the package is at the top of its module
(none hidden in a function), and no module reads another module's private
names."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "dino_opt"
sys.path.insert(0, str(PACKAGE.parent.parent / "scripts"))
import size_guide  # noqa: E402

LAYERS = {
    # L0: the native core, and the old module paths kept importable
    "dino_opt._C": 0,
    "dino_opt._compat": 0,
    # L1: foundations, each folder about one thing and needing only the core
    "dino_opt.ops": 1,  # operators' Python side, the DINO loss, the EMA, the schedules
    "dino_opt.models": 1,  # networks
    "dino_opt.checkpoint": 1,  # checkpoint files, manager, background writer, RNG state
    "dino_opt.runtime": 1,  # device, precision, process group, signals, hang watchdog
    # L2: images in; the configuration (pure: parsing never looks at a device)
    "dino_opt.data": 2,
    "dino_opt.config": 2,
    # L3: what watches a run: memory, profiler, health, run folder, log, plots, reports
    "dino_opt.observe": 3,
    # L4: the one-step engine and the config-to-objects builders
    "dino_opt.train": 4,
    # L5: tools around the engine: k-NN evaluation; speed-ups, batch search, presets
    "dino_opt.eval": 5,
    "dino_opt.tune": 5,
    # L6: weights in and out of other formats
    "dino_opt.weights": 6,
    # L7: the training job
    "dino_opt.job": 7,
    # L8: starting several processes of it (training, embedding); the install's self-check
    "dino_opt.distributed": 8,
    "dino_opt.doctor": 8,
    # faces: the one-call API, the course's names; the command line (cli/, one module
    # per command), the package; the torchrun entry
    "dino_opt.api": 9,
    "dino_opt.lessons": 9,
    "dino_opt.dinov2": 9,
    "dino_opt.dinov3": 9,
    "dino_opt.cli": 10,
    "dino_opt": 10,
    "dino_opt.train.__main__": 11,
}


def module_name(path: Path) -> str:
    parts = ["dino_opt", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer of a module: its own entry, else its subpackage's."""
    while module not in LAYERS:
        if "." not in module:
            raise KeyError(module)
        module = module.rsplit(".", 1)[0]
    return LAYERS[module]


def subpackage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def package_imports(path: Path):
    """(imported module, names, node, at module level) for every import of
    the package in ``path``."""
    me = module_name(path)
    here = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here.split(".")[: len(here.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dino_opt"):
            target = node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dino_opt"):
                    yield alias.name, [], node, id(node) in top
            continue
        else:
            continue
        names = [a.name for a in node.names]
        if node.module is None:  # `from . import x`: modules
            for name in names:
                yield f"{target}.{name}", [], node, id(node) in top
        else:
            yield target, names, node, id(node) in top


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    missing = [module_name(p) for p in SOURCES if _unplaced(module_name(p))]
    assert not missing, f"place these modules in LAYERS (and in docs/design.md): {missing}"


def _unplaced(module: str) -> bool:
    try:
        layer_of(module)
    except KeyError:
        return True
    return False


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_go_down_and_sit_at_the_top(path):
    me = module_name(path)
    problems = []
    for target, names, node, at_top in package_imports(path):
        where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        if not at_top:
            problems.append(f"{where}: import of {target} inside a function or class")
        same_package = subpackage(target) == subpackage(me) and me != "dino_opt"
        if not same_package and layer_of(target) >= layer_of(me):
            problems.append(
                f"{where}: {me} (layer {layer_of(me)}) imports {target} "
                f"(layer {layer_of(target)}), which is not below it"
            )
        private = [n for n in names if n.startswith("_") and n != "_C"]
        if private and not same_package:
            problems.append(f"{where}: imports private names {private} of {target}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_no_private_names_of_other_modules(path):
    """``module._name`` on a module of the package imported as a name."""
    tree = ast.parse(path.read_text(), str(path))
    modules = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level and node.module is None
        for alias in node.names
        if alias.name != "_C"
    }
    reads = [
        f"{path.name}:{n.lineno}: {n.value.id}.{n.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id in modules
        and n.attr.startswith("_")
    ]
    assert not reads, reads


def import_graph(sources) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a folder's ``__init__``
    counts as the folder)."""
    graph = {module_name(p): set() for p in sources}
    for path in sources:
        for target, _, _, _ in package_imports(path):
            if target in graph:
                graph[module_name(path)].add(target)
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path, or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*stack, node, nxt]
            if nxt not in state:
                found = visit(nxt, [*stack, node])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between folders (sub-packages and top-level modules)."""
    folders: dict[str, set[str]] = {}
    for me, targets in graph.items():
        if me == "dino_opt":
            continue
        edges = folders.setdefault(subpackage(me), set())
        edges |= {subpackage(t) for t in targets if subpackage(t) != subpackage(me)}
    return folders


def test_the_import_graph_has_no_circle():
    graph = import_graph(SOURCES)
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


def test_the_folders_import_each_other_without_a_circle():
    # The torchrun entry (train/__main__) is the face of its folder: it
    # starts the command line, above every folder.
    graph = import_graph([p for p in SOURCES if module_name(p) != "dino_opt.train.__main__"])
    circle = find_circle(folder_graph(graph))
    assert circle is None, " -> ".join(circle)


def test_the_size_guide_lists_long_files_and_functions(tmp_path):
    # The size guide (scripts/size_guide.py, printed by `make lint`) is a list
    # of places to look, never a failure: here, only that it finds them.
    fake = tmp_path / "dino_opt"
    fake.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(90))
    (fake / "long.py").write_text(
        f"class C:\n    def method(self):\n{body.replace('    ', '        ')}"
        f"def short():\n    return 1\n" + "\n" * 1000
    )
    (fake / "small.py").write_text(f"def f():\n{body[: 40 * len(body) // 90]}")
    files, functions = size_guide.places_to_look(fake)
    assert files == [f"dino_opt/long.py: {len((fake / 'long.py').read_text().splitlines())} lines"]
    assert functions == ["dino_opt/long.py:2: C.method, 91 lines"]


def test_the_checker_sees_a_circle(tmp_path, monkeypatch):
    fake = tmp_path / "dino_opt"
    (fake / "ops").mkdir(parents=True)
    (fake / "ops" / "a.py").write_text("from .b import x\n")
    (fake / "ops" / "b.py").write_text("from .a import y\n")
    (fake / "data").mkdir()
    (fake / "data" / "c.py").write_text("from ..ops import a\n")
    (fake / "ops" / "__init__.py").write_text("")
    (fake / "data" / "__init__.py").write_text("")
    (fake / "ops" / "d.py").write_text("from ..data import c\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    sources = sorted(fake.rglob("*.py"))
    circle = find_circle(import_graph(sources))
    assert circle is not None and set(circle) >= {"dino_opt.ops.a", "dino_opt.ops.b"}
    folders = find_circle(folder_graph(import_graph(sources)))
    assert folders is not None and set(folders) == {"dino_opt.ops", "dino_opt.data"}


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    # The rule's own check: a module that imports upwards, inside a function,
    # and a private name is reported on all three counts.
    # Folders: ops/ (layer 1) reaching up into job/ (layer 7).
    fake = tmp_path / "dino_opt"
    (fake / "ops").mkdir(parents=True)
    (fake / "ops" / "schedules.py").write_text(
        "from ..job import _secret\n\ndef f():\n    from ..config import Config\n"
    )
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    with pytest.raises(AssertionError) as e:
        test_imports_go_down_and_sit_at_the_top(fake / "ops" / "schedules.py")
    message = str(e.value)
    assert "not below it" in message
    assert "inside a function" in message
    assert "private names ['_secret']" in message


# Imports that may sit inside a function: optional dependencies only (an
# extra, or a package the feature does without).
OPTIONAL = {
    "wandb",
    "torchvision",
    "datasets",
    "pyarrow",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "timm",
    "mlflow",
    "pydicom",
}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_only_optional_dependencies_are_imported_inside_functions(path):
    tree = ast.parse(path.read_text(), str(path))
    top = set(map(id, tree.body))
    inner = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
            )
            inner += [
                f"{path.name}:{node.lineno}: {n}" for n in names if n.split(".")[0] not in OPTIONAL
            ]
    assert not inner, inner
