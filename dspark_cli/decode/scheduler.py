"""How many drafted tokens each request verifies this round (paper §3.2, Algorithm 1).

Every policy maps per-request (calibrated) slot confidences c_{r,1..γ} to verification lengths
ℓ_r. Losslessness needs one property: whether slot j of request r is verified may depend on the
tokens before j, never on x_j itself. Prefix survival a_{r,j} = Π_{i≤j} c_{r,i} depends on
x_{<j} only (c_j reads x_{j−1}), so a search that stops at the first non-improving admission is
causal; one that looks further (`early_stop=False`) lets a_{r,j+1}, which reads x_j, decide
whether x_j is verified — the Appendix A bias that `dspark eval audit` demonstrates.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ..errors import DsparkError
from .sps import SpsTable

POLICIES = ("fixed", "threshold", "algorithm1", "async")


def prefix_survival(confidences: Sequence[float]) -> list[float]:
    """a_j = Π_{i≤j} c_i: the chance that slots 1..j are all accepted."""
    out, acc = [], 1.0
    for c in confidences:
        acc *= float(c)
        out.append(acc)
    return out


def _candidates(confidences: Sequence[Sequence[float]],
                max_len: Sequence[int]) -> list[tuple[float, int, int]]:
    """(a, r, j) for every admissible slot, best first; ties keep each request's slots in order."""
    items = []
    for r, conf in enumerate(confidences):
        for j, a in enumerate(prefix_survival(conf[: max_len[r]])):
            items.append((a, r, j))
    items.sort(key=lambda t: (-t[0], t[1], t[2]))
    return items


def _limits(confidences: Sequence[Sequence[float]], max_len: Sequence[int] | None) -> list[int]:
    if max_len is None:
        return [len(c) for c in confidences]
    if len(max_len) != len(confidences):
        raise ValueError("max_len needs one entry per request.")
    return [max(0, min(int(m), len(c))) for m, c in zip(max_len, confidences, strict=True)]


def expected_throughput(confidences: Sequence[Sequence[float]], lengths: Sequence[int],
                        sps: SpsTable) -> tuple[float, int, float]:
    """(τ, B, Θ) of a schedule: τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}), B = Σ_r (1 + ℓ_r), Θ = τ·SPS(B)."""
    tau = sum(1.0 + sum(prefix_survival(c[:n])) for c, n in zip(confidences, lengths, strict=True))
    batch = sum(1 + n for n in lengths)
    return tau, batch, tau * sps(batch)


def algorithm1(confidences: Sequence[Sequence[float]], sps: SpsTable,
               max_len: Sequence[int] | None = None, early_stop: bool = True) -> list[int]:
    """Algorithm 1: greedy admission by prefix survival, stopping when Θ stops rising.

    With `early_stop=False` (the retrospective search, NOT lossless) every admission count along
    the same order is scored and the best is kept, so later slots vote on earlier ones.
    """
    limits = _limits(confidences, max_len)
    num = len(confidences)
    tau, batch = float(num), num  # every request sends its anchor and gets ≥ 1 token
    best_theta = tau * sps(batch)
    order = _candidates(confidences, limits)
    admitted = 0
    for n, (a, _r, _j) in enumerate(order, start=1):
        tau, batch = tau + a, batch + 1
        theta = tau * sps(batch)
        if theta > best_theta:
            best_theta, admitted = theta, n
        elif early_stop:
            break
    lengths = [0] * num
    for _a, r, _j in order[:admitted]:
        lengths[r] += 1
    return lengths


def top_k_lengths(confidences: Sequence[Sequence[float]], capacity: int,
                  max_len: Sequence[int] | None = None) -> list[int]:
    """Admit the `capacity` slots of highest prefix survival across all requests (no early stop)."""
    limits = _limits(confidences, max_len)
    lengths = [0] * len(confidences)
    for _a, r, _j in _candidates(confidences, limits)[: max(0, capacity)]:
        lengths[r] += 1
    return lengths


def threshold_lengths(confidences: Sequence[Sequence[float]], threshold: float,
                      max_len: Sequence[int] | None = None) -> list[int]:
    """Verify slots while the prefix survival stays ≥ threshold (a static confidence cut)."""
    limits = _limits(confidences, max_len)
    lengths = []
    for conf, limit in zip(confidences, limits, strict=True):
        n = 0
        for a in prefix_survival(conf[:limit]):
            if a < threshold:
                break
            n += 1
        lengths.append(n)
    return lengths


class Scheduler:
    """A policy with the state it needs across rounds; call `schedule` once per round."""

    def __init__(self, policy: str, gamma: int, sps: SpsTable | None = None, threshold: float = 0.5,
                 delay: int = 2) -> None:
        if policy not in POLICIES:
            raise DsparkError(f"unknown schedule {policy!r}; choose one of {', '.join(POLICIES)}.")
        self.policy, self.gamma, self.threshold, self.delay = policy, gamma, threshold, delay
        self.sps = sps or SpsTable.constant()
        self._history: deque[tuple[int, int]] = deque(maxlen=delay)  # (capacity, requests) per round

    @property
    def needs_confidences(self) -> bool:
        return self.policy != "fixed"

    def schedule(self, confidences: Sequence[Sequence[float]] | None, max_len: Sequence[int]) -> list[int]:
        """Verification length per request; `max_len` caps each (e.g. tokens left to generate)."""
        if self.policy == "fixed":
            return [max(0, min(self.gamma, int(m))) for m in max_len]
        if confidences is None:
            raise DsparkError(f"schedule {self.policy!r} needs a drafter with a confidence head.",
                              hint="use --schedule fixed for a DFlash-style drafter.")
        if self.policy == "threshold":
            return threshold_lengths(confidences, self.threshold, max_len)
        if self.policy == "algorithm1":
            return algorithm1(confidences, self.sps, max_len)
        return self._async(confidences, max_len)

    def _async(self, confidences: Sequence[Sequence[float]], max_len: Sequence[int]) -> list[int]:
        """Capacity K from the confidences of `delay` rounds ago, then the global top-K now.

        K never sees this round's tokens, and top-K without an early stop admits slot j before
        any later slot of its request, so the output stays lossless.
        """
        limits = _limits(confidences, max_len)
        if len(self._history) == self.delay:
            old_capacity, old_requests = self._history[0]
            capacity = round(old_capacity * len(confidences) / max(old_requests, 1))
        else:
            capacity = sum(limits)  # no history yet: verify everything, as the fixed policy would
        lengths = top_k_lengths(confidences, capacity, limits)
        # What Algorithm 1 would have admitted now becomes the capacity `delay` rounds later.
        self._history.append((sum(algorithm1(confidences, self.sps, limits)), len(confidences)))
        return lengths
