"""The in-flight policy against a simulated server: a scheduler with room for `capacity`
requests, a latency curve, and online traffic that comes and goes."""

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from pipeline.generation.policy.inflight import CEILING_PATIENCE, InFlightController, ServerSample, others_by_bucket


@dataclass
class SimServer:
    """A server with `capacity` running slots: what does not fit waits. An online request's
    time to first token (the probe's) grows with what runs; ours is `ours_ttft_ms`, or the
    same curve. `online` of its requests are another client's; each sample they finish
    `online_rate` requests, and ours finish `ours_rate`."""

    capacity: int = 32
    base_ttft_ms: float = 50.0
    ms_per_running: float = 10.0
    ours_ttft_ms: float | None = None
    online: int = 0
    online_rate: int = 0
    server_done: int = 0
    ours_done: int = 0
    preemptions: int = 0

    def sample(self, ours: int, ours_rate: int = 4) -> ServerSample:
        total = ours + self.online
        running, waiting = min(self.capacity, total), max(0, total - self.capacity)
        self.server_done += ours_rate + self.online_rate
        self.ours_done += ours_rate
        curve = self.base_ttft_ms + self.ms_per_running * running
        return ServerSample(waiting=waiting, running=running, preemptions=self.preemptions, in_flight=ours,
                            ttft_ms=curve if self.ours_ttft_ms is None else self.ours_ttft_ms, probe_ttft_ms=curve,
                            server_done=self.server_done, ours_done_before=self.ours_done, ours_done=self.ours_done)


def drive(c: InFlightController, server: SimServer, samples: int, backlog: int = 10_000) -> list[int]:
    """`samples` readings with `backlog` rows to send; the limit after each."""
    limits = []
    for i in range(samples):
        c.observe(server.sample(min(c.limit, backlog)), now=c._t0 + i * 0.5)
        limits.append(c.limit)
    return limits


def test_it_grows_while_the_server_is_idle_up_to_the_cap():
    c = InFlightController(max_in_flight=48, ttft_slo_ms=10_000, start=4)
    limits = drive(c, SimServer(capacity=64), 40)
    assert limits[-1] == 48  # the hard cap bounds it
    assert limits == sorted(limits) and c.backoffs == []
    assert limits.index(48) < 20  # by half again per growth: 4 -> 48 in a few holds


def test_it_does_not_grow_a_limit_it_does_not_use():
    c = InFlightController(max_in_flight=64, ttft_slo_ms=10_000, start=4)
    drive(c, SimServer(capacity=64), 40, backlog=3)
    assert c.limit == 4


def test_online_load_brings_it_down_to_where_online_requests_meet_the_target_then_it_climbs_back():
    """Online traffic arrives: an online request (the probe) would wait 50 + 10 ms per running
    request, against a 300 ms target; ours wait 50 ms."""
    c = InFlightController(max_in_flight=64, ttft_slo_ms=300, start=64)
    server = SimServer(capacity=128, ours_ttft_ms=50.0)
    drive(c, server, 10)
    assert c.limit == 64 and not c.online_present  # nobody else there: the target does not bind
    server.online, server.online_rate = 2, 2
    under = drive(c, server, 30)
    # Seen in two samples running, then cut at each sample over the target, in proportion to
    # the overshoot and at least by half, until it is met: 64 x 300 / 710 ms = 27, then
    # halved (27 x 300 / 340 ms would be 23).
    assert under[:4] == [64, 27, 13, 13]
    # 50 + 10 x 15 = 200 ms, under the target: it grows by an eighth while the probe waits
    # less than three quarters of the way from the least it waited (200 ms) to the target
    # (275 ms), and stops at 22 (290 ms).
    assert under[-1] == 22 and set(under[3:]) <= set(range(13, 23)) and c.online_present
    assert under[3:] == sorted(under[3:]) and len(c.backoffs) == 2
    assert all(b["reasons"] == ["online_ttft"] for b in c.backoffs)
    server.online, server.online_rate = 0, 0
    after = drive(c, server, 30)
    assert after[-1] == 64 and not c.online_present  # online gone: it climbs back, no threshold kept
    assert c.threshold is None


