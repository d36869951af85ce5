"""How many requests a job keeps in flight on a server it shares with online traffic.

For a live server the "batch" is the number of our requests in flight, and the pressure
is the server's, not our memory's. `InFlightController` is fed one `ServerSample` per
reading of the server's `/metrics` (every `engine.server.metrics_interval_s`) and sets
the limit that the server engine (`pipeline.generation.server`) dispatches up to.

The rule, per sample. First, whether online traffic is there: the server serves requests
that are not ours, seen in one of the last ONLINE_MEMORY samples. Others' are told from
ours by count. Ours finished are counted just before the server's finished count is asked
for and just after (the streams given a moment to catch up), which brackets what it
counted of ours: others' finished requests lie in [least, most], and when the least now
passes the most of a sample up to OTHERS_WINDOW back, in two samples in a row, others
finished some in between. The same holds bucket by bucket of the histograms the server
keeps of finished requests (prompt and generated tokens: `others_by_bucket`), with ours
placed by the token counts the server told us: in a bucket none of ours finish in, the
bracket is exact, and one request of others' is seen at the next two samples. (Counted
in total, ours finishing while the count is read, about 15 at 140 a second, hid 2 online
requests a second for 6 s.) Or its gauges show more running and waiting than ours in
flight and finished since the last sample, in two samples in a row (they are as of its
last step). All undercount others' rather than mistake ours for them.
- Back off, halving the limit (not below `floor`), for any of these reasons:
  - `online_ttft`: online traffic is there, and an online request's time to first token
    (the engine's probe: an online-priority request of one token; else ours) passed
    `ttft_slo_ms`. Cuts at every sample it holds, in proportion to the overshoot (to the
    limit x target / wait) and at least by half: the server's users wait, and at 64 of
    ours an online request waits 5x its target, three halvings away. With no one else
    there the target does not bind: the job is held only by the server's capacity (the
    reasons below).
  - `queue`: requests waited at a full server in two samples in a row: it ran as many as
    it has ever run at once (its slots, as far as seen since it last restarted: its
    counters going back say it did, and it may have come back with fewer), and more
    waited than arrive in one of its steps (its finished requests per step since the
    last sample, rounded up: where it finishes some every step, as many new ones arrive
    and wait for the next).
    Requests wait at a server that is not full too, for its next step or its token
    budget, and our client sends them in bursts. Counting those, a job alone on the
    server backed off from 64 in flight (its 64 slots) to 16 while it ran 25-57, and
    generated a fifth less than the same job at a fixed 64 beside online traffic
    (2026-12-06). A server short of memory preempts (below).
  - `preempted`: the server's preemption count rose.
  - `throttled`: the server answered 429 or 503.
  The capacity reasons (all but online_ttft) back off at most once per `hold` + 1
  samples; one that lasts halves the limit again every `hold` + 1 samples.
- Grow when no reason has been seen for `hold` samples in a row, no requests wait at a
  full server (as above), our requests filled the limit (a limit we did not use says
  nothing about whether the server could take more), and, while online traffic is
  there, an online request has headroom: it waited less than three quarters of the way
  from the least it waited lately (the lowest of the last BASELINE_WINDOW readings: what
  the server gives it with little of ours in flight) to the target, now and at each
  reading since the limit last changed (up to CEILING_PATIENCE of them). A target set
  just above what online requests wait anyway (1.2x their P99 alone) leaves little room,
  and "under half the target" could then never hold: the job sat at its floor. One
  reading says little, though: an online request waits for the step in progress, a
  random share of it, so the probe's readings at one limit spread over 2x, and growth on
  one low reading climbed until a high one passed the target. Growth is by half again up
  to the threshold, by an eighth (at least one) past it and while online traffic is
  there (TCP's congestion avoidance: each overshoot costs online requests their target).
  While online traffic is there, a growth waits for `hold` clear samples after the last:
  the requests it lets in reach the server's steps, and the probe's reading, a sample or
  so later. A capacity back-off sets the threshold to the halved limit, so the limit
  closes in on the level that hurt instead of jumping past it (TCP's slow-start
  threshold); an online_ttft back-off leaves it, so the job climbs back quickly once
  online traffic has gone.
- An online_ttft back-off sets the `online_ceiling` to the limit it cut: while online
  traffic is there, growth stops one short of it until CEILING_PATIENCE samples in a row
  have been clear since the last growth, and a growth past it raises it. Without it the
  limit climbed back to the level that hurt, again and again (2026-12-06: a sawtooth from
  4 to 20 and back every 10-15 s, 2.8-7.5% of online requests over the target, a P99 past
  it). Online traffic gone, it is forgotten.

What an online request waits is the probe's time to first token where the engine sends
probes (`probing`): a sample without a probe's reading says nothing of it, neither back-off
nor headroom. Ours are no measure there: they run at the job's lower priority and wait
behind online requests and each other. Without probes, ours are the measure.

Oscillation bounds. Capacity reasons: under steady conditions where one fires once the
limit reaches some level L, after its first back-off the limit stays within [L/2, L +
max(1, L/8)] and backs off at most once every `hold` + 1 samples: a back-off halves a
limit of at least L (at most 1.5 L on the first climb), and growth nears L from below in
steps of at most an eighth and stops while requests wait at a full server. Online
traffic: where an online request passes the target once ours reach L, after a back-off
there the limit stays below L, and reaches L again (to back off once more) at most once
every CEILING_PATIENCE + 1 samples. Tested against simulated servers in
tests/unit/generation/test_inflight.py, one with a probe as noisy as the bench's.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Samples: others' finished requests are compared with the count this many samples back.
# What the bracket cannot tell apart is ours finishing while it is read (two readings'
# worth: about 15 requests at 140 of ours a second), while others' add up with time: 2
# online requests a second beside 64 of ours went unseen over 4 samples (2 s), so the job
# kept 64 in flight through the load. 16 samples (8 s) see them; traffic that stops is
# then still seen for up to 16 + ONLINE_MEMORY samples (the job only grows by an eighth
# meanwhile, and only while the probe has headroom).
OTHERS_WINDOW = 16
ONLINE_MEMORY = 4  # samples: online traffic seen this recently is still there
BASELINE_WINDOW = 120  # readings of an online request's time to first token: the least of these is its baseline
# Samples clear of reasons, with headroom, before the limit may reach again the level at
# which an online request last passed the target (10 s at the default 0.5 s interval);
# also the most readings that headroom is judged on.
CEILING_PATIENCE = 20


def others_by_bucket(server: Mapping[str, Mapping[float, float]], ours_before: Mapping[str, Counter[int]],
                     ours_after: Mapping[str, Counter[int]], unknown: int = 0) -> dict[str, tuple[int, int]]:
    """Others' finished requests in each bucket of each histogram the server keeps of
    finished requests, (at least, at most).

    `server`: histogram name -> the bucket's upper bound (`le`) -> its cumulative count.
    `ours_before` and `ours_after`: histogram name -> value -> ours finished with it, as
    counted just before the server's histograms were asked for and just after (the
    server counted ours somewhere between). `unknown`: ours it may have counted whose
    values we do not know (aborted, or their stream broke): each may be in any bucket."""
    out = {}
    for name, cumulative in server.items():
        bounds = sorted(cumulative)
        before = _bucketed(ours_before.get(name, Counter()), bounds)
        after = _bucketed(ours_after.get(name, Counter()), bounds)
        below = 0.0
        for le in bounds:
            n, below = cumulative[le] - below, cumulative[le]
            out[f"{name}<={le:g}"] = (int(n) - after[le] - unknown, int(n) - before[le])
    return out


def _bucketed(values: Counter[int], bounds: list[float]) -> Counter[float]:
    """How many of `values` fall in each bucket (the least bound at or above the value)."""
    out: Counter[float] = Counter()
    for value, n in values.items():
        i = bisect_left(bounds, value)
        if i < len(bounds):
            out[bounds[i]] += n
    return out


@dataclass(frozen=True)
class ServerSample:
    """One reading of the server and of our side of it."""

    waiting: int  # the server's requests waiting (ours and others')
    running: int  # the server's requests running (ours and others')
    preemptions: int  # the server's preemptions so far (a counter)
    in_flight: int  # ours, sent and not yet answered in full
    ttft_ms: float | None = None  # our requests' time to first token since the last sample (the highest)
    probe_ttft_ms: float | None = None  # an online-priority probe's since the last sample (the highest)
    throttled: int = 0  # our requests answered 429 or 503 since the last sample
    kv_cache: float | None = None  # the server's KV-cache usage 0..1, where it reports it
    server_ttft_ms: float | None = None  # the server's mean time to first token since the last sample (all clients)
    finished: int = 0  # ours that finished since the last sample (the server's gauges may still count them)
    server_done: int | None = None  # requests the server has finished so far, all clients' (a counter)
    server_steps: int | None = None  # steps the server's engine has taken so far (a counter)
    # Ours finished so far, counted just before the server's count was asked for and just
    # after it came back (the streams given a moment to catch up): between the two lies
    # what the server counted of ours.
    ours_done_before: int = 0
    ours_done: int = 0
    # Others' finished requests by bucket of the server's histograms, (at least, at most):
    # `others_by_bucket`. Not recorded in the trajectory's steps.
    others_by_bucket: dict[str, tuple[int, int]] | None = None

    @property
    def others_done(self) -> tuple[int, int] | None:
        """Others' finished requests, (at least, at most); None without the server's count."""
        if self.server_done is None:
            return None
        return self.server_done - self.ours_done, self.server_done - self.ours_done_before

    @property
    def brackets(self) -> dict[str, tuple[int, int]]:
        """Others' finished requests, (at least, at most): in total ("all") and by bucket."""
        done = self.others_done
        return {**(self.others_by_bucket or {}), **({"all": done} if done is not None else {})}

    @property
    def foreign(self) -> int:
        """Requests on the server that are not ours (a lower bound): its gauges are as of its
        last step, which may still count ours that finished in it."""
        return max(0, self.running + self.waiting - self.in_flight - self.finished)


