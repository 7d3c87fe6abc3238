"""The step record: one training step's data, normalised and validated.

:meth:`RecordBuilder.build` turns a step's :class:`~rlwatch.core.fields.StepFields` (tensors on any
device, numpy arrays, lists) into a :class:`StepRecord` whose tensors share the mask's device. The
tensors are checked by shape and dtype only, with no host sync; ``step`` and ``trainer_version`` are host
numbers, read with ``.item()`` when passed as tensors (a sync if those live on an accelerator).
A field that cannot be used is reported to :class:`~rlwatch.core.errors.HookErrors` (which raises in
strict mode) and dropped; the rest of the record is still used.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Protocol

import torch

from .errors import HookErrors
from .fields import FIELDS, StepFields
from ..signals.inputs import StepRecord
from .rollout import RolloutParser


class BufferPool(Protocol):
    """Reusable buffers (``rlwatch.signals.Workspace`` is one): the record's float mask is written into
    ``get("mask", shape, float32, device)`` instead of a new tensor each step. A protocol here, so
    that the record does not import the signals that read it."""

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

#: Per-token fields, [B, T] like the mask.
TOKEN_FIELDS = ("sampler_logp", "trainer_logp", "entropy", "updated_logp")

MAX_LABEL_LENGTH = 120
DEFAULT_LABEL = "default"
OTHER_LABEL = "other"
#: Longest phase label; a longer name is cut and ends in ``~`` and 8 hex digits of its hash.
PHASE_NAME_LENGTH = 40


def clean_text(value: Any) -> str:
    """``value`` as a string that every sink can encode: labels, the store, notifiers, logs.

    Code points UTF-8 cannot encode (lone surrogates, as ``json.loads('"\\udcff"')`` or
    ``os.fsdecode(b"\\xff")`` produce) become backslash escapes (``\\udcff``); bytes are decoded as
    UTF-8 with the same escapes. Everything else, control characters included, is kept: the
    Prometheus text format escapes what it must, and each text sink escapes for its own syntax.
    The one place every string from the trainer goes through before it reaches a sink."""
    if isinstance(value, (bytes, bytearray)):
        text = bytes(value).decode("utf-8", "backslashreplace")
    else:
        text = value if isinstance(value, str) else str(value)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


class LabelRegistry:
    """Caps the distinct values of one label across a run: the first ``cap`` values seen keep their
    names, later ones become ``other``. Values are made strings and truncated."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.known: dict[str, str] = {}

    def clean(self, value: Any) -> tuple[str, bool]:
        """(label, was_bad): non-strings and over-long strings are converted and flagged."""
        bad = not isinstance(value, str)
        try:
            text = clean_text(value)
        except Exception:  # noqa: BLE001 - a __str__ that raises still gives a label
            text, bad = f"<{type(value).__name__}>", True
        bad |= text is not value and isinstance(value, str)      # a string that needed escaping
        if len(text) > MAX_LABEL_LENGTH:
            text, bad = text[:MAX_LABEL_LENGTH], True
        return (text if text else DEFAULT_LABEL), bad

    def map(self, label: str) -> tuple[str, bool]:
        """(capped label, overflowed)."""
        if label in self.known:
            return self.known[label], False
        if len(self.known) < self.cap:
            self.known[label] = label
            return label, False
        return OTHER_LABEL, True


