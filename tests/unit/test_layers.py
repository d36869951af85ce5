"""Dependencies run one way. The package's folders stand in one order, bottom first, and
each imports only the folders below it (and its own, without a cycle). Read from the
source with `ast`, every import counted: at the top or inside a function, absolute,
`from pipeline import x`, or relative. A violation fails here before it tangles the code."""

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "pipeline"

# Bottom first. Each line: the folder (or root module) and what it is.
LAYERS = [
    ("schema", "the row contract"),
    ("text", "pure text algorithms: buckets, lengths, annotations, synthetic prose"),
    ("config", "the job and profile models, and loading them"),
    ("generation", "the generation core: a library of engines, feeder, tasks, policies"),
    ("storage", "filesystems, inputs, parts, commits, the output, leases, ownership"),
    ("observe", "metrics, progress, the report and its plot, the machine"),
    ("models", "what model.name names, and the tiny model"),
    ("reuse", "earlier outputs proven ours, and the lookup of result keys in them"),
    ("stages", "the Ray Data stages, Arrow in and Arrow out"),
    ("run", "running a job on Ray: the job, plan, pool, learned limits"),
    ("tools", "tune, the offline corpus, the GPU check"),
    ("cli", "the command line"),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
ROOT_LAYERS = {"__init__": "schema", "__main__": "cli"}  # root modules that are not a layer of their own


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str:
    """The module an imported name lives in: `pipeline.storage.fs.write_bytes` -> `pipeline.storage.fs`."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def imports(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of the package (and every outside top-level package) `mod` imports."""
    found: set[str] = set()
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            # `from pipeline import schema` imports the module pipeline.schema; `from x import f`, module x.
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {resolve(n, known) or n.split(".")[0] for n in found if n}


def layer(mod: str) -> str:
    part = mod.split(".")[1] if "." in mod else "__init__"
    return ROOT_LAYERS.get(part, part)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_every_folder_and_root_module_has_its_place_in_the_order():
    places = {layer(m) for m in modules()}
    assert places - set(RANK) == set(), "a new folder: give it a line in LAYERS"


def test_each_folder_imports_only_the_folders_below_it():
    upward = {}
    for mod, targets in graph().items():
        above = sorted(t for t in targets if t.startswith("pipeline") and RANK[layer(t)] > RANK[layer(mod)])
        if above:
            upward[mod] = above
    assert upward == {}


def test_no_cycle_between_modules():
    deps = {m: {t for t in ts if t.startswith("pipeline.") and t != m} for m, ts in graph().items()}
    state: dict[str, int] = defaultdict(int)  # 0 unseen, 1 on the path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(deps.get(m, ())):
            if state[t] == 1:
                return path[path.index(t):] + [t]
            if state[t] == 0 and (cycle := visit(t)):
                return cycle
        state[m] = 2
        path.pop()
        return None

    for m in sorted(deps):
        if state[m] == 0:
            assert visit(m) is None, " -> ".join(path)


def test_the_generation_core_imports_no_config_ray_or_arrow():
    """Below config in the order, but a library all the same: it takes plain data."""
    core = {m: ts for m, ts in graph().items() if layer(m) == "generation"}
    assert len(core) >= 8

    def forbidden(t: str) -> bool:
        return t.split(".")[0] in ("ray", "pyarrow") or t.startswith("pipeline.config")

    assert {m: sorted(filter(forbidden, ts)) for m, ts in core.items() if any(map(forbidden, ts))} == {}


def test_nothing_in_the_package_imports_the_benchmarks():
    assert {m: sorted(ts) for m, ts in graph().items() if any(t.split(".")[0] == "bench" for t in ts)} == {}


def test_the_rules_catch_what_they_are_for(tmp_path):
    """The resolver sees `from pipeline import x`, relative imports and lazy ones."""
    known = {"pipeline.a.m": tmp_path, "pipeline.a.n": tmp_path, "pipeline.b": tmp_path, "pipeline.b.k": tmp_path}
    src = tmp_path / "m.py"
    src.write_text("from . import n\nfrom ..b import k\ndef f():\n    from pipeline import b\n    import ray.data\n")
    assert imports("pipeline.a.m", src, known) == {"pipeline.a.n", "pipeline.b.k", "pipeline.b", "ray"}


def test_pipeline_help_loads_neither_ray_nor_vllm():
    code = ("import sys; sys.argv = ['pipeline', '--help']\n"
            "from pipeline.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('ray', 'ray.data', 'vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers/ (and the fixtures in conftest.py)."""
    tests = REPO / "tests"
    known = {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in tests.rglob("test_*.py")}
    found = {m: sorted(t for t in imports(m, p, known) if t in known) for m, p in known.items()}
    assert {m: ts for m, ts in found.items() if ts} == {}
