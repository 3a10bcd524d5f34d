"""Per-request speculation counters, reported in the ``done`` frame.

``accepted_per_depth`` is a histogram over rounds: entry ``a`` counts the verified rounds that
accepted exactly ``a`` drafts (entry 0 = rounds whose first draft was rejected), so
``sum(accepted_per_depth) == rounds`` and ``sum(a * n_a) == accepted``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    rounds: int = 0  # verified speculative rounds (at least one draft checked by the target)
    parked: int = 0  # depth-0 rounds: target-only or plain decoding while parked
    # tokens the head proposed, counted at draft time: a proposal's k when the head step
    # returns (kept if the round fails later), a failing step's drafts made before it failed
    drafted: int = 0
    accepted: int = 0  # drafts the verification accepted (before emission cuts the run)
    accepted_per_depth: list[int] = field(default_factory=list)
    final_depth: int = 0  # the depth scheduled for the round after the last one
    # per drafter ("head", "suffix"): its rounds, drafted and accepted tokens
    sources: dict[str, dict[str, int]] = field(default_factory=dict)

    def _source(self, source: str) -> dict[str, int]:
        return self.sources.setdefault(source, {"rounds": 0, "drafted": 0, "accepted": 0})

    def record_drafted(self, count: int, source: str = "head") -> None:
        self.drafted += count
        self._source(source)["drafted"] += count

    def record_round(self, accepted: int, source: str = "head") -> None:
        """One verified round that accepted ``accepted`` leading drafts."""
        counts = self._source(source)
        counts["rounds"] += 1
        counts["accepted"] += accepted
        self.rounds += 1
        self.accepted += accepted
        if len(self.accepted_per_depth) <= accepted:
            self.accepted_per_depth.extend([0] * (accepted + 1 - len(self.accepted_per_depth)))
        self.accepted_per_depth[accepted] += 1

    def record_parked(self) -> None:
        self.parked += 1

    @property
    def acceptance(self) -> float:
        """Fraction of proposed drafts that were accepted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        """Plain values with the ``done`` frame's field names."""
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "accepted_per_depth": list(self.accepted_per_depth),
            "final_depth": self.final_depth,
            "sources": {name: dict(counts) for name, counts in self.sources.items()},
        }
