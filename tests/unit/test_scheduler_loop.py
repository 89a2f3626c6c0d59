"""The scheduler worker's loop: requests sent together reach the engine before its first step,
so they are prefilled together; a request that comes later does not hold up the first; nothing
goes to the detokenizer while a step's forward pass runs."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

from minisgl.engine.worker import COALESCE_MAX, COALESCE_SHARE, SchedulerLoop
from minisgl.message.scheduler_to_detokenizer import RequestRegistered, TokenBatch
from minisgl.message.tokenizer_to_scheduler import TokenizedRequest
from minisgl.sampling_params import SamplingParams


class Inbox:
    """Messages that become available at given offsets from the first get_all call."""

    def __init__(self, schedule: list[tuple[float, Any]]) -> None:
        self.schedule = sorted(schedule, key=lambda e: e[0])
        self.start: float | None = None

    def get_all(self, timeout: float | None = None) -> list[Any]:
        if self.start is None:
            self.start = time.monotonic()
        deadline = time.monotonic() + (timeout or 0)
        while True:
            now = time.monotonic() - self.start
            ready = [m for t, m in self.schedule if t <= now]
            if ready:
                self.schedule = [(t, m) for t, m in self.schedule if t > now]
                return ready
            if time.monotonic() >= deadline:
                return []
            time.sleep(0.0002)


class Engine:
    max_seq_len = 100
    eos_token_ids: list[int] = []

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.steps: list[list[str]] = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def add_request(self, rid: str, prompt: list[int], params: Any, arrival_time: float) -> None:
        self.waiting.append(rid)

    def step(self) -> list[Any]:
        self.steps.append(self.waiting)
        self.waiting = []
        return []

    def stats(self) -> Any:
        return SimpleNamespace(last_batch_size=0)


class Life:
    def __init__(self, engine: Engine, steps: int) -> None:
        self.engine, self.steps = engine, steps

    def alive(self) -> bool:
        return len(self.engine.steps) < self.steps


def request(rid: str, more: bool = False) -> TokenizedRequest:
    return TokenizedRequest(rid, [1, 2, 3], SamplingParams(), 4, time.time(), more=more)


def run(schedule: list[tuple[float, Any]], steps: int) -> list[list[str]]:
    engine = Engine()
    loop = SchedulerLoop(
        engine, Inbox(schedule), SimpleNamespace(put=lambda m: None), logging.getLogger("t")
    )
    loop.send_stats = lambda: None  # type: ignore[method-assign]
    loop.run(Life(engine, steps))  # type: ignore[arg-type]
    return engine.steps


def test_a_burst_is_prefilled_in_one_step() -> None:
    # One request at a time from the tokenizer, half a millisecond apart, each but the last
    # saying more are behind it.
    burst = [(0.0005 * i, request(f"r{i}", more=i < 3)) for i in range(4)]
    assert run(burst, steps=1) == [["r0", "r1", "r2", "r3"]]


def test_a_lone_request_is_stepped_without_waiting_for_a_burst() -> None:
    engine = Engine()
    inbox = Inbox([(0.0, request("a"))])
    waits: list[float] = []
    get_all = inbox.get_all

    def recording(timeout: float | None = None) -> list[Any]:
        if not engine.steps and inbox.start is not None:  # between the request and its step
            waits.append(timeout or 0.0)
        return get_all(timeout)

    inbox.get_all = recording  # type: ignore[method-assign]
    loop = SchedulerLoop(engine, inbox, SimpleNamespace(put=lambda m: None), logging.getLogger("t"))
    loop.send_stats = lambda: None  # type: ignore[method-assign]
    loop.run(Life(engine, 1))  # type: ignore[arg-type]
    assert engine.steps == [["a"]]
    assert not any(waits), waits  # no wait for requests that nobody said were coming


def test_a_later_request_does_not_delay_the_first() -> None:
    later = max(0.2, COALESCE_MAX * 2)
    t0 = time.monotonic()
    steps = run([(0.0, request("a")), (later, request("b"))], steps=2)
    assert steps == [["a"], ["b"]]
    assert time.monotonic() - t0 >= later


class SimInbox:
    """Messages due at given times on a simulated clock, which a wait advances: to the next
    message's time when it is due within the timeout, else by the whole timeout."""

    def __init__(self, schedule: list[tuple[float, Any]]) -> None:
        self.schedule = sorted(schedule, key=lambda e: e[0])
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def get_all(self, timeout: float | None = None) -> list[Any]:
        due = self.now + (timeout or 0.0)
        if self.schedule and self.schedule[0][0] <= due:
            self.now = max(self.now, self.schedule[0][0])
        else:
            self.now = due
        ready = [m for t, m in self.schedule if t <= self.now]
        self.schedule = self.schedule[len(ready) :]
        return ready


class TimedEngine(Engine):
    """Each step takes `step_s` of the simulated clock, and records when it began."""

    def __init__(self, inbox: SimInbox, step_s: float) -> None:
        super().__init__()
        self.inbox, self.step_s = inbox, step_s
        self.began: list[float] = []

    def step(self) -> list[Any]:
        self.began.append(self.inbox.now)
        self.inbox.now += self.step_s
        return super().step()