def test_with_headroom_it_grows_under_online_traffic_too():
    c = InFlightController(max_in_flight=64, ttft_slo_ms=2000, start=4)
    server = SimServer(capacity=128, online=2, online_rate=2)
    limits = drive(c, server, 80)
    assert c.online_present and limits[-1] == 64 and c.backoffs == []  # 50 + 10 x 66 < 1000
    # By an eighth (at least one) at a time, and while online traffic is there a growth
    # waits 2 samples (the hold) after the last: the probe measures each step first.
    grew = [i for i in range(1, len(limits)) if limits[i] > limits[i - 1]]
    assert min(b - a for a, b in zip(grew, grew[1:])) == 2


def test_a_target_just_above_what_online_requests_wait_alone_still_leaves_room_to_grow():
    """The bench's case: online requests wait 10 ms with none of ours, the target is 12 ms
    (1.2x), and each of ours running adds 0.25 ms. Growth by half the target's room (<= 6 ms)
    could never happen; now it climbs to where the probe meets the target and stays under."""
    c = InFlightController(max_in_flight=64, ttft_slo_ms=12, start=1, probing=True)
    server = SimServer(capacity=128, base_ttft_ms=10, ms_per_running=0.25, online=1, online_rate=2)
    limits = drive(c, server, 200)
    assert c.online_present and c.backoffs == []
    assert 4 <= limits[-1] <= 7  # 10 + 0.25 x (L + 1) at most the target: 12 ms at 7


def noisy(c: InFlightController, samples: int, step_ms: Callable[[int], float], seed: int,
          online_from: int = 0) -> tuple[list[int], list[float]]:
    """A server stepping its batch in `step_ms(running)`: an online request arriving waits for
    the step in progress (a uniform share of it) and then its own. The probe and one online
    request per sample draw that wait; the limit and the online requests' waits, from
    `online_from` on."""
    rng = random.Random(seed)
    limits, waits = [], []
    for i in range(samples):
        online = i >= online_from
        step = step_ms(c.limit + online)
        if online:
            waits.append((1 + rng.random()) * step)
        c.observe(ServerSample(waiting=0, running=c.limit + online, preemptions=0, in_flight=c.limit,
                               probe_ttft_ms=(1 + rng.random()) * step), now=c._t0 + i * 0.5)
        if online:
            limits.append(c.limit)
    return limits, waits


@pytest.mark.parametrize("ms_per_running, safe", [(0.25, 7), (0.1, 19), (1.0, 1)])
def test_a_noisy_probe_settles_below_the_level_that_hurt_instead_of_a_sawtooth(ms_per_running, safe):
    """The bench's shape: online requests wait 10-20 ms alone (the target 1.2x the P99, 24 ms)
    and each of ours running adds to the step. Up to `safe` of ours no online request passes
    the target. Growing back to where a probe last passed it, again and again, put 5-16% of
    online requests over it (a P99 over the target) and backed off up to 101 times in 300 s;
    the limit now stays under that level while online traffic is there, and reaches it
    again only after CEILING_PATIENCE clear samples."""
    over, mean, backoffs = [], [], []
    for seed in range(10):
        c = InFlightController(max_in_flight=64, ttft_slo_ms=24, start=64, probing=True)
        limits, waits = noisy(c, 600, lambda running: 10 + ms_per_running * running, seed)
        over.append(sum(w > 24 for w in waits) / len(waits))
        mean.append(sum(limits[100:]) / len(limits[100:]))
        backoffs.append(len(c.backoffs))
    assert sum(over) / len(over) < 0.01  # a P99 within the target
    assert sum(mean) / len(mean) >= 0.75 * safe  # not held far below what is safe
    assert max(backoffs) <= 10  # not a sawtooth


