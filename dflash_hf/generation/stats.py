"""What a DFlash `generate` call reports: its statistics and the output type that carries them."""

import copy
from dataclasses import dataclass, field, fields

from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class DFlashStats:
    """Counters of one generate call (each call has its own).

    `acceptance_lengths` has one entry per verification forward of the target (the prefill forward
    is not counted, as in the reference implementation): drafts accepted plus the one token the
    target adds itself. Its mean is tau, the tokens committed per target forward.
    """

    acceptance_lengths: list[int] = field(default_factory=list)
    # drafts handed to the target at each of those forwards (0: a plain step, the drafter did not run)
    verify_lengths: list[int] = field(default_factory=list)
    drafted_tokens: int = 0  # drafts handed to the target for verification
    accepted_tokens: int = 0  # of those, drafts the target committed
    copied_steps: int = 0  # forwards that verified a run copied from the context instead of a DFlash block
    copied_accepted_tokens: int = 0  # copied tokens the target committed (counted in accepted_tokens too)
    draft_seconds: float = 0.0  # in the drafter (context ingestion + block forward + lm_head + proposal)
    verify_seconds: float = 0.0  # in the target's forwards and acceptance, prefill included
    # with a batch of prompts: each row's own statistics (the call's above count every row's steps)
    rows: list["DFlashStats"] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int, copied: bool = False) -> None:
        """One verification forward: `num_drafts` drafts handed over (`copied` from the context), the first
        `num_accepted` committed."""
        self.verify_lengths.append(num_drafts)
        self.acceptance_lengths.append(num_accepted + 1)
        self.drafted_tokens += num_drafts
        self.accepted_tokens += num_accepted
        if copied:
            self.copied_steps += 1
            self.copied_accepted_tokens += num_accepted

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens committed per verification forward (0.0 before any)."""
        if not self.acceptance_lengths:
            return 0.0
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    @property
    def plain_steps(self) -> int:
        """Verification forwards that verified no draft (the adaptive policy found drafting did not pay)."""
        return sum(1 for n in self.verify_lengths if n == 0)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens that were committed."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def num_target_forwards(self) -> int:
        """Verification forwards plus the prefill."""
        return len(self.acceptance_lengths) + 1

    @property
    def committed_tokens(self) -> int:
        return sum(self.acceptance_lengths)

    def as_dict(self) -> dict:
        """The counters and the figures derived from them, JSON-ready (a batch's rows each as their own)."""
        values = {f.name: copy.copy(getattr(self, f.name)) for f in fields(self) if f.name != "rows"}
        for name in ("mean_acceptance_length", "acceptance_rate", "num_target_forwards", "plain_steps"):
            values[name] = getattr(self, name)
        return values | ({"rows": [row.as_dict() for row in self.rows]} if self.rows else {})


@dataclass
class DFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus this call's `dflash_stats` (`return_dict_in_generate=True`)."""

    dflash_stats: DFlashStats | None = None


__all__ = ["DFlashGenerateOutput", "DFlashStats"]
