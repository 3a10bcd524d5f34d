"""The round driver's seam: the model operations it calls (``RoundOps``), the errors they
raise, saying what state they left behind, the host data they return, and what else the
driver talks to (the depth source, the suffix drafter). ``drafting.mlx_ops`` implements the
operations with MLX; ``tests/fakes.py`` with a deterministic fake."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# -- the seam ---------------------------------------------------------------------------------


class OpError(Exception):
    """A seam operation failed; the subclass says what state it left behind.

    ``drafted``: from ``head_step``, the drafts it had proposed before it failed (a head that
    drafts step by step may fail at step i > 0); the statistics count them."""

    def __init__(self, *args: object, drafted: int = 0) -> None:
        super().__init__(*args)
        self.drafted = drafted


class TargetError(OpError):
    """A target forward, restore or rewind failed part-way: the caches are not reusable."""


class HeadError(OpError):
    """The draft head failed (its forward, or its lazy drafts inside the fused evaluation)."""


class HostError(OpError):
    """Host-side failure after every cache mutation of the call completed.

    ``salvage`` is a token distributed exactly as the successor of the first fed token (verify
    feed) or of the last fed token (replay feed asked for a successor), when the host data
    survived; None otherwise."""

    def __init__(
        self, message: str = "host failure", salvage: int | None = None, *, drafted: int = 0
    ) -> None:
        super().__init__(message, drafted=drafted)
        self.salvage = salvage


@dataclass
class Verification:
    """Host data of one verify feed of [x, d1..dk] (k = 0 for a target-only feed)."""

    drafts: list[int]  # d1..dk
    accept: list[bool]  # accept[i]: d_{i+1} passed verification
    successors: list[int]  # successors[i]: next token when exactly i drafts are accepted
    rows: object = None  # opaque: the verified target hiddens, handed back to head_commit


@dataclass
class Replay:
    """Host data of one replay feed."""

    successor: int | None  # drawn from the last row when asked, else None
    rows: object = None  # opaque: the fed tokens' target hiddens


class RoundOps(Protocol):
    """Model operations behind the driver. Positions are absolute target offsets; head pairs
    count draft-KV slots (slot S pairs token S+1 with the target hidden at S)."""

    @property
    def position(self) -> int:
        """Tokens the target caches hold."""

    @property
    def head_alive(self) -> bool:
        """A draft head exists and has not been discarded."""

    @property
    def head_ready(self) -> bool:
        """Alive and primed (a frontier hidden exists), so it can draft."""

    @property
    def draft_source(self) -> str:
        """The name the draft session's rounds count under in the stats: "head" (the MTP
        head) or "assistant" (a drafter over the target's caches)."""

    @property
    def head_pairs(self) -> int:
        """Pairs in the draft KV, speculative entries included."""

    def capture(self) -> object:
        """Entry state of the target caches, enough for ``restore``."""

    def restore(self, state: object) -> None:
        """Back to a captured state (also undoes a failed fused forward). TargetError."""

    def rewind(self, position: int) -> None:
        """Truncate the target caches to ``position``. TargetError when out of range."""

    def head_step(self, current: int, k: int) -> object:
        """Draft k tokens after ``current`` from the frontier; returns an opaque, lazily
        computed proposal that ``verify_feed`` evaluates with the target. HeadError, HostError
        (``drafted``: how many drafts it proposed before it failed)."""

    def fed_prompt(self, last: int) -> None:
        """The next feed starts with the prompt's last token ``last`` (a warm round): it is in
        the penalty history and the matcher already."""

    def fixed_proposal(self, drafts: Sequence[int]) -> object:
        """A proposal of known tokens (a drafter that needs no forward), for ``verify_feed``."""

    def verify_feed(self, current: int, proposal: object | None) -> Verification:
        """Feed [current, d1..dk] in one forward and sync once. HeadError (the proposal failed
        to evaluate; the target may be half-mutated), TargetError, HostError."""

    def replay_feed(self, tokens: Sequence[int], successor: bool) -> Replay:
        """Feed tokens whose logits are not needed, except the last row's successor draw
        when ``successor``. TargetError, HostError."""

    def head_commit(self, tokens: Sequence[int], rows: object) -> None:
        """Commit pairs for ``tokens`` (fed at the current frontier) using the first
        ``len(tokens)`` target hidden rows of ``rows``; the first token pairs with the frontier
        hidden, and the new frontier hidden is the last row used. HeadError, HostError."""

    def head_rewind(self, pairs: int) -> None:
        """Drop draft-KV entries above ``pairs`` that were not committed from target hiddens.
        After ``head_rewind(n)`` and ``head_commit(t, rows)`` the head holds n + len(t) pairs."""

    def head_discard(self) -> None:
        """Stop drafting for the rest of the request; the draft KV is no longer trusted."""


# -- what the driver talks to besides the seam -----------------------------------------------


class DepthSource(Protocol):
    """``drafting.depth.RequestDepth`` or ``FixedDepth``."""

    @property
    def enabled(self) -> bool: ...

    @property
    def depth(self) -> int: ...

    def round_started(self, depth: int) -> None: ...

    def round_finished(self, judged: int, accepted: int) -> None: ...

    def round_elsewhere(self) -> None:
        """A round of another drafter ran: no cost sample spans it."""

    def head_rate(self, depth: int) -> float | None:
        """Expected committed tokens of a head round at ``depth`` per plain step's time; None
        when the costs are not known yet."""


class SuffixSource(Protocol):
    """``drafting.suffix.SuffixDrafter``: drafts from the text already seen."""

    def expects_copy(self) -> bool: ...

    def draft(self, current: int, limit: int, *, indexed: bool = False) -> tuple[Any, float]: ...

    def shared_draft(self, current: int, limit: int, row_cost: float) -> Any: ...

    def started(self, kind: str, rows: int = 1) -> None: ...

    def pause(self) -> None: ...

    @property
    def model(self) -> Any: ...