def test_after_an_online_back_off_the_limit_stays_below_that_level_then_it_is_tried_again():
    c = InFlightController(max_in_flight=64, ttft_slo_ms=1000, start=16, probing=True)
    server = SimServer(capacity=128, online=2, online_rate=2)
    drive(c, server, 4)
    level = c.limit
    assert c.online_present and c.online_ceiling is None
    c.observe(replace(server.sample(c.limit), probe_ttft_ms=3000.0))  # one online request waited 3x the target
    assert c.limit == level // 3 and c.online_ceiling == level
    limits = drive(c, server, 80)
    below = limits.index(level - 1)  # back up to just under the level that hurt, and held there
    assert max(limits[:below + CEILING_PATIENCE]) == level - 1
    assert max(limits) >= level and c.online_ceiling == max(limits)  # clear for long enough: tried again
    server.online, server.online_rate = 0, 0
    drive(c, server, 40)  # seen gone OTHERS_WINDOW + ONLINE_MEMORY samples after its last request
    assert not c.online_present and c.online_ceiling is None and c.limit == 64


def test_with_probes_a_sample_without_one_says_nothing_of_online_requests():
    """Ours wait long for a first token (they run at a lower priority): where probes are
    sent, a sample without one neither backs off nor counts as room."""
    def run(c: InFlightController, probe_every: int | None) -> None:
        server = SimServer(capacity=128, base_ttft_ms=10, ms_per_running=1, ours_ttft_ms=500.0, online=1,
                           online_rate=2)
        for i in range(40):
            s = server.sample(c.limit)
            if probe_every is None or i % probe_every:
                s = replace(s, probe_ttft_ms=None)
            c.observe(s, now=c._t0 + i * 0.5)

    c = InFlightController(max_in_flight=64, ttft_slo_ms=100, start=8, probing=True)
    run(c, probe_every=2)
    assert c.online_present and c.backoffs == [] and c.limit > 8
    without = InFlightController(max_in_flight=64, ttft_slo_ms=100, start=8)  # no probes: ours are the measure
    run(without, probe_every=None)
    assert without.limit == 1 and {tuple(b["reasons"]) for b in without.backoffs} == {("online_ttft",)}


def test_a_capacity_limit_bounds_the_oscillation_as_the_docstring_says():
    """Requests wait once ours pass the server's 24 slots: past the first back-off, the limit
    stays within [L/2, L + max(1, L/8)] and backs off at most once every hold + 1 samples."""
    capacity = 24
    c = InFlightController(max_in_flight=256, ttft_slo_ms=10_000, start=4)
    limits = drive(c, SimServer(capacity=capacity), 400)
    first = int(c.backoffs[0]["t"] / 0.5)
    level = capacity + 1  # "queue" fires from here on (two samples in a row with requests waiting)
    settled = limits[first:]
    assert min(settled) >= level // 2 and max(settled) <= level + max(1, level // 8)
    times = [round(b["t"] / 0.5) for b in c.backoffs]
    assert all(b - a >= c.hold + 1 for a, b in zip(times, times[1:]))
    assert all(set(b["reasons"]) == {"queue"} for b in c.backoffs)
    assert len(c.backoffs) >= 5  # it keeps probing the level, not stuck below it


def test_requests_waiting_only_for_the_next_step_are_no_queue():
    """The job alone at the server's 64 slots: each step finishes 2 of ours and 2 new ones
    wait for the next, so the server reads 2 waiting most of the time. That is transit,
    and the limit holds; 10 waiting, sample after sample, is a queue."""
    c = InFlightController(max_in_flight=64, ttft_slo_ms=100, start=64)
    done = steps = 0

    def sample(waiting: int) -> None:
        nonlocal done, steps
        done, steps = done + 30, steps + 15  # 2 finished a step
        c.observe(ServerSample(waiting=waiting, running=64, preemptions=0, in_flight=64, server_done=done,
                               server_steps=steps, ours_done_before=done, ours_done=done))

    for _ in range(20):
        sample(2)
    assert c.limit == 64 and c.backoffs == []
    sample(10)
    sample(10)
    assert c.limit == 32 and c.backoffs[-1]["reasons"] == ["queue"]
    # Without the server's step count there is no telling transit from a queue: any wait counts.
    bare = InFlightController(max_in_flight=64, ttft_slo_ms=100, start=64)
    for _ in range(2):
        bare.observe(ServerSample(waiting=2, running=64, preemptions=0, in_flight=64))
    assert bare.limit == 32