def _as_tensor(value: Any, device: torch.device | None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach() if value.requires_grad else value       # (an alias otherwise: an operation less)
    else:
        t = torch.as_tensor(value)
    if device is not None and t.device != device:
        t = t.to(device, non_blocking=True)
    return t


def map_labels(items: list[Any], registry: LabelRegistry) -> tuple[list[str], list[int], list[str], bool, bool]:
    """[B] raw labels -> (labels, [B] index into the distinct names, the distinct names in first-seen
    order, whether any was converted, whether any went over the registry's cap). One pass over the
    episodes (not tokens) on the host; equal raw values are cleaned once."""
    names: dict[str, int] = {}
    index: list[int] = []
    labels: list[str] = []
    cache: dict[Any, str] = {}
    bad_label = overflow = False
    for item in items:
        try:
            label = cache[item]
        except (KeyError, TypeError):
            text, bad = registry.clean(item)
            label, over = registry.map(text)
            bad_label |= bad
            overflow |= over
            try:
                cache[item] = label
            except TypeError:
                pass
        labels.append(label)
        index.append(names.setdefault(label, len(names)))
    return labels, index, list(names), bad_label, overflow


def phase_label(name: Any, registry: LabelRegistry, bad: Callable[[str, str, str], None]) -> str:
    """A phase name's label: escaped like every label, a name over :data:`PHASE_NAME_LENGTH`
    characters cut with a hash of the whole name (two names never merge), the run's first
    ``registry.cap`` names kept and later ones ``other`` (counted through ``bad``)."""
    text, _ = registry.clean(name)
    if len(text) > PHASE_NAME_LENGTH:
        import hashlib

        whole = name if isinstance(name, str) else text
        digest = hashlib.sha1(whole.encode("utf-8", "backslashreplace")).hexdigest()[:8]
        text = text[:PHASE_NAME_LENGTH - 9] + "~" + digest
    label, over = registry.map(text)
    if not isinstance(name, str):
        bad("phases", "label", f"phase name of type {type(name).__name__} converted to {text!r}")
    if over:
        bad("phases", "label_cap", f"more than {registry.cap} distinct phase names; the rest are counted as "
                                   f"'{OTHER_LABEL}'")
    return label


def whole_step(value: Any) -> int:
    """A step number as an int64: ints (numpy's too), whole floats (``3.0``) and digit strings;
    ValueError for a fraction (``1.5`` is not step 1), NaN, infinity or a number outside int64."""
    import operator

    try:
        step = operator.index(value)
    except TypeError:
        number = int(value) if isinstance(value, str) else float(value)
        if isinstance(number, float) and not number.is_integer():
            raise ValueError(f"{value!r} is not a whole number") from None
        step = int(number)
    if not -2 ** 63 <= step < 2 ** 63:
        raise ValueError(f"{step} is outside int64")
    return step


class LabelFields:
    """The label-valued fields of a step (``env``, ``failed``) checked and capped per run: a label that is
    not a string, cannot be encoded or is too long is converted, and labels past a cap become
    ``OTHER_LABEL``; both are counted as validation errors."""

    def __init__(self, errors: HookErrors, env_cap: int, failure_kind_cap: int) -> None:
        self.errors = errors
        self.envs = LabelRegistry(env_cap)
        self.failure_kinds = LabelRegistry(failure_kind_cap)

    def _bad(self, field_name: str, kind: str, message: str) -> None:
        self.errors.report("validate", kind, message, field=field_name)

    def labels(self, name: str, value: Any, B: int) -> list[Any] | None:
        if isinstance(value, str):
            return [value] * B
        try:
            items = value.tolist() if hasattr(value, "tolist") else list(value)
        except TypeError:
            self._bad(name, "type", f"expected {B} labels or one string, got {type(value).__name__}")
            return None
        if len(items) != B:
            self._bad(name, "shape", f"{len(items)} labels for {B} sequences")
            return None
        return items

    def env(self, rec: StepRecord, value: Any, B: int, device: torch.device) -> None:
        items = self.labels("env", value if value is not None else DEFAULT_LABEL, B)
        labels, index, rec.env_names, bad_label, overflow = map_labels(
            items if items is not None else [DEFAULT_LABEL] * B, self.envs)
        if bad_label:
            self._bad("env", "label", f"non-string, unencodable or over-long ({MAX_LABEL_LENGTH}+ chars) "
                                    "labels converted")
        if overflow:
            self._bad("env", "label_cap", f"more than {self.envs.cap} distinct environments; the rest "
                                          f"are counted as '{OTHER_LABEL}'")
        rec.env = labels
        rec.env_index = torch.tensor(index, dtype=torch.int64).to(device, non_blocking=True)

    def failed(self, value: Any, B: int) -> list[str | None] | None:
        if value is None:
            return None
        items = self.labels("failed", value, B)
        if items is None:
            return None
        out: list[str | None] = []
        for item in items:
            if item is None or item is False or item == "":
                out.append(None)
                continue
            text, bad = self.failure_kinds.clean(item if item is not True else "failed")
            label, over = self.failure_kinds.map(text)
            if bad or over:
                self._bad("failed", "label", "failure kind converted or over the cap")
            out.append(label)
        return out


class RecordBuilder:
    """Builds :class:`StepRecord` objects for one run, keeping label caps across steps."""

    def __init__(self, errors: HookErrors, env_cap: int = 64, detector_cap: int = 32,
                 failure_kind_cap: int = 32, phase_cap: int = 32) -> None:
        self.errors = errors
        self.labels = LabelFields(errors, env_cap, failure_kind_cap)
        self.envs = self.labels.envs                 # the TRL integration reads its cap
        self.detectors = LabelRegistry(detector_cap)
        self.phases = LabelRegistry(phase_cap)
        self.rollout = RolloutParser(self._bad, lambda items: map_labels(items, self.envs)[0],
                                     lambda name: phase_label(name, self.phases, self._bad))

    def _bad(self, field_name: str, kind: str, message: str) -> None:
        self.errors.report("validate", kind, message, field=field_name)

    def build(self, step: Any, fields: StepFields | Mapping[str, Any], ws: BufferPool | None = None
              ) -> StepRecord | None:
        """Normalise ``fields`` (a mapping: ``observe``'s keywords, ``episodes`` not among them);
        None when the record has no usable mask. The float mask is written into ``ws`` when given
        (valid until the next step)."""
        if not isinstance(fields, StepFields):
            fields = StepFields.from_mapping(fields, episodes=False)
        for name in fields.unknown:
            self._bad(name, "unknown_field", f"unknown field (known: {', '.join(sorted(FIELDS))})")
        try:
            step = whole_step(step.item() if isinstance(step, torch.Tensor) else step)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            self._bad("step", "type", f"step must be an int, got {type(step).__name__} ({exc})")
            return None
        mask = self._mask(fields.mask, ws)
        if mask is None:
            return None
        B, T = mask.shape
        device = mask.device
        rec = StepRecord(step=step, mask=mask)
        for name in TOKEN_FIELDS:
            if getattr(fields, name) is not None:
                setattr(rec, name, self._token_tensor(name, getattr(fields, name), mask))
        self._versions(rec, fields, B, T, device)
        rec.rewards = self._episode_tensor("rewards", fields.rewards, B, device, float_=True)
        rec.group_ids = self._group_ids(fields.group_ids, B, device)
        rec.truncated = self._episode_tensor("truncated", fields.truncated, B, device, bool_=True)
        self.labels.env(rec, fields.env, B, device)
        self._hacked(rec, fields.hacked, B, device)
        rec.failed = self.labels.failed(fields.failed, B)
        self._sampling(rec, fields)
        rec.rollout = self.rollout.parse(fields, B, device)
        return rec

    def _sampling(self, rec: StepRecord, fields: StepFields) -> None:
        for key in ("temperature", "top_p", "top_k"):
            value = getattr(fields, key)
            if value is not None:
                try:
                    rec.sampling[key] = float(value)
                except (TypeError, ValueError):
                    self._bad(key, "type", f"expected a number, got {type(value).__name__}")
        if fields.logprobs_mode is not None:
            rec.sampling["logprobs_mode"], _ = self.labels.failure_kinds.clean(fields.logprobs_mode)

    def _mask(self, value: Any, ws: BufferPool | None) -> torch.Tensor | None:
        if value is None:
            self._bad("mask", "missing", "mask [B, T] is required")
            return None
        try:
            m = _as_tensor(value, None)
        except Exception as exc:  # noqa: BLE001 - any conversion failure is a bad field
            self._bad("mask", "type", f"cannot convert to a tensor: {exc}")
            return None
        if m.dim() != 2:
            self._bad("mask", "shape", f"expected [B, T], got shape {tuple(m.shape)}")
            return None
        if m.numel() == 0:
            self._bad("mask", "empty", f"empty batch (mask shape {tuple(m.shape)}); nothing to compute")
        out = ws.get("mask", m.shape, torch.float32, m.device) if ws is not None else None
        if m.dtype == torch.bool:
            return out.copy_(m) if out is not None else m.to(torch.float32)
        if not (m.dtype.is_floating_point or m.dtype in (torch.int8, torch.int16, torch.int32, torch.int64,
                                                          torch.uint8)):
            self._bad("mask", "dtype", f"expected bool or 0/1 numbers, got {m.dtype}")
            return None
        if m.dtype.is_floating_point:
            m = m.nan_to_num(0.0)
        nonzero = m != 0
        return out.copy_(nonzero) if out is not None else nonzero.to(torch.float32)

    def _token_tensor(self, name: str, value: Any, mask: torch.Tensor) -> torch.Tensor | None:
        try:
            t = _as_tensor(value, None)
        except Exception as exc:  # noqa: BLE001
            self._bad(name, "type", f"cannot convert to a tensor: {exc}")
            return None
        if tuple(t.shape) != tuple(mask.shape):
            self._bad(name, "shape", f"shape {tuple(t.shape)} does not match mask {tuple(mask.shape)}")
            return None
        if t.device != mask.device:
            self._bad(name, "device", f"on {t.device} while mask is on {mask.device}; moved")
            try:
                t = t.to(mask.device)
            except Exception as exc:  # noqa: BLE001 - e.g. a meta tensor holds no data to move
                self._bad(name, "device", f"cannot move to {mask.device}: {exc}; field dropped")
                return None
        if not t.dtype.is_floating_point:
            self._bad(name, "dtype", f"expected floating point log-probs, got {t.dtype}; cast")
            t = t.to(torch.float32)
        return t

    def _episode_tensor(self, name: str, value: Any, B: int, device: torch.device, float_: bool = False,
                        bool_: bool = False) -> torch.Tensor | None:
        if value is None:
            return None
        try:
            t = _as_tensor(value, device).reshape(-1)
        except Exception as exc:  # noqa: BLE001
            self._bad(name, "type", f"cannot convert to a tensor: {exc}")
            return None
        if t.numel() != B:
            self._bad(name, "shape", f"{t.numel()} values for {B} sequences")
            return None
        if bool_:
            return t.to(torch.bool) if t.dtype == torch.bool else t != 0
        if float_:
            return t.to(torch.float64)      # NaN/inf kept: the signals count and exclude them
        return t

    def _versions(self, rec: StepRecord, fields: StepFields, B: int, T: int, device: torch.device) -> None:
        name = "token_version" if fields.token_version is not None else "seq_version"
        value = getattr(fields, name)
        tv = fields.trainer_version
        if tv is not None:
            try:
                tv_f = float(tv.item() if isinstance(tv, torch.Tensor) else tv)
                if not math.isfinite(tv_f):
                    raise ValueError("not finite")
                if abs(tv_f) >= 2.0 ** 53:             # past exact integers (and int64, for the lag)
                    raise ValueError(f"{tv_f:g} is out of range (|version| < 2^53)")
                rec.trainer_version = int(tv_f)
            except (TypeError, ValueError, RuntimeError) as exc:
                self._bad("trainer_version", "type", f"expected an int: {exc}")
        if value is None:
            return
        if rec.trainer_version is None:
            self._bad(name, "missing_trainer_version", "versions given without trainer_version; lag skipped")
            return
        try:
            v = _as_tensor(value, device)
        except Exception as exc:  # noqa: BLE001
            self._bad(name, "type", f"cannot convert to a tensor: {exc}")
            return
        ok_shape = (tuple(v.shape) == (B, T)) or (tuple(v.shape) == (B,)) or (tuple(v.shape) == (B, 2))
        if not ok_shape:
            self._bad(name, "shape", f"shape {tuple(v.shape)}: expected [B, T]={B, T}, [B] or [B, 2]")
            return
        if v.dtype == torch.bool:
            v = v.to(torch.int64)
        if tuple(v.shape) == (B, T) and not v.dtype.is_floating_point:
            # Per-token integer versions: the lag block treats a negative one as no version itself, per
            # chunk (signals/lag.py), instead of a pass over the whole step here.
            rec.version = v
            return
        # NaN, infinite or negative versions are no version: stamped one newer than the trainer, which
        # the lag signals leave out and count (negative_lag_tokens_total, reported as a validate error
        # once the step's values are read), without a host sync here.
        invalid = v < 0
        if v.dtype.is_floating_point:
            invalid |= ~torch.isfinite(v)
        future = torch.full((), rec.trainer_version + 1, dtype=v.dtype, device=v.device)
        v = torch.where(invalid, future, v)
        rec.version = v.round() if v.dtype.is_floating_point else v

    def _group_ids(self, value: Any, B: int, device: torch.device) -> torch.Tensor | None:
        if value is None:
            return None
        if not isinstance(value, torch.Tensor):
            try:
                items = list(value)
            except TypeError:
                self._bad("group_ids", "type", f"expected [B] ids, got {type(value).__name__}")
                return None
            if items and not all(isinstance(x, (int, bool)) or hasattr(x, "__index__") for x in items):
                # String (or other hashable) ids such as verl's uid: number them on the host.
                numbering: dict[Any, int] = {}
                try:
                    items = [numbering.setdefault(x, len(numbering)) for x in items]
                except TypeError:
                    self._bad("group_ids", "type", "ids must be hashable")
                    return None
            value = items
        t = self._episode_tensor("group_ids", value, B, device)
        if t is None:
            return None
        if t.dtype.is_floating_point:
            t = t.nan_to_num(0.0, 0.0, 0.0)
        return t.to(torch.int64)

    def _hacked(self, rec: StepRecord, value: Any, B: int, device: torch.device) -> None:
        if value is None:
            return
        flags = value if isinstance(value, Mapping) else {DEFAULT_LABEL: value}
        for name, v in flags.items():
            text, bad = self.detectors.clean(name)
            label, over = self.detectors.map(text)
            if bad or over:
                self._bad("hacked", "label", f"detector name {text[:40]!r} converted or over the cap")
            t = self._episode_tensor(f"hacked[{label}]", v, B, device, bool_=True)
            if t is not None:
                rec.hacked[label] = t if label not in rec.hacked else (rec.hacked[label] | t)
