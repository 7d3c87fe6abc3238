"""The sequence-level sums: over the sequences with a valid token, of a per-sequence term of s_b, the sum
of r over the sequence (``has``, ``abs``, ``chi2``; ``s`` only compared with a device constant of
:data:`.tokens.SIGNAL_THRESHOLDS`). Their families are in :data:`.tokens.METRICS` (the same vector)."""

from __future__ import annotations

from .declare import SeqSum

SEQ_SUMS: tuple[SeqSum, ...] = (
    SeqSum("seq_n", "has"), SeqSum("seq_abs", "abs"), SeqSum("seq_chi2", "chi2"),
    SeqSum("seq_high", "s", "log_cap"), SeqSum("seq_low", "s", "neg_log_cap", above=False),
    SeqSum("seq_mis_below", "s", "log_low", above=False), SeqSum("seq_mis_above", "s", "log_high"),
)