def test_requests_waiting_at_a_server_that_is_not_full_are_no_queue():
    """The bench's job alone (2026-12-06): the server had run 64 at once, then read 4 and 7
    waiting beside 57 and 25 running, ours sent in a burst after our client stalled. Not
    full: the limit holds. Waiting while it runs its 64 is a queue."""
    c = InFlightController(max_in_flight=64, ttft_slo_ms=100, start=64)
    c.observe(ServerSample(waiting=0, running=64, preemptions=0, in_flight=64))
    for waiting, running in [(4, 53), (4, 57), (7, 25), (19, 11)]:
        c.observe(ServerSample(waiting=waiting, running=running, preemptions=0, in_flight=64))
    assert c.limit == 64 and c.backoffs == []
    for _ in range(2):
        c.observe(ServerSample(waiting=4, running=64, preemptions=0, in_flight=64))
    assert c.limit == 32 and c.backoffs[-1]["reasons"] == ["queue"]


def test_a_server_restarted_with_fewer_slots_is_full_at_its_new_peak():
    """The server ran 64 at once, then restarted (its counters went back) with 32 slots:
    requests waiting while it runs its 32 are a queue. Held to the old peak, the limit
    stayed at 64 and only a preemption would have said so."""
    def served(restarted: bool) -> InFlightController:
        c = InFlightController(max_in_flight=64, ttft_slo_ms=100, start=64)
        c.observe(ServerSample(waiting=0, running=64, preemptions=0, in_flight=64, server_done=5000,
                               server_steps=9000))
        done, steps = (0, 0) if restarted else (5000, 9000)
        for _ in range(3):
            done, steps = done + 4, steps + 15
            c.observe(ServerSample(waiting=20, running=32, preemptions=0, in_flight=64, server_done=done,
                                   server_steps=steps, ours_done_before=done, ours_done=done))
        return c

    c = served(restarted=True)
    assert c.limit == 32 and c.backoffs[-1]["reasons"] == ["queue"]
    # Counters that only grow: the same readings are a server that is not full.
    same = served(restarted=False)
    assert same.limit == 64 and same.backoffs == []


def test_alone_on_the_server_the_target_does_not_bind():
    """Nobody else there: ours waiting long for a first token is no one's loss; the
    server's capacity (its queue) holds the job instead."""
    c = InFlightController(max_in_flight=64, ttft_slo_ms=100, start=4)
    limits = drive(c, SimServer(capacity=128, base_ttft_ms=50, ms_per_running=10), 40)
    assert limits[-1] == 64 and c.backoffs == []


@pytest.mark.parametrize("field, value, reason", [("preemptions", 5, "preempted"), ("throttled", 1, "throttled")])
def test_preemptions_and_throttling_back_off(field, value, reason):
    c = InFlightController(max_in_flight=64, ttft_slo_ms=10_000, start=16)
    quiet = ServerSample(waiting=0, running=16, preemptions=0, in_flight=16)
    c.observe(quiet)
    c.observe(ServerSample(**{**quiet.__dict__, field: value}))
    assert c.limit == 8 and c.backoffs[-1]["reasons"] == [reason] and c.threshold == 8