@dataclass
class InFlightController:
    """The number of requests in flight, sized by the server's feedback (module docstring)."""

    max_in_flight: int
    ttft_slo_ms: float
    start: int = 4
    floor: int = 1
    hold: int = 2  # samples
    adaptive: bool = True  # False: the limit stays at `start` (samples are still recorded)
    probing: bool = False  # the engine sends online-priority probes: only theirs measure an online request's wait
    limit: int = field(init=False)
    _since_backoff: int = field(init=False, default=1 << 30)  # samples since the last back-off
    _clear: int = field(init=False, default=0)  # samples in a row with no reason to back off
    _before: ServerSample | None = field(init=False, default=None)  # the sample before this one
    _queued_before: bool = field(init=False, default=False)
    _peak_running: int = field(init=False, default=0)  # the most requests the server has run at once
    # Each bracket's most (ServerSample.brackets), over the last OTHERS_WINDOW samples.
    _at_most: dict[str, deque[int]] = field(init=False, default_factory=dict)
    _finished_before: bool = field(init=False, default=False)
    _online_seen: int | None = field(init=False, default=None)  # the last sample that saw online traffic
    online_present: bool = field(init=False, default=False)  # as of the last sample
    threshold: int | None = field(init=False, default=None)  # growth is by an eighth from here on
    # The limit at which an online request last passed the target: kept while online
    # traffic is there, and reached again only after CEILING_PATIENCE clear samples.
    online_ceiling: int | None = field(init=False, default=None)
    # An online request's time to first token at the readings since the limit last changed (the last CEILING_PATIENCE).
    _since_change: deque[float] = field(init=False)
    _online_ttfts: deque[float] = field(init=False, default_factory=lambda: deque(maxlen=BASELINE_WINDOW))
    _samples: int = field(init=False, default=0)
    _t0: float = field(init=False, default_factory=time.monotonic)
    started_at: float = field(init=False, default_factory=time.time)  # the steps' `t` counts from here (Unix time)
    steps: list[dict[str, Any]] = field(init=False, default_factory=list)
    backoffs: list[dict[str, Any]] = field(init=False, default_factory=list)
    peak_in_flight: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.floor = max(1, min(self.floor, self.max_in_flight))
        self.limit = max(self.floor, min(self.start, self.max_in_flight))
        self._since_change = deque(maxlen=CEILING_PATIENCE)

    def online(self, s: ServerSample) -> bool:
        """Others' requests are on the server: it finished more of them than it had, for
        sure, within the last OTHERS_WINDOW samples (at least as many now as at most then),
        in two samples in a row; or its gauges showed more requests than ours in two samples
        in a row. Two, because a reading can be off once: our streams slow to catch up (a
        loaded machine) leave ours undercounted for a sample, never for good, while others'
        finished requests stay counted."""
        finished = any(least > min(self._at_most[k]) for k, (least, _) in s.brackets.items() if self._at_most.get(k))
        self._finished_before, before = finished, self._finished_before
        return (finished and before) or (s.foreign > 0 and self._before is not None and self._before.foreign > 0)

    def online_ttft_ms(self, s: ServerSample) -> float | None:
        """What an online request waits for its first token now: the probe's; ours only
        where no probes are sent (None: this sample does not say)."""
        return s.probe_ttft_ms if s.probe_ttft_ms is not None or self.probing else s.ttft_ms

    def in_transit(self, s: ServerSample) -> int:
        """Requests that wait only for the server's next step: as many as it finished per
        step since the last sample, rounded up (0 without its counters)."""
        b = self._before
        if b is None or None in (b.server_done, b.server_steps, s.server_done, s.server_steps) \
                or s.server_steps <= b.server_steps:
            return 0
        return -(-max(0, s.server_done - b.server_done) // (s.server_steps - b.server_steps))

    def restarted(self, s: ServerSample) -> bool:
        """The server's counters went back since the last sample: it restarted (a restart
        shorter than `engine.server.unavailable_s` leaves the run going)."""
        b = self._before
        return b is not None and any(
            now is not None and then is not None and now < then
            for now, then in ((s.server_done, b.server_done), (s.server_steps, b.server_steps)))

    def queued(self, s: ServerSample) -> bool:
        """Requests wait at a full server: more of them than are in transit (`in_transit`),
        while it runs as many as it has ever run at once since it last restarted (its slots,
        as far as seen)."""
        return s.waiting > self.in_transit(s) and s.running >= self._peak_running

    def reasons(self, s: ServerSample, online: bool, ttft: float | None, queued: bool) -> list[str]:
        """Why `s` calls for a back-off ([] if it does not); `online`: others' traffic is
        there; `ttft`: what an online request waits now (`online_ttft_ms`); `queued`:
        requests wait at a full server now (`queued`)."""
        why = []
        if online and ttft is not None and ttft > self.ttft_slo_ms:
            why.append("online_ttft")
        if queued and self._queued_before:
            why.append("queue")
        if self._before is not None and s.preemptions > self._before.preemptions:
            why.append("preempted")
        if s.throttled:
            why.append("throttled")
        return why

    def observe(self, s: ServerSample, now: float | None = None) -> int:
        """Take one sample; the limit from now on."""
        t = round((time.monotonic() if now is None else now) - self._t0, 3)
        if self.online(s):
            self._online_seen = self._samples
        online = self.online_present = (self._online_seen is not None
                                        and self._samples - self._online_seen < ONLINE_MEMORY)
        ttft = self.online_ttft_ms(s)
        if self.restarted(s):
            self._peak_running = 0  # its slots now are what it runs from here on
        queued = self.queued(s)
        why = self.reasons(s, online, ttft, queued)
        if ttft is not None:
            self._online_ttfts.append(ttft)
            self._since_change.append(ttft)
        if not online:
            self.online_ceiling = None
        self._queued_before = queued
        self._peak_running = max(self._peak_running, s.running)
        for k, (_, most) in s.brackets.items():
            self._at_most.setdefault(k, deque(maxlen=OTHERS_WINDOW)).append(most)
        self._before = s
        self._samples += 1
        self.peak_in_flight = max(self.peak_in_flight, s.in_flight)
        before = self.limit
        self._since_backoff += 1
        self._clear = 0 if why else self._clear + 1
        if not self.adaptive:
            pass
        elif why and (self._since_backoff > self.hold or why == ["online_ttft"]):
            cut = self.limit // 2
            if "online_ttft" in why and ttft:
                cut = min(cut, int(self.limit * self.ttft_slo_ms / ttft))
            self.limit = max(self.floor, cut)
            if set(why) != {"online_ttft"}:
                self.threshold = self.limit
            if "online_ttft" in why:
                self.online_ceiling = before
            self._since_backoff = 0
            if self.limit != before:
                self.backoffs.append({"t": t, "from": before, "to": self.limit, "reasons": why,
                                      "waiting": s.waiting, "running": s.running, "foreign": s.foreign,
                                      "ttft_ms": s.ttft_ms, "probe_ttft_ms": s.probe_ttft_ms, "online": online})
        elif (self._clear >= self.hold and not queued and s.in_flight >= self.limit
              and self.limit < self.max_in_flight and (not online or self._headroom(ttft))):
            if not online and (self.threshold is None or self.limit < self.threshold):
                grown = min(self.limit + max(1, self.limit // 2), self.threshold or self.max_in_flight)
            else:
                grown = self.limit + max(1, self.limit // 8)
            if online and self.online_ceiling is not None and grown >= self.online_ceiling:
                if self._clear >= CEILING_PATIENCE:
                    self.online_ceiling = grown  # clear for long enough: the ceiling rises with it
                else:
                    grown = max(self.limit, self.online_ceiling - 1)
            self.limit = min(self.max_in_flight, grown)
            if online and self.limit != before:  # the next growth waits until the probe has measured this one
                self._clear = 0
        if self.limit != before:
            self._since_change.clear()
        if self.limit != before or self._samples % 4 == 1 or why or online:
            self.steps.append({"t": t, "limit": self.limit, **{k: v for k, v in vars(s).items()
                                                               if v is not None and k != "others_by_bucket"},
                               "foreign": s.foreign, "online": online, **({"reasons": why} if why else {})})
        return self.limit

    def _headroom(self, ttft: float | None) -> bool:
        """Online traffic is there, and an online request waited less than three quarters
        of the way from the least it waited lately to the target, now (`ttft`) and at each
        reading since the limit last changed (up to CEILING_PATIENCE of them: module
        docstring)."""
        if ttft is None:
            return False
        worst = max(ttft, *self._since_change)
        least = min(min(self._online_ttfts, default=ttft), self.ttft_slo_ms)
        return worst < least + (self.ttft_slo_ms - least) * 3 / 4

    def trajectory(self) -> dict[str, Any]:
        """The limit over time (each change, each sample with a reason, and every 4th sample),
        the back-offs with their reasons, and where it stands."""
        return {"started_at": round(self.started_at, 3), "limit": self.limit, "threshold": self.threshold,
                "online_ceiling": self.online_ceiling,
                "max_in_flight": self.max_in_flight, "ttft_slo_ms": self.ttft_slo_ms,
                "samples": self._samples, "peak_in_flight": self.peak_in_flight,
                "steps": list(self.steps), "backoffs": list(self.backoffs)}
