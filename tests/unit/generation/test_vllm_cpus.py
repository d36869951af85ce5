"""Engines of one machine claim CPUs of their own (pipeline.generation.vllm.claim_cpus)."""

from pipeline.generation.vllm import claim_cpus


def test_engines_on_one_machine_claim_different_cpus_until_one_ends(tmp_path):
    first, held = claim_cpus([0, 1, 2], 2, tmp_path)
    assert first == [0, 1]
    second, held_2 = claim_cpus([0, 1, 2], 2, tmp_path)
    assert second == [2]  # the other engine's CPUs are skipped, not shared
    third, _ = claim_cpus([0, 1, 2], 2, tmp_path)
    assert third == []  # none left: that engine stays unbound
    for f in held:  # the first engine's process ends: the kernel drops its locks
        f.close()
    assert claim_cpus([0, 1, 2], 1, tmp_path)[0] == [0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu0.lock", "cpu1.lock", "cpu2.lock"]
    for f in held_2:
        f.close()
