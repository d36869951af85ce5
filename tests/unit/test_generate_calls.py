"""How the generate stage cuts a batch into engine calls (no engine needed)."""

from pipeline.batching import FixedBatchPolicy
from pipeline.stages.generate import engine_calls

NAMES = ("le128", "le256", "le512", "gt512")


class PerBucketPolicy:
    """A policy that sizes each bucket differently, as the adaptive one will."""

    def __init__(self, sizes):
        self.sizes = sizes

    def rows_for(self, bucket):
        return self.sizes[bucket]

    def observe(self, bucket, stats):
        pass


def test_calls_never_mix_buckets_and_cover_every_row_once():
    buckets = [0, 2, 0, 1, 2, 2, 0, 3, 1, 0]
    rows = list(range(len(buckets)))
    calls = engine_calls(rows, buckets, "global", FixedBatchPolicy(2), NAMES)
    seen = [i for _, members in calls for i in members]
    assert sorted(seen) == rows
    for name, members in calls:
        assert {NAMES[buckets[i]] for i in members} == {name}
        assert 1 <= len(members) <= 2
    # Within a bucket, arrival order is kept.
    le128 = [i for name, m in calls if name == "le128" for i in m]
    assert le128 == [0, 2, 6, 9]


def test_policy_is_asked_per_bucket():
    buckets = [0] * 5 + [1] * 5
    calls = engine_calls(list(range(10)), buckets, "per_batch", PerBucketPolicy({"le128": 5, "le256": 2}), NAMES)
    assert [len(m) for _, m in calls] == [5, 2, 2, 1]


def test_grouping_off_takes_arrival_order():
    buckets = [0, 3, 1]
    calls = engine_calls([0, 1, 2], buckets, "off", FixedBatchPolicy(8), NAMES)
    assert calls == [("mixed", [0, 1, 2])]


def test_only_eligible_rows_are_called():
    calls = engine_calls([1, 3], [0, 0, 0, 0], "global", FixedBatchPolicy(8), NAMES)
    assert calls == [("le128", [1, 3])]
    assert engine_calls([], [], "global", FixedBatchPolicy(8), NAMES) == []
