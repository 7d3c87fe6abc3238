"""The group-level quantities: rows of one value per GRPO group slot (:data:`GROUP_ROWS`), the group
block at the end of the episode matrix, and the thresholds a constant group's reward is compared with
(:data:`GROUP_THRESHOLDS`)."""

from __future__ import annotations

from .declare import GroupRow

#: The group block's thresholds, in the device vector's order: the batch's highest usable reward, -lowest
#: (the layout's ``range``), then :func:`.episodes.bound_values`: pass, -fail, the smallest positive float64.
GROUP_THRESHOLDS = ("highest", "neg_lowest", "pass", "neg_fail", "positive")

#: Groups, constant groups, their usable episodes, sizes, B + 1 - size (0 for an empty slot: its maximum
#: gives the smallest group); constant groups at the batch's highest and lowest reward, at the configured
#: pass and fail rewards, and above 0.
GROUP_ROWS: tuple[GroupRow, ...] = (
    GroupRow("groups", lambda g: g["exists"]),
    GroupRow("zero_var", lambda g: g["zero_var"]),
    GroupRow("zero_var_episodes", lambda g: g["zero_var"] * g["size"]),
    GroupRow("size", lambda g: g["size"]),
    GroupRow("size_gap", lambda g: (g["B"] + 1 - g["size"]) * g["exists"]),
    GroupRow("range_pass", base="ref", at="highest"),
    GroupRow("range_fail", base="neg", at="neg_lowest"),
    GroupRow("bounds_pass", base="ref", at="pass"),
    GroupRow("bounds_fail", base="neg", at="neg_fail"),
    GroupRow("sign_pass", base="ref", at="positive"),
)
