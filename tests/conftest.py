"""Session fixtures every test may use: the tiny model, a real S3 server, Prometheus and its
Pushgateway. Tests under tests/integration/ (and tests/bench/test_systems.py) start real
engines and are marked `integration` here, by folder; tests/bench/ is marked `bench`."""

import os
import tempfile
from pathlib import Path

import pytest

from pipeline.models.tiny import cached_tiny_model, ensure_tiny_model
from tests.helpers.servers import S3, start_pushgateway

# The pipeline's cache (where `model.name: tiny` is built) is the session's own: tests never
# write into the user's, and every process they start inherits it.
_CACHE = tempfile.TemporaryDirectory(prefix="pipeline-test-cache-")
os.environ["PIPELINE_CACHE_DIR"] = _CACHE.name


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The offline test model, built once per session (a few seconds) where `model.name: tiny`
    finds it, so runs that name it and runs given this path share one build."""
    return ensure_tiny_model(cached_tiny_model("tiny"), seed=0)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's) on loopback, for the whole session; stopped
    by its handle. Its endpoint as `http://127.0.0.1:PORT`."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()




@pytest.fixture
def s3(s3_server, monkeypatch):
    import uuid

    store = S3(s3_server, f"test-{uuid.uuid4().hex[:12]}")
    for k, v in store.env.items():
        monkeypatch.setenv(k, v)
    return store


# --- Prometheus and its Pushgateway: Debian's packages, run on loopback ---------------












@pytest.fixture(scope="session")
def pushgateway(tmp_path_factory):
    """A Prometheus Pushgateway on loopback for the session: its base URL."""
    url, proc = start_pushgateway(tmp_path_factory.mktemp("pushgateway"))
    yield url
    proc.terminate()
    proc.wait(10)


HERE = Path(__file__).parent


# The modules that use the session's shared run (`job_run`, in tests/integration/conftest.py).
SHARED_RUN_MODULES = ("tests/integration/run/test_job.py", "tests/integration/observe/test_watch.py",
                      "tests/integration/run/test_report_schema.py", "tests/integration/run/test_nightly.py",
                      "tests/integration/observe/test_terminal.py")


# The slowest modules first, so that the two workers end together: the fast modules fill in
# at the end. By their time in a two-worker run (2 cores, AVX-512, 2026-12-02), longest first.
LONGEST_FIRST = (
    "tests/integration/run/test_adaptive.py",  # about 470 s
    "tests/integration/run/test_resume.py",  # 370 s
    "tests/integration/run/test_outliers.py",  # 320 s
    "tests/integration/storage/test_s3.py",  # 270 s
    "tests/integration/run/test_cluster.py",  # 345 s (a node's death, two jobs at once and a third that can't fit)
    *SHARED_RUN_MODULES,  # 290 s (night 2 killed and resumed since 2026-12-03)
    "tests/integration/generation/test_server_backend.py",  # 230 s alone (two vLLM server starts, three runs)
    "tests/integration/tools/test_tune.py",  # 180 s
    "tests/integration/run/test_faults.py",  # 150 s (a full disk; a store stalled while reading, then publishing)
    "tests/integration/run/test_real_model.py",  # 145 s
    "tests/bench/test_systems.py",  # 140 s
    "tests/integration/generation/test_transformers.py",  # 125 s
    "tests/integration/run/test_kb_ingest.py",  # 120 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Markers by folder: everything under integration/ starts real engines; bench/ tests
    the benchmark harness (its systems start engines too), and `make test` runs it all.
    Then the slowest modules first (`LONGEST_FIRST`), the rest in their order."""
    rank = {module: k for k, module in enumerate(LONGEST_FIRST)}
    order = {id(item): k for k, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.nodeid.split("::", 1)[0], len(rank)), order[id(item)]))
    for item in items:
        path = Path(item.fspath)
        if path.is_relative_to(HERE / "integration") or path.name == "test_systems.py":
            item.add_marker(pytest.mark.integration)
        if path.is_relative_to(HERE / "bench"):
            item.add_marker(pytest.mark.bench)
        module = item.nodeid.split("::", 1)[0]
        if "job_run" in getattr(item, "fixturenames", ()) and module not in SHARED_RUN_MODULES:
            raise pytest.UsageError(f"{module} uses job_run: add it to SHARED_RUN_MODULES in tests/conftest.py, "
                                    "so that the shared run is run once, in one worker")


@pytest.hookimpl(optionalhook=True)  # a plain `pytest -p no:xdist` has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`make test` runs two pytest-xdist workers, a module to a worker at a time (so that a
    module's fixtures are built once), and the modules of the shared run in one worker (so
    that it is run once). Two, because an engine's start is a chain of single-threaded
    imports (the engine actor's, then its engine core's, then its worker's): one run leaves
    the second core idle for most of its start, and a second worker's run fills it."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the collection's order: the slowest modules first

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "shared run" if module in SHARED_RUN_MODULES else module

    return ByModule(config, log)
