"""What publishing to an object store costs: requests and the window, per 1,000 parts.

Against moto's S3 server on loopback (`make bench-s3`): an earlier output of N parts,
then a run of N parts published over it through `pipeline.storage.output`, as a run does.
The server counts every request it serves, so the figure includes the checks
(listings, reads of the report and markers), not only the copies and deletes.
Timings against a local server do not predict S3's (README, "Object stores"):
the request count does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import uuid
from collections import Counter
from pathlib import Path


class Requests(logging.Handler):
    """Counts the requests moto's server logs (werkzeug: one line each), by method."""

    def __init__(self):
        super().__init__()
        self.by_method: Counter[str] = Counter()

    def emit(self, record):
        line = record.getMessage()
        for method in ("GET", "PUT", "POST", "DELETE", "HEAD"):
            if f'"{method} ' in line or f"m{method} " in line:
                self.by_method[method] += 1
                return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--parts", type=int, default=1000)
    ap.add_argument("--out", default="bench/results/s3_publish.json")
    args = ap.parse_args()

    from moto.server import ThreadedMotoServer

    counter = Requests()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.setLevel(logging.INFO)
    werkzeug.addHandler(counter)
    werkzeug.propagate = False
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    import boto3

    from pipeline.storage.output import OutputTarget
    from pipeline.observe.report import REPORT_NAME

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)
    from pipeline.observe.machine import describe

    results = {"parts": args.parts, "server": "moto 5.2.5 on loopback", "machine": describe(), "runs": []}
    try:
        for run in ("run1", "run2"):  # the second replaces the first's parts
            target = OutputTarget(f"s3://{bucket}/out", "bench", run)
            target.open()
            names = [f"part-{run}-{i:05d}.parquet" for i in range(args.parts)]
            for n in names:
                client.put_object(Bucket=bucket, Key=f".out.{run}.staging/output/{n}", Body=b"PAR1" + b"x" * 1024)
            report = {"run_id": run, "job": "bench", "files": names, "plot_path": None}
            report["publish"] = target.plan()
            client.put_object(Bucket=bucket, Key=f".out.{run}.staging/output/{REPORT_NAME}",
                              Body=json.dumps(report).encode())
            counter.by_method.clear()
            started = time.monotonic()
            target.publish()
            whole = time.monotonic() - started
            target.close()
            served = dict(counter.by_method)
            results["runs"].append({"run": run, "replaced_parts": args.parts if run == "run2" else 0,
                                    "window_s": target.published["window_s"], "publish_s": round(whole, 3),
                                    "window_requests": target.published["requests"],
                                    "requests_served": sum(served.values()), "by_method": served})
            print(json.dumps(results["runs"][-1]))
    finally:
        server.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
