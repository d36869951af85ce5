"""Dependencies run one way. Read from the source with `ast`, so a violation fails here
before it tangles the code: the generation core is a library, I/O never reaches into
the stages, and nothing but the CLI reaches the top layer (tune, bench)."""

import ast
import subprocess
import sys

from tests.conftest import REPO

PACKAGE = REPO / "pipeline"


def imports(path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def module(path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def offenders(files, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for f in files:
        bad = sorted(m for m in imports(f) if m.startswith(forbidden) or m in forbidden)
        if bad:
            out[module(f)] = bad
    return out


def test_the_generation_core_imports_no_config_ray_arrow_or_stages():
    core = sorted((PACKAGE / "generation").rglob("*.py"))
    assert len(core) >= 8
    assert offenders(core, ("pipeline.config", "pipeline.stages", "pipeline.runner", "ray", "pyarrow")) == {}


def test_io_never_imports_the_stages():
    io = [PACKAGE / f"{name}.py" for name in ("fs", "inputs", "sink", "report", "output", "lease", "ownership")]
    assert offenders(io, ("pipeline.stages", "pipeline.runner", "pipeline.generation")) == {}


def test_nothing_below_the_top_layer_imports_tune_or_bench():
    below = [f for f in PACKAGE.rglob("*.py")
             if (module(f).split(".") + [""])[1] not in ("tune", "bench", "cli", "__main__")]
    assert offenders(below, ("pipeline.tune", "pipeline.bench")) == {}
    # The two top-layer tools share what they need through lower layers (machine, report).
    assert offenders(sorted((PACKAGE / "tune").rglob("*.py")), ("pipeline.bench",)) == {}
    assert offenders([PACKAGE / "bench.py"], ("pipeline.tune",)) == {}


def test_pipeline_help_loads_neither_ray_nor_vllm():
    code = ("import sys; sys.argv = ['pipeline', '--help']\n"
            "from pipeline.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('ray', 'ray.data', 'vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
