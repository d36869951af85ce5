"""Real servers on loopback for the tests, each stopped by its handle: a bucket on moto's
S3 server (`S3`; `start_moto` for one in a process of its own), Debian's Prometheus (`start_prometheus`) and Pushgateway
(`start_pushgateway`), a free port."""

from __future__ import annotations

from pathlib import Path

import pytest


class S3:
    """One test's bucket on the session's S3 server, reached as a user would: AWS_*
    variables in the environment (set for this process and for any it starts)."""

    def __init__(self, endpoint: str, bucket: str):
        import boto3

        self.endpoint, self.bucket = endpoint, bucket
        self.env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                   aws_access_key_id="testing", aws_secret_access_key="testing")
        self.client.create_bucket(Bucket=bucket)

    @property
    def fs(self):
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
                                 endpoint_override=self.endpoint.split("://")[1])

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under the prefix, as a lister sees them."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _needs(binary: str, package: str) -> str:
    import shutil

    found = shutil.which(binary)
    if found is None:
        pytest.skip(f"{binary} is not installed: `apt-get install {package}` (make test installs it where it "
                    "can; README, 'Watching a run')")
    return found


def _serve(cmd: list[str], ready_url: str, log: Path):
    """Start a server, and wait until it answers on `ready_url`; stopped by its handle."""
    import subprocess
    import time
    import urllib.request

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(ready_url, timeout=1):
                return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{cmd[0]} did not start: {log.read_text()[-2000:]}")


def start_moto(folder: Path):
    """(endpoint, process) of moto's S3 server in a process of its own: one a test can stop
    with SIGSTOP, as a store that stops answering, and stop for good by its handle."""
    import sys

    port = free_port()
    proc = _serve([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                  f"http://127.0.0.1:{port}/moto-api/", folder / "moto.log")
    return f"http://127.0.0.1:{port}", proc


def start_pushgateway(folder: Path):
    """(base URL, process) of a Prometheus Pushgateway on loopback."""
    exe = _needs("prometheus-pushgateway", "prometheus-pushgateway")
    port = free_port()
    # Debian's build persists to /var/lib/prometheus by default: this one keeps its own file.
    proc = _serve([exe, f"--web.listen-address=127.0.0.1:{port}", f"--persistence.file={folder / 'pushgateway.data'}"],
                  f"http://127.0.0.1:{port}/-/ready", folder / "pushgateway.log")
    return f"http://127.0.0.1:{port}", proc


def servers_installed() -> bool:
    import shutil

    return bool(shutil.which("prometheus") and shutil.which("prometheus-pushgateway"))


class Prometheus:
    """A Prometheus server on loopback scraping `targets` every second."""

    def __init__(self, url: str):
        self.url = url

    def query(self, promql: str) -> list[dict]:
        import json
        import urllib.parse
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}),
                                    timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]


def start_prometheus(folder: Path, targets: list[str]):
    """(Prometheus, its process) scraping `targets` (host:port) every second."""
    exe = _needs("prometheus", "prometheus")
    port = free_port()
    config = folder / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: pipeline\n    static_configs: [{{targets: {targets!r}}}]\n"
    )
    proc = _serve([exe, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                   f"--web.listen-address=127.0.0.1:{port}"], f"http://127.0.0.1:{port}/-/ready",
                  folder / "prometheus.log")
    return Prometheus(f"http://127.0.0.1:{port}"), proc
