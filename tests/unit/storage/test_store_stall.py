"""An object store that stops answering (moto's S3 server in a process of its own, stopped
with SIGSTOP): every request through the pipeline's filesystems and its boto3 client fails
within the bound (`store.request_timeout_s` x STORE_ATTEMPTS), and succeeds if the store
comes back within it. A publish to it fails the same way and leaves the output as it was."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from pipeline.config.models import STORE_ATTEMPTS
from pipeline.storage.fs import read_bytes, resolve
from pipeline.storage.objectstore import S3Store
from pipeline.storage.output import OutputTarget, PublishError
from pipeline.run.job import store_unanswered
from tests.helpers.parts import JOB, run, stage
from tests.helpers.servers import S3, start_moto

TIMEOUT_S = 1.5
BOUND_S = STORE_ATTEMPTS * TIMEOUT_S + 6  # every try, plus the retry strategy's back-off and the client's


@pytest.fixture
def stoppable(tmp_path, monkeypatch):
    endpoint, proc = start_moto(tmp_path)
    store = S3(endpoint, "stall-test")
    for k, v in store.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PIPELINE_STORE_REQUEST_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setenv("PIPELINE_STORE_CONNECT_TIMEOUT_S", str(TIMEOUT_S))
    try:
        yield store, proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def timed(call):
    started = time.monotonic()
    try:
        return call(), time.monotonic() - started
    except Exception as e:
        return e, time.monotonic() - started


def test_reads_and_writes_to_a_stopped_store_fail_within_the_bound_and_succeed_if_it_comes_back(stoppable):
    store, proc = stoppable
    store.client.put_object(Bucket=store.bucket, Key="in/a.bin", Body=b"x" * 1000)
    fs, path = resolve(f"s3://{store.bucket}/in/a.bin")
    s3 = S3Store(fs)
    proc.send_signal(signal.SIGSTOP)

    failed, took = timed(lambda: read_bytes(fs, path))  # pyarrow, as Ray Data's reads and the sink
    assert isinstance(failed, OSError) and store_unanswered(failed), failed
    assert took <= BOUND_S
    failed, took = timed(lambda: s3.read(path))  # boto3, as the lease
    assert isinstance(failed, OSError) and store_unanswered(failed), failed
    assert took <= BOUND_S
    failed, took = timed(lambda: s3.create(f"{store.bucket}/in/b.bin", b"y"))
    assert isinstance(failed, OSError) and took <= BOUND_S

    # Back within the bound: the same requests succeed.
    threading.Timer(TIMEOUT_S / 2, proc.send_signal, (signal.SIGCONT,)).start()
    assert read_bytes(fs, path) == b"x" * 1000
    proc.send_signal(signal.SIGSTOP)
    threading.Timer(TIMEOUT_S / 2, proc.send_signal, (signal.SIGCONT,)).start()
    assert s3.read(path)[0] == b"x" * 1000


def test_a_publish_to_a_stopped_store_fails_within_the_bound_and_the_output_stays_as_it_was(stoppable):
    store, proc = stoppable
    out = f"s3://{store.bucket}/out"
    run(out, "run0", parts=2)
    before = {k: store.get(k) for k in store.keys("out/")}

    target = OutputTarget(out, JOB, "run1")
    target.open()
    stage(target, "run1", parts=1)
    proc.send_signal(signal.SIGSTOP)
    failed, took = timed(target.publish)
    target.close(release=False)
    proc.send_signal(signal.SIGCONT)
    assert isinstance(failed, PublishError) and store_unanswered(failed), failed
    assert f"{store.bucket}/out" in str(failed) and "is kept in" in str(failed)
    assert took <= BOUND_S
    assert {k: store.get(k) for k in store.keys("out/")} == before
    assert any(k.startswith(".out.run1.staging/output/") for k in store.keys(".out.run1"))  # kept
