"""What a stated input is worth: a cluster file's number, or ``{value: V, low: L, high: H}`` where
its author knows it only to a range. A prediction is made three times, at every input's stated
value and at every input's pessimistic and optimistic end (``ENDS``): the step-time model is
monotone in each input (each op's time is a max of costs, a collective's a sum, the schedule's
makespan a max of sums), so the rates at the two ends bound the rate over every combination of
the inputs inside their ranges."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ENDS = ("value", "slow", "fast")  # every input at its stated value, its pessimistic, its optimistic end


@dataclass(frozen=True)
class Stated:
    """One input: its value and the range its source allows (low == value == high: exact)."""

    key: str
    value: float
    low: float
    high: float

    @property
    def ranged(self) -> bool:
        return self.low < self.high

    def at(self, end: str, slower_when: str) -> float:
        """The input at ``end`` of ENDS; ``slower_when`` is ``high`` for a cost (a latency, a time
        per kernel), ``low`` for a rate (a bandwidth, FLOP/s)."""
        if end == "value":
            return self.value
        pessimistic = end == "slow"
        return self.high if pessimistic == (slower_when == "high") else self.low

    def words(self, unit: str = "") -> str:
        return f"{self.key} {self.low:g} to {self.high:g}{unit}" if self.ranged else f"{self.key} {self.value:g}{unit}"


def number(raw: Any) -> float | None:
    """A finite real from YAML, else None (a bool is not a number)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        return None
    return float(raw)


def stated(raw: Any, key: str) -> Stated:
    """``raw`` as a positive finite number or ``{value, low, high}`` with 0 < low <= value <= high;
    a ValueError naming ``key`` and the fix otherwise."""
    fix = f"give {key} as a positive number or as {{value: V, low: L, high: H}} with 0 < L <= V <= H, all finite"
    if isinstance(raw, dict):
        parts = [number(raw.get(k)) for k in ("value", "low", "high")]
        if set(raw) != {"value", "low", "high"}:
            raise ValueError(f"{key} is {raw!r}: it needs exactly value, low and high; {fix}")
        value, low, high = parts
        if value is None or low is None or high is None or not 0 < low <= value <= high:
            raise ValueError(f"{key} is {raw!r}: low <= value <= high must hold, all positive and finite; {fix}")
        return Stated(key, value, low, high)
    one = number(raw)
    if one is None or one <= 0:
        raise ValueError(f"{key} is {raw!r}; {fix}")
    return Stated(key, one, one, one)


def ranges(doc: Any, prefix: str = "") -> list[str]:
    """Every ranged input of a cluster document in words, for where an interval comes from."""
    if not isinstance(doc, dict):
        return []
    if set(doc) == {"value", "low", "high"}:
        return [f"{prefix} {doc['low']:g} to {doc['high']:g}"]
    return [line for key, v in doc.items() for line in ranges(v, f"{prefix}.{key}" if prefix else str(key))]
