"""A local run's environment reaches Ray Data's Parquet reader: the input's footers are read
on one actor, not on Ray's pool of 32 worker processes (`pipeline.run.job.worker_env`)."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import pyarrow as pa, pyarrow.parquet as pq
    from pipeline.run.job import worker_env

    os.environ.update(worker_env(local=sys.argv[2] == "local"))  # as init_ray does before ray.init
    import ray, ray.data
    from ray._private import state  # the GCS's actor table: no dashboard needed (Ray is pinned)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for k in range(3):
            pq.write_table(pa.table({"id": [f"{k}-{i}" for i in range(100)]}), f"{sys.argv[1]}/part-{k}.parquet")
        rows = len(ray.data.read_parquet(sys.argv[1]).take_all())
        readers = [a for a in state.actors().values() if a["ActorClassName"] == "FooterReader"]
        print(json.dumps({"rows": rows, "footer_readers": len(readers)}))
    finally:
        ray.shutdown()
""")


def footer_readers(tmp_path, where: str) -> dict:
    folder = tmp_path / where
    folder.mkdir()
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), where], capture_output=True, text=True,
                          timeout=240, env={k: v for k, v in os.environ.items()
                                            if k != "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_local_run_reads_the_footers_on_one_actor_where_rays_default_starts_32(tmp_path):
    assert footer_readers(tmp_path, "local") == {"rows": 300, "footer_readers": 1}
    # What the setting saves: Ray's own default, as a cluster's run keeps it.
    assert footer_readers(tmp_path, "cluster") == {"rows": 300, "footer_readers": 32}