def test_ours_in_transit_are_not_taken_for_online_traffic_but_others_finished_are():
    """Ours are counted just before the server's count is asked for and just after: what the
    server counted of ours lies between, however many of ours finish meanwhile, so others'
    count is bracketed and rises for sure only when others finished requests."""
    c = InFlightController(max_in_flight=64, ttft_slo_ms=10_000, start=8)

    def sample(server_done, before, after):
        c.observe(ServerSample(waiting=0, running=8, preemptions=0, in_flight=8, server_done=server_done,
                               ours_done_before=before, ours_done=after))

    # Ours only: the server counted somewhere between before and after, each time.
    for server_done, before, after in [(100, 98, 100), (110, 105, 112), (120, 120, 121), (130, 126, 133),
                                       (140, 139, 140), (152, 150, 155), (160, 158, 160)]:
        sample(server_done, before, after)
        assert not c.online_present
    # Ours read late once (a loaded machine): the server counted 3 of ours we had not read.
    sample(173, 170, 170)
    sample(180, 180, 180)
    assert not c.online_present
    # Three of someone else's: others' least (193 - 190 = 3) passes an earlier most, twice running.
    sample(193, 187, 190)
    assert not c.online_present
    sample(200, 197, 197)
    assert c.online_present


def test_others_requests_on_the_gauges_count_in_two_samples_in_a_row():
    c = InFlightController(max_in_flight=64, ttft_slo_ms=10_000, start=8)
    c.observe(ServerSample(waiting=0, running=10, preemptions=0, in_flight=8))  # once: ours in transit, maybe
    assert not c.online_present
    c.observe(ServerSample(waiting=0, running=10, preemptions=0, in_flight=8))
    assert c.online_present


def test_a_fixed_concurrency_never_moves_but_still_records():
    c = InFlightController(max_in_flight=64, ttft_slo_ms=100, start=64, adaptive=False)
    server = SimServer(capacity=16, online=4, online_rate=2)
    assert set(drive(c, server, 30)) == {64}
    assert c.backoffs == [] and c.trajectory()["samples"] == 30 and c.steps


def test_others_are_bracketed_bucket_by_bucket_exactly_where_none_of_ours_finish():
    """Ours (prompts of 300-400 tokens) finish in the (200, 500] bucket, 3 of them while the
    histograms were read; others' 12-token prompts land in (10, 20]."""
    server = {"prompt_tokens": {10.0: 0, 20.0: 2, 500.0: 102, float("inf"): 102}}
    before = {"prompt_tokens": Counter({300: 60, 400: 37})}
    after = {"prompt_tokens": Counter({300: 62, 400: 38})}
    got = others_by_bucket(server, before, after)
    assert got["prompt_tokens<=20"] == (2, 2)  # exact: none of ours there
    assert got["prompt_tokens<=500"] == (0, 3)  # ours in transit blur it
    assert got["prompt_tokens<=10"] == (0, 0) and got["prompt_tokens<=inf"] == (0, 0)
    # Ours whose counts are unknown (aborted) may be in any bucket: the least drops by them.
    assert others_by_bucket(server, before, after, unknown=1)["prompt_tokens<=20"] == (1, 2)


@pytest.mark.parametrize("by_bucket", [False, True])
def test_one_online_request_in_a_bucket_of_its_own_is_seen_at_the_next_two_samples(by_bucket):
    """140 of ours finish a second, 8 of them while each reading is taken: counted in total,
    2 online requests a second hide among them for seconds. By bucket, the first is seen."""
    c = InFlightController(max_in_flight=64, ttft_slo_ms=10_000, start=64)
    ours = 0

    def sample(online_done: int) -> None:
        nonlocal ours
        before, ours = ours, ours + 70
        server_ours = before + 4  # the server counted some of those finishing while it was read
        hist = {"prompt_tokens": {20.0: online_done, 500.0: online_done + server_ours,
                                  float("inf"): online_done + server_ours}}
        buckets = others_by_bucket(hist, {"prompt_tokens": Counter({300: before})},
                                   {"prompt_tokens": Counter({300: before + 8})})
        c.observe(ServerSample(
            waiting=0, running=64, preemptions=0, in_flight=64, server_done=server_ours + online_done,
            ours_done_before=before, ours_done=before + 8, others_by_bucket=buckets if by_bucket else None))

    for _ in range(20):
        sample(0)
        assert not c.online_present
    sample(1)
    assert not c.online_present  # once could be a reading off
    sample(1)
    assert c.online_present == by_bucket
    sample(2)
    sample(2)
    assert c.online_present == by_bucket  # in total, 2 of others' are inside the blur of 8