def run_simulated(schedule: list[tuple[float, Any]], steps: int) -> TimedEngine:
    inbox = SimInbox(schedule)
    engine = TimedEngine(inbox, step_s=0.2)
    loop = SchedulerLoop(engine, inbox, SimpleNamespace(put=lambda m: None), logging.getLogger("t"))
    loop.clock = inbox.clock  # type: ignore[method-assign]
    loop.send_stats = lambda: None  # type: ignore[method-assign]
    loop.run(Life(engine, steps))  # type: ignore[arg-type]
    return engine


def test_a_slowly_handed_over_burst_is_scheduled_in_one_step() -> None:
    """A burst of 32 the API server hands over 2.5 ms apart (a loaded 2-core machine), after
    steps of 200 ms: one schedule decision, not the first few requests alone (a fixed 6 ms
    window split such a burst 9 + 23)."""
    burst = [(1.0 + 0.0025 * i, request(f"r{i}", more=i < 31)) for i in range(32)]
    engine = run_simulated([(0.0, request("w")), *burst], steps=2)
    assert engine.steps == [["w"], [f"r{i}" for i in range(32)]]


def test_a_burst_that_stops_coming_waits_at_most_the_window() -> None:
    """The last request taken said more were behind it, but none came: the step starts once
    the window (a share of the last step, at most COALESCE_MAX) has passed."""
    engine = run_simulated([(0.0, request("w")), (1.0, request("a", more=True))], steps=2)
    assert engine.steps == [["w"], ["a"]]
    assert 1.0 < engine.began[1] <= 1.0 + min(COALESCE_MAX, COALESCE_SHARE * 0.2) + 1e-9


class TokenEngine(Engine):
    """Each step gives every request it ran one token, and records what the detokenizer had
    been sent when the step began."""

    def __init__(self, sent: list[Any]) -> None:
        super().__init__()
        self.sent = sent
        self.sent_at_step: list[int] = []

    def step(self) -> list[Any]:
        self.sent_at_step.append(len(self.sent))
        rids = self.waiting
        super().step()
        return [
            SimpleNamespace(rid=r, new_token_ids=[7], finished=True, finish_reason="length",
                            prompt_tokens=3, cached_tokens=0, completion_tokens=1,
                            queue_time=0.0, index=0, logprobs=None, prompt_logprobs=None,
                            spec_draft_tokens=0, error=None)
            for r in rids
        ]  # fmt: skip


def test_registration_goes_with_the_first_tokens_not_during_the_forward() -> None:
    sent: list[Any] = []
    engine = TokenEngine(sent)
    loop = SchedulerLoop(
        engine, Inbox([(0.0, request("a"))]), SimpleNamespace(put=sent.append),
        logging.getLogger("t"),
    )  # fmt: skip
    loop.send_stats = lambda: None  # type: ignore[method-assign]
    loop.run(Life(engine, 1))  # type: ignore[arg-type]
    # The detokenizer (and the API server it acknowledges) woke for nothing during the step...
    assert engine.sent_at_step == [0]
    # ...and learns the request's stop strings before its first token, in one burst.
    assert [type(m) for m in sent] == [RequestRegistered, TokenBatch]
    assert sent[0].rid == "a"


def test_a_held_registration_precedes_an_abort() -> None:
    sent: list[Any] = []
    engine = Engine()
    engine.abort_request = lambda rid, index: True  # type: ignore[attr-defined]
    loop = SchedulerLoop(
        engine, Inbox([]), SimpleNamespace(put=sent.append), logging.getLogger("t")
    )
    loop.handle(request("a"))
    from minisgl.message.api_to_tokenizer import AbortRequest

    loop.handle(AbortRequest("a"))
    assert [type(m).__name__ for m in sent] == ["RequestRegistered", "RequestEnded"]


def test_the_message_thread_keeps_its_priority_when_compute_threads_are_niced() -> None:
    """libzmq's I/O thread carries the step's tokens out: it must not inherit the nice that
    the main thread and the compute threads created after it get."""
    code = (
        "import os, threading\n"
        "def nice(path):\n"
        "    return int(open(path).read().rsplit(')', 1)[1].split()[16])\n"
        "from minisgl.engine.worker import messaging_context\n"
        "ctx = messaging_context(5)\n"
        "others = [t for t in os.listdir('/proc/self/task') if int(t) != threading.get_native_id()]\n"
        "print('main', nice('/proc/thread-self/stat'))\n"
        "print('messaging', *[nice(f'/proc/self/task/{t}/stat') for t in others])\n"
        "t = threading.Thread(target=lambda: print('compute', nice('/proc/thread-self/stat')))\n"
        "t.start(); t.join()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}
    assert got["main"] == ["5"] and got["compute"] == ["5"], got
    assert got["messaging"] and set(got["messaging"]) == {"0"}, got  # I/O (and reaper) thread
