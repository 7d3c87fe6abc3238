"""What the OpenRLHF integration keeps per sample: the policy-version clock (weight broadcasts to
vLLM, counted in this process or in a named Ray actor), the stamps of prompts dispatched to vLLM,
and the ``datasource`` of each prompt."""

from __future__ import annotations

import contextvars
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from .._instrumentor import context_value

#: Name of the attribute rlwatch sets on each generated ``Experience`` (OpenRLHF reads dataclass
#: fields only, so it never sees it; it survives pickling through Ray queues).
META = "_rlwatch_meta"
#: Name of the shared version counter actor (async mode), in the job's Ray namespace.
CLOCK_ACTOR = "rlwatch-openrlhf-policy-version"


class _VersionCounter:
    """The Ray actor behind :class:`RayClock` (one per job, named, no CPU)."""

    def __init__(self) -> None:
        self.version = 0

    def bump(self) -> int:
        self.version += 1
        return self.version

    def read(self) -> int:
        return self.version


class LocalClock(_VersionCounter):
    """Weight broadcasts counted in this process (sync mode: generation and broadcast share it)."""

    def __init__(self) -> None:
        super().__init__()
        self.id = f"local:{os.getpid()}"
        self._lock = threading.Lock()

    def bump(self) -> int:
        with self._lock:
            return super().bump()


class RayClock:
    """Weight broadcasts counted in a named Ray actor, shared by the processes of one job: in async
    mode the ``TrainingActor`` broadcasts and the ``GenerateSamplesActor`` stamps. Reads are cached
    for ``ttl`` seconds (a broadcast happens once per training step, seconds to minutes apart)."""

    def __init__(self, ttl: float = 0.05) -> None:
        import ray

        self._ray = ray
        namespace = ray.get_runtime_context().namespace
        self.id = f"ray:{namespace}/{CLOCK_ACTOR}"
        self.handle = ray.remote(num_cpus=0, max_restarts=0)(_VersionCounter).options(
            name=CLOCK_ACTOR, get_if_exists=True).remote()
        self.ttl = ttl
        self._cached: tuple[float, int] | None = None

    def read(self) -> int:
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < self.ttl:
            return self._cached[1]
        value = int(self._ray.get(self.handle.read.remote(), timeout=30))
        self._cached = (now, value)
        return value

    def bump(self) -> int:
        value = int(self._ray.get(self.handle.bump.remote(), timeout=30))
        self._cached = (time.monotonic(), value)
        return value


# --- per-sample stamps ---------------------------------------------------------------------------

@dataclass
class _Dispatch:
    version: int
    remaining: int
    sampling: dict


def sample_meta(experience: Any) -> dict | None:
    """What rlwatch stamped on a generated (single-sample) ``Experience``, or None."""
    try:
        return vars(experience).get(META)
    except TypeError:
        return None


class _DataSources:
    """prompt -> ``datasource`` of the PromptDatasets built in this process (weakly held)."""

    def __init__(self) -> None:
        self._datasets: list[weakref.ref] = []
        self._index: dict[str, str] = {}
        self._indexed: set[int] = set()
        self._lock = threading.Lock()

    def add(self, dataset: Any) -> None:
        with self._lock:
            self._datasets.append(weakref.ref(dataset))

    def lookup(self, prompt: Any) -> str | None:
        if not isinstance(prompt, str):
            return None
        with self._lock:
            live = []
            for ref in self._datasets:
                dataset = ref()
                if dataset is None:
                    continue
                live.append(ref)
                if id(dataset) not in self._indexed:
                    self._indexed.add(id(dataset))
                    for text, source in zip(getattr(dataset, "prompts", []), getattr(dataset, "datasources", [])):
                        if isinstance(text, str):
                            self._index.setdefault(text, str(source))
            self._datasets = live
            return self._index.get(prompt)



class Filtered:
    """The samples OpenRLHF generated but did not keep (``--algo.dynamic_filtering_enable`` drops a
    prompt's group whose mean score is outside ``dynamic_filtering_range``), counted per call of
    ``SamplesGenerator._generate_vllm`` in this process and handed to the next observed step as its
    dropped episodes (reason ``filtered``, with their response lengths and data sources)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: contextvars.ContextVar[list | None] = contextvars.ContextVar("rlwatch_openrlhf_gen", default=None)
        self._dropped: list[tuple[str, float]] | None = None      # None: nothing generated here since the last step

    def scope(self, call: Any) -> Any:
        """Around ``_generate_vllm``: the Experiences processed during the call are collected."""
        call.state = []
        return context_value(self._seen, call.state)

    def saw(self, experience: Any) -> None:
        seen = self._seen.get()
        if seen is not None:
            seen.append(experience)

    def count(self, call: Any) -> None:
        """After ``_generate_vllm`` returned ``(accepted, prompts_consumed, exhausted)``."""
        result = call.result
        accepted = {id(e) for e in (result[0] if isinstance(result, tuple) and result else [])}
        dropped = [((sample_meta(e) or {}).get("env", "default"), float(e.action_mask.sum()))
                   for e in call.state or [] if id(e) not in accepted]
        with self._lock:
            self._dropped = (self._dropped or []) + dropped

    def take(self) -> dict[str, Any] | None:
        """The dropped-episode fields since the last call (``dropped_reasons`` etc.), or None when no
        generation ran in this process (async mode: the generator actor's filter is not seen)."""
        with self._lock:
            dropped, self._dropped = self._dropped, None
        if dropped is None:
            return None
        return {"dropped_reasons": ["filtered"] * len(dropped), "dropped_env": [env for env, _ in dropped],
                "dropped_lengths": [length for _, length in dropped]}

