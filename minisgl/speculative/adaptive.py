"""How many draft tokens each request gets this step, decided from measured costs.

Two running estimates drive it:

- per request, the chance `alpha` that a draft is kept given that the one before it was: from
  its recent verifies (counts of kept drafts and of first rejections, decayed per position
  tried so the recent ones weigh most, over a Beta prior). Under this geometric model a run's
  k-th draft is kept with probability alpha^k, which is also the number of tokens that draft
  adds to the output on average (its worth; taken as E[alpha^k] under the Beta posterior,
  which does not hold a request that was unlucky on few tries below what it is worth);
- per engine, what a step costs as a function of the tokens it scores: a line T(n) = a + b*n,
  plus c once when it verifies drafts (the drafter's call, the longer sampling), fitted by least
  squares over the engine's own step timings with exponential forgetting (so it follows a
  change of load), and pulled towards a prior (a step scoring 8 tokens costs about 1.45x one
  scoring 1, as measured on CPU) where the timings cannot tell the coefficients apart; times a
  correction per step size, plain or verifying, from what steps of that size measured against
  the line. A CPU's step is no line: its GEMV makes one pass over the weights per two rows up
  to 16, then a GEMM takes over, and a verify step's attention and sampling cost more per row
  than a decode's (2-core Zen 3, bf16 Qwen3-0.6B shape: a plain step of 2 cost 1.03x one of 1,
  one request verifying 4 drafts 2.1x, 8 requests verifying 4 each 3.2x a plain step of 8).
  The line alone misjudged both ends: copying at 8 streams ran at 0.87x of plain decoding
  (big verify steps first, then the streams whose bf16 text went its own way, their drafts
  rejected, decoding alone for as many steps as plain decoding took). The plain step a plan
  compares with is measured too: a batch whose size (or the nearest) was not timed plain
  lately runs one plain step. Sizes never measured take their neighbours' correction, and a
  correction fades back to the line as it ages, so a size once measured slow (or on a busier
  machine) is tried again now and then.

A plan takes drafts in order of their worth, as many as make the step's expected
output tokens per second highest, and none when no number of drafts beats a plain step. So a
request's drafts shrink as its acceptance drops and grow back, up to the cap, as it recovers;
and a batch large enough that its plain step already makes more tokens per second than drafts
could add runs without them: a workload with nothing to accept costs about what it costs
without speculation (a request left without drafts is probed with one draft now and then, at
exponentially growing intervals, so that a recovery is seen).

Torch-free and clock-free: the engine measures and reports; everything here is arithmetic.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# A request's acceptance: counts decay by this per draft position tried (about the last 10
# count), so a request that stops copying loses its drafts within ~10 steps.
ACCEPT_DECAY = 0.9
# Prior counts of kept drafts / first rejections: a new request starts at alpha = 0.25 (one
# draft on a CPU, more as soon as one is kept), and a run of rejections brings it to
# 0.25 / (1 / (1 - 0.9) + 1) = 0.02, below what a draft costs a CPU step of one request.
PRIOR_KEPT = 0.25
PRIOR_REJECTED = 0.75
# The step-cost fit: each new timing weighs 1, older ones decay by this per step (~30 steps).
COST_FORGET = 0.97
# Prior of the cost model: slope b = PRIOR_SLOPE_RATIO * a (8 tokens ~ 1.45x 1 token), fixed
# verify cost c = 0, each worth PRIOR_WEIGHT timings.
PRIOR_SLOPE_RATIO = 0.07
PRIOR_WEIGHT = 1.0
# The slope never goes below this fraction of the intercept: a free token would make every
# draft look worth it, whatever its chance.
MIN_SLOPE_RATIO = 0.002
# A step size's correction: each new timing of that size weighs 1 - RATIO_KEEP; once it is
# older than FRESH_TIMINGS timings (of any size) it fades towards 1 (the line) by RATIO_FADE per
# timing (~70 to half), so a size measured slow once is planned again later, and measured again.
RATIO_KEEP = 0.7
RATIO_FADE = 0.99
FRESH_TIMINGS = 64
# Drafts pay by comparison with the plain step they replace, so that step's cost has to be
# measured, not read off a line the verify steps drew: a decode batch for which no plain step
# of the nearest size was timed in this many timings takes one without drafts (about one step
# in PLAIN_REFRESH while drafting).
PLAIN_REFRESH = FRESH_TIMINGS
# A request left without drafts is probed with one after this many steps, doubled after every
# probe that keeps nothing (up to the maximum), reset when one is kept.
MIN_BACKOFF = 4
MAX_BACKOFF = 256
# A probe is made only when a draft kept this often would beat a plain step of this batch.
PROBE_WORTH = 0.5


@dataclass
class _Request:
    kept: float = 0.0  # decayed count of kept drafts
    rejected: float = 0.0  # decayed count of first rejections (runs cut short)
    idle: int = MIN_BACKOFF  # steps since its last draft was planned: a new one is probed
    backoff: int = MIN_BACKOFF
    probing: bool = False

    @property
    def alpha(self) -> float:
        return (self.kept + PRIOR_KEPT) / (self.kept + self.rejected + PRIOR_KEPT + PRIOR_REJECTED)

    def next_worth(self, worth: float, k: int) -> float:
        """E[alpha^(k+1)] from E[alpha^k] = worth, alpha ~ Beta(kept + prior, rejected + prior)."""
        s = self.kept + PRIOR_KEPT
        return worth * (s + k) / (s + self.rejected + PRIOR_REJECTED + k)


class StepCostModel:
    """Seconds of a step from the tokens it scores: T(n) = a + b*n (+ c when it verifies).

    Weighted least squares over the timings seen, older ones decayed by COST_FORGET per
    observation, plus two ridge terms worth PRIOR_WEIGHT observations: b towards
    PRIOR_SLOPE_RATIO * a and c towards 0. With every step at the same n the slope cannot be
    measured, and the prior's holds until the batch or the drafts vary; being relative to a,
    it follows the load as a does.
    """

    def __init__(self) -> None:
        # Decayed sums of x x^T and x t over observations x = (1, n, verify), t = seconds.
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xt = [0.0] * 3
        self._coef: tuple[float, float, float] = (1.0, PRIOR_SLOPE_RATIO, 0.0)
        self.observations = 0
        # Per verify flag: tokens scored -> (seconds measured, observation it was last updated).
        self._measured: tuple[dict[int, tuple[float, int]], ...] = ({}, {})
        self._sizes: tuple[list[int], list[int]] = ([], [])  # their keys, sorted

    def observe(self, scored_tokens: int, verify: bool, seconds: float) -> None:
        if scored_tokens < 1 or not 0 < seconds < float("inf"):
            raise ValueError(f"bad step timing: {scored_tokens} tokens in {seconds} s")
        # This size's measured seconds: a running mean (its older timings faded towards the
        # line as they aged), kept as seconds so that the line's later moves do not skew it.
        measured = self._measured[verify]
        mean = seconds
        if scored_tokens in measured:
            mean = RATIO_KEEP * self.seconds(scored_tokens, verify) + (1 - RATIO_KEEP) * seconds
        else:
            bisect.insort(self._sizes[verify], scored_tokens)
        self.observations += 1
        measured[scored_tokens] = (mean, self.observations)
        x = (1.0, float(scored_tokens), 1.0 if verify else 0.0)
        for i in range(3):
            self._xt[i] = COST_FORGET * self._xt[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = COST_FORGET * self._xx[i][j] + x[i] * x[j]
        self._coef = self._solve()

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c) in seconds; before any timing, the prior's shape with a = 1."""
        return self._coef

    def line(self, scored_tokens: int, verify: bool) -> float:
        """The fitted line's seconds, before the per-size correction."""
        a, b, c = self.coefficients
        return a + b * scored_tokens + (c if verify else 0.0)

    def seconds(self, scored_tokens: int, verify: bool) -> float:
        return self.line(scored_tokens, verify) * self.correction(scored_tokens, verify)

    def seconds_from(self, first: int, count: int, verify: bool) -> list[float]:
        """seconds(n, verify) for n = first .. first + count - 1, in one sweep (a plan asks
        for every draft count a batch could take)."""
        a, b, c = self.coefficients
        fixed = a + (c if verify else 0.0)
        sizes = self._sizes[verify]
        if not sizes:
            return [fixed + b * n for n in range(first, first + count)]
        ratio: dict[int, float] = {}

        def at(size: int) -> float:
            if size not in ratio:
                ratio[size] = self._ratio(size, verify)
            return ratio[size]

        out = []
        j = bisect.bisect_left(sizes, first)  # sizes[j] is the first measured size >= n
        for n in range(first, first + count):
            while j < len(sizes) and sizes[j] < n:
                j += 1
            if j == len(sizes):
                r = at(sizes[-1])
            elif sizes[j] == n or j == 0:
                r = at(sizes[j])
            else:
                lo, hi = sizes[j - 1], sizes[j]
                w = (n - lo) / (hi - lo)
                r = (1 - w) * at(lo) + w * at(hi)
            out.append((fixed + b * n) * r)
        return out

    def age(self, scored_tokens: int, verify: bool) -> float:
        """Timings since the step of this kind nearest in size (whose correction this size's
        is, or is interpolated from) was last measured; inf: none was."""
        sizes = self._sizes[verify]
        if not sizes:
            return float("inf")
        i = bisect.bisect_left(sizes, scored_tokens)
        near = min(sizes[max(i - 1, 0) : i + 1], key=lambda n: abs(n - scored_tokens))
        return self.observations - self._measured[verify][near][1]

    def correction(self, scored_tokens: int, verify: bool) -> float:
        """Measured over fitted seconds at this size (faded towards 1 as the timing ages);
        between measured sizes interpolated, beyond them the nearest one's; 1 where no step of
        the kind was measured."""
        sizes = self._sizes[verify]
        if not sizes:
            return 1.0
        if scored_tokens in self._measured[verify]:
            return self._ratio(scored_tokens, verify)
        i = bisect.bisect_left(sizes, scored_tokens)
        if i == 0:
            return self._ratio(sizes[0], verify)
        if i == len(sizes):
            return self._ratio(sizes[-1], verify)
        lo, hi = sizes[i - 1], sizes[i]
        w = (scored_tokens - lo) / (hi - lo)
        return (1 - w) * self._ratio(lo, verify) + w * self._ratio(hi, verify)

    def _ratio(self, size: int, verify: bool) -> float:
        seconds, at = self._measured[verify][size]
        ratio = seconds / self.line(size, verify)
        stale = max(0, self.observations - at - FRESH_TIMINGS)
        return 1.0 + (ratio - 1.0) * RATIO_FADE**stale

    def _solve(self) -> tuple[float, float, float]:
        m = [row[:] for row in self._xx]
        # The ridge terms, each what one timing of a single token would weigh: enough to pick
        # a point on the line the timings leave open, too little to bend what they measure.
        u = (-PRIOR_SLOPE_RATIO, 1.0, 0.0)  # (b - ratio * a)^2
        for i in range(3):
            for j in range(3):
                m[i][j] += PRIOR_WEIGHT * u[i] * u[j]
        m[2][2] += PRIOR_WEIGHT
        a, b, c = _solve3(m, self._xt)
        a = max(a, 1e-9)  # a step costs something even with no tokens
        return a, max(b, MIN_SLOPE_RATIO * a), max(c, 0.0)


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float]:
    """Solve m x = v (3x3, symmetric positive definite: the ridge makes it so)."""
    n = 3
    aug = [m[i][:] + [v[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(aug[r][col]))
        aug[col], aug[pivot] = aug[pivot], aug[col]
        for r in range(col + 1, n):
            f = aug[r][col] / aug[col][col]
            for k in range(col, n + 1):
                aug[r][k] -= f * aug[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (aug[r][n] - sum(aug[r][k] * x[k] for k in range(r + 1, n))) / aug[r][r]
    return x[0], x[1], x[2]


class AdaptiveSpeculation:
    """Plans each step's drafts; learns from verifies and step timings (see the module doc).

    Per step, the engine calls `plan` before asking the drafter, `verified` for each request
    it verified drafts of, and `observe_step` with the step's timing; `release` when a request
    leaves. Requests are keyed by anything hashable (the engine uses their ids).
    """

    def __init__(
        self, max_draft_tokens: int, cost: StepCostModel | None = None, adaptive: bool = True
    ) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        self.max_draft_tokens = max_draft_tokens
        # False: every request gets all the drafts its limit allows (the user's choice).
        self.adaptive = adaptive
        self.cost = cost if cost is not None else StepCostModel()
        self._reqs: dict[Hashable, _Request] = {}

    # -- per request -----------------------------------------------------------------------
    def acceptance(self, key: Hashable) -> float:
        """The estimated chance that the request's next draft is kept (given the one before)."""
        state = self._reqs.get(key)
        return state.alpha if state is not None else _Request().alpha

    def worths(self, key: Hashable, n: int) -> list[float]:
        """The expected tokens the request's 1st..n-th draft of a step would add."""
        state = self._reqs.get(key) or _Request()
        out = [state.alpha] if n > 0 else []
        while len(out) < n:
            out.append(state.next_worth(out[-1], len(out)))
        return out

    def verified(self, key: Hashable, proposed: int, accepted: int) -> None:
        """The request had `proposed` drafts verified this step and kept `accepted` of them."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted {accepted} of {proposed} drafts")
        state = self._reqs.setdefault(key, _Request())
        if proposed == 0:  # the drafter found nothing: no news of the acceptance
            state.probing = False
            return
        rejected = 1 if accepted < proposed else 0
        # Forgetting per draft position tried, not per verify: a request given one draft a
        # step then remembers as many positions as one given many, and the prior weighs the
        # same in both (per verify, it held one-draft requests down where they started).
        decay = ACCEPT_DECAY ** (accepted + rejected)
        state.kept = decay * state.kept + accepted
        state.rejected = decay * state.rejected + rejected
        if state.probing:
            state.backoff = MIN_BACKOFF if accepted else min(2 * state.backoff, MAX_BACKOFF)
            state.probing = False
        elif accepted:
            state.backoff = MIN_BACKOFF

    def release(self, key: Hashable) -> None:
        self._reqs.pop(key, None)

    @property
    def num_requests(self) -> int:
        """Requests with state kept here (0 once every request was released)."""
        return len(self._reqs)

    # -- per step --------------------------------------------------------------------------
    def observe_step(self, scored_tokens: int, num_drafts: int, seconds: float) -> None:
        """A step scored `scored_tokens` tokens, `num_drafts` of them drafts, in `seconds`."""
        self.cost.observe(scored_tokens, num_drafts > 0, seconds)

    def plan(
        self,
        keys: Sequence[Hashable],
        limits: Sequence[int],
        *,
        scored_tokens: int,
        emitted_tokens: int,
    ) -> list[int]:
        """Draft tokens to ask for, per request, in a step that without drafts would score
        `scored_tokens` tokens and emit `emitted_tokens`. limits[i] caps request i's (tokens
        it may still generate beyond the next, say); 0: it gets none."""
        if len(keys) != len(limits):
            raise ValueError("one limit per request")
        caps = [min(self.max_draft_tokens, max(lim, 0)) for lim in limits]
        if not self.adaptive:
            return caps
        counts = [0] * len(keys)
        reqs = self._reqs
        states = []
        for key in keys:
            state = reqs.get(key)
            if state is None:
                state = reqs[key] = _Request()
            states.append(state)
        # Only a step of decodes alone is timed (a prefill chunk's cost per token is another
        # regime), so only such a step is held plain to measure it.
        if scored_tokens == emitted_tokens and self.cost.age(scored_tokens, False) > PLAIN_REFRESH:
            return counts
        plain_seconds = self.cost.seconds(scored_tokens, False)
        plain = emitted_tokens / plain_seconds  # tokens per second without drafts
        # What m drafts add to the step, m = 1 .. all the caps allow (each a verify).
        extra = [
            t - plain_seconds for t in self.cost.seconds_from(scored_tokens + 1, sum(caps), True)
        ]
        # The least a draft costs, however many ride in the step (they share its fixed part).
        per_draft = min((e / m for m, e in enumerate(extra, 1)), default=float("inf"))
        if plain * per_draft >= 1.0:
            return counts  # not even drafts sure to be kept would pay (a big batch): done
        self._best(states, caps, counts, emitted_tokens, plain, extra, plain_seconds)
        # A probe when a draft kept PROBE_WORTH of the time would beat the plain step (not the
        # planned one: where other requests' drafts raise the step's rate, a request whose
        # estimate is stale would otherwise never be asked again).
        probe = plain * per_draft < PROBE_WORTH
        for i, state in enumerate(states):
            if counts[i]:
                state.idle = 0
                continue
            state.idle += 1
            if probe and caps[i] and state.idle >= state.backoff:
                counts[i] = 1
                state.idle = 0
                state.probing = True
        return counts

    def _best(
        self,
        states: Sequence[_Request],
        caps: Sequence[int],
        counts: list[int],
        emitted: int,
        plain: float,
        extra: Sequence[float],
        plain_seconds: float,
    ) -> None:
        """Fill `counts` with the drafts that maximise the step's expected emitted tokens per
        second (`plain`: that rate without drafts; extra[m - 1]: the seconds m drafts add).

        For any number of drafts the best are the ones worth most (a request's k-th is worth
        less than its (k-1)-th, so those are a prefix of each request's run), and the step's
        cost depends on their number only: so the best plan is the best of those prefixes. The
        measured costs need not be convex in the drafts (a GEMV's pass per two rows, a switch
        to a GEMM), so every prefix is looked at."""
        # Drafts by worth, highest first: a heap of each request's next draft (worth ~alpha^k).
        heap = [(-s.alpha, i, 1) for i, s in enumerate(states) if caps[i] > 0]
        heapq.heapify(heap)
        best_m, best_rate, gain, m = 0, plain, 0.0, 0
        order: list[int] = []
        while heap:
            neg, i, k = heapq.heappop(heap)
            worth = -neg
            gain += worth
            m += 1
            order.append(i)
            rate = (emitted + gain) / (plain_seconds + extra[m - 1])
            if rate > best_rate:
                best_m, best_rate = m, rate
            if k < caps[i]:
                heapq.heappush(heap, (-states[i].next_worth(worth, k), i, k + 1))
        for i in order[:best_m]:
            counts[i] += 1
