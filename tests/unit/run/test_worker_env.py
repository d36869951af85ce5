"""The environment a run gives Ray's workers (`pipeline.run.job.worker_env`)."""

from pipeline.run.job import worker_env


def test_a_local_ray_reads_parquet_footers_on_one_actor_and_a_cluster_keeps_rays_pool():
    local, cluster = worker_env(local=True, environ={}), worker_env(local=False, environ={})
    assert local["RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"] == "1"
    assert "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS" not in cluster
    assert local["VLLM_LOGGING_LEVEL"] == cluster["VLLM_LOGGING_LEVEL"] == "WARNING"  # quiet either way


def test_what_the_user_set_wins_over_the_defaults():
    env = worker_env(local=True, environ={"RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "8", "VLLM_LOGGING_LEVEL": "INFO"})
    assert env["RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"] == "8" and env["VLLM_LOGGING_LEVEL"] == "INFO"
