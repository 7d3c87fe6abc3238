"""Public real-run logs and their evaluation: replay each logged run through rlwatch at the shipped
defaults and score the alerts against the step at which the run's own authors say it collapsed.

The corpus (``manifest.json``, ``data/``) holds per-step logs of real RL runs on LLMs written by
others, copied byte for byte from their sources; each run names its source (repository, path,
commit), the collapse step as its authors state it (or none) and its split (``tuning`` or
``test``, assigned by source). docs/real-runs.md lists them.

    python -m evaluation.realruns [--split tuning|test|all] [--out DIR]
"""

from .corpus import CorpusRun, load_run, runs
from .score import RunScore, Summary, score_run, summarise

__all__ = ["CorpusRun", "RunScore", "Summary", "load_run", "runs", "score_run", "summarise"]
