from pathlib import Path

import pytest

from pipeline.dev.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The offline test model, built once per session (a few seconds)."""
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def drawn(png: bytes) -> tuple[int, int, float]:
    """(width, height, share of pixels that are not background) of a PNG: a plot that drew
    nothing is all background, whatever its header says."""
    import io

    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(io.BytesIO(png))[..., :3]
    background = np.all(pixels > 0.97, axis=-1)
    return pixels.shape[1], pixels.shape[0], float(1 - background.mean())


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


@pytest.fixture
def s3(s3_server, monkeypatch):
    import uuid

    store = S3(s3_server, f"test-{uuid.uuid4().hex[:12]}")
    for k, v in store.env.items():
        monkeypatch.setenv(k, v)
    return store
