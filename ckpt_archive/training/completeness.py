"""What a resume from a checkpoint will lose (the completeness lint), and the audit section of a report.

:func:`lint_completeness` names each part a bitwise resume needs and the checkpoint lacks (RNG streams,
data order, optimizer moments, scheduler, GradScaler when AMP is configured). :func:`policy_section`
runs the audit and the lint on a state with its manifest and gives their JSON, for ``inspect`` and
``verify``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_archive.format.config_file import load_config
from ckpt_archive.training.audit import Finding, PolicyAudit, audit, missing_scheduler_message
from ckpt_archive.training.parts import ALIASES, RNG_STREAMS, find_parts, is_tensor, norm_key, rng_streams_by_key
from ckpt_archive.training.session import compare_with_session
from ckpt_archive.training.session_config import archived_config
from ckpt_archive.training.values import flatten, fmt_value


def _amp_configured(cfg: dict) -> str | None:
    """``"fp16=True"`` (the config entry) when the config turns fp16 AMP on, else None (bf16 needs no scaler)."""
    for path, v in flatten(cfg):
        if not path:
            continue
        k = path[-1].lower()
        name = ".".join(path)
        if k in ("fp16", "amp", "use_amp", "half", "use_fp16", "mixed_precision_fp16") and v is True:
            return f"{name}={v!r}"
        if k in ("mixed_precision", "precision", "amp_dtype", "autocast_dtype") and v is not None:
            s = str(v).lower()
            if ("16" in s and "bf16" not in s and "bfloat" not in s) or s == "fp16":
                return f"{name}={v!r}"
    return None


def lint_completeness(state: Any, *, config: dict | str | Path | None = None, progress: dict | None = None,
                      keys: dict | None = None, unseen: list[str] | tuple = (), dcp: bool = False
                      ) -> list[Finding]:
    """What a resume from this state will lose. All findings are warnings ("not bitwise-resumable: ...").

    Checked: RNG state (Python, NumPy, torch CPU; missing streams named), data order (a permutation /
    cursor / sampler state, or a ``cursor`` in ``progress``), optimizer state (missing or with empty
    ``state``: the moments restart), scheduler (missing although the param groups carry ``initial_lr``),
    AMP configured (config ``fp16: true``, ``mixed_precision: fp16``, ``precision: 16-mixed``, ...) without
    GradScaler state.

    ``verify --strict`` turns each of these into a failure (exit 1); without ``--strict`` they are printed
    and the exit code is unaffected.

    Args:
        state: nested checkpoint.
        config: the experiment's config (dict or JSON/YAML/TOML path), used for the AMP check.
        progress: manifest progress (``step``, ``epoch``, ``cursor``).
        keys: part -> path overrides.
        unseen: relpaths of files the lint cannot read (opaque files of a folder source: a pickle never
            loaded). A part not found in the readable state may be inside them: the finding then says
            what could not be seen (severity ``"info"``) instead of asserting the part is missing.
        dcp: the source is (or holds) a torch.distributed.checkpoint folder: its model, optimizer and
            other state live inside the shards, which are kept byte for byte and not read here.

    Returns:
        list of :class:`Finding`: ``"warning"`` for what is missing ("not bitwise-resumable: ..."), ``"info"``
        for what could not be checked or is only a guess ("could not check: ...").
    """
    cfg = load_config(config)
    if not cfg and isinstance(state, dict):  # the trainer's own copy (demo: "config"; Lightning: "hyper_parameters")
        for key in ("config", "hyper_parameters", "hparams", "args", "cfg"):
            if isinstance(state.get(key), dict):
                cfg = state[key]
                break
    parts = find_parts(state, keys)
    hidden = _Hidden(unseen, dcp)
    return (_lint_rng(parts, hidden) + _lint_data(state, parts, progress or {}, hidden)
            + _lint_optimizer(parts, hidden) + _lint_scheduler(state, parts, progress, keys)
            + _lint_scaler(cfg, parts, hidden))


_NB = "not bitwise-resumable: "
_CC = "could not check: "


class _Hidden:
    """Where a part may be although it is not in the readable state (opaque files, DCP shards)."""

    def __init__(self, unseen: list[str] | tuple, dcp: bool):
        self.unseen, self.dcp = list(unseen), dcp

    def __call__(self, part: str) -> str | None:
        if self.dcp:
            return ("the torch.distributed.checkpoint shards (kept byte for byte, not read here) hold the "
                    f"checkpoint's state; {part} state may be inside them")
        names = [u for u in self.unseen if norm_key(u) in ALIASES.get(part, ()) or part in norm_key(u)]
        if names:
            return f"{part} state is inside an opaque file ({', '.join(names)}), kept byte for byte and never loaded"
        if self.unseen:
            return (f"no {part} state in the readable files; {len(self.unseen)} opaque file(s) "
                    f"({', '.join(self.unseen[:4])}{', ...' if len(self.unseen) > 4 else ''}) were not read and may "
                    f"hold it")
        return None


def _lint_rng(parts: dict, hidden: _Hidden) -> list[Finding]:
    rng_entries = parts.get("rng")
    if not rng_entries and hidden("rng"):
        return [Finding("info", "rng", _CC + hidden("rng"))]
    if not rng_entries:
        return [Finding("warning", "rng", _NB + "no RNG state saved (Python, NumPy, torch): dropout masks, "
                        "augmentations and shuffles draw different numbers after the resume")]
    streams = rng_streams_by_key(rng_entries[0][1])
    if not streams and is_tensor(rng_entries[0][1]):
        streams = {"torch": rng_entries[0][1]}
    missing = [s for s in RNG_STREAMS if s not in streams]
    if missing:
        return [Finding("warning", str(rng_entries[0][0]), _NB + f"RNG streams missing: {', '.join(missing)}: those "
                        f"draw different numbers after the resume")]
    return []


def _lint_data(state: Any, parts: dict, progress: dict, hidden: _Hidden) -> list[Finding]:
    """No data permutation, cursor or sampler state. With step/epoch counters (in the state, or the manifest's
    ``progress`` a source recorded, e.g. an Accelerate folder's optimizer step) a script may derive its position
    from them: only a guess either way (info); without any counter a warning."""
    if parts.get("data") or progress.get("cursor") is not None or _has_data_order(state):
        return []
    if hidden("data"):
        return [Finding("info", "data", _CC + hidden("data"))]
    if parts.get("progress") or any(progress.get(k) is not None for k in ("step", "epoch")):
        # A script may derive its position in the epoch from the saved step and epoch (and reseed its
        # sampler): then nothing is lost. Only a guess either way.
        return [Finding("info", "data", _CC + "no data permutation or cursor found, only step/epoch "
                        "counters: if the script derives its position in the epoch from them (and reseeds "
                        "its sampler per epoch), the resume is exact; if not, the resumed run probably "
                        "restarts the epoch's sample order")]
    return [Finding("warning", "data", _NB + "no data permutation, cursor or step counter saved: the "
                    "resumed run probably restarts the epoch's sample order, replaying some samples "
                    "and never seeing others")]


def _lint_optimizer(parts: dict, hidden: _Hidden) -> list[Finding]:
    opt = parts.get("optimizer")
    if not opt and hidden("optimizer"):
        return [Finding("info", "optimizer", _CC + hidden("optimizer"))]
    if not opt:
        return [Finding("warning", "optimizer", _NB + "no optimizer state: moments and step counters restart "
                        "from zero (Adam's bias correction starts over)")]
    return [Finding("warning", f"{path}.state", _NB + "optimizer state is empty: no moments saved, the resumed run "
                    "restarts them from zero")
            for path, o in opt if not (o.get("state") if isinstance(o, dict) else None) and not _stateless(o)]


def _lint_scheduler(state: Any, parts: dict, progress: dict | None, keys: dict | None) -> list[Finding]:
    opt = parts.get("optimizer") or []
    if parts.get("scheduler") or not any(isinstance(g, dict) and "initial_lr" in g
                                         for _, o in opt for g in (o.get("param_groups") or [])):
        return []
    a = audit(state, progress=progress, keys=keys)
    return [Finding("warning", "scheduler", _NB + missing_scheduler_message(a.counters))]


def _lint_scaler(cfg: dict, parts: dict, hidden: _Hidden) -> list[Finding]:
    amp = _amp_configured(cfg)
    if not amp or parts.get("scaler"):
        return []
    if hidden("scaler"):
        return [Finding("info", "scaler", _CC + f"AMP configured ({amp}); " + hidden("scaler"))]
    return [Finding("warning", "scaler", _NB + f"AMP configured ({amp}) but no GradScaler state: the loss "
                    f"scale restarts at its initial value, so the first steps after the resume are "
                    f"skipped or scaled differently")]


def _has_data_order(state: Any) -> bool:
    """Whether the state holds a permutation, cursor or sampler state by a name that says so."""
    if not isinstance(state, dict):
        return False
    for key in state:
        k = norm_key(key)
        if any(w in k for w in ("permutation", "perm", "cursor", "sampler", "sample_order", "data_order",
                                 "batch_idx", "samples_seen", "consumed_samples")):
            return True
    for key, v in state.items():
        if isinstance(v, dict) and norm_key(key) in ALIASES["progress"]:
            if any(k in v for k in ("cursor", "permutation", "batch_idx", "samples_seen", "consumed_samples")):
                return True
    return False


def config_disagreements(state: Any, config: Any = None) -> list[Finding]:
    """The archived config's LR keys against the optimizer/scheduler state of the same checkpoint.

    A config that says ``lr: 1e-4`` while the state's ``initial_lr`` and ``base_lrs`` say ``1e-6`` means the
    state was not trained (or will not resume) with that config: the resumed run follows the state. Each
    differing field is a warning naming both values and the config key. What the next-step model knows is not
    policy carried by the state is not compared (:func:`~ckpt_archive.training.session.compare_with_session`):
    the ``lr`` of a group the script schedules itself (no scheduler state, a hand-written schedule in the
    config), a hyperparameter of a group the script set apart (``weight_decay = 0`` on norms and biases). The
    ``lr`` of a group without scheduler state that is not the config's, with no schedule named, is information:
    the run itself set it (or the config is not the one it ran with), and the resume continues it.
    """
    cfg, where = archived_config(state, config)
    if not cfg:
        return []
    out = []
    for d in compare_with_session(state, session_config=cfg, archived_config=cfg):
        key = d.config_key or d.field.rsplit(".", 1)[-1]
        a, c = fmt_value(d.archived), fmt_value(d.session)
        if d.lr_set_by == "state" and d.field.endswith(".lr"):
            out.append(Finding("info", d.field,
                               f"{where} says {key} = {c} but the state holds {a} and no scheduler state is saved: "
                               f"the script set the LR itself (a hand-written schedule), or the config is not the "
                               f"one the run used; the resumed run uses what the script sets, else {a}"))
            continue
        out.append(Finding("warning", d.field,
                           f"{where} says {key} = {c} but the state holds {a} (takes effect {d.when}): optimizer and "
                           f"scheduler state do not follow the config they were archived with; the resumed run uses "
                           f"the state's value"))
    return out


def policy_section(state: Any, manifest: dict | None = None, decoded: dict | None = None
                   ) -> tuple[PolicyAudit, list[Finding], dict]:
    """Audit + completeness lint of a state, with the manifest's progress and config; and their JSON.

    Args:
        state: the nested state (tensors may be :class:`~ckpt_archive.format.tensor_stub.TensorStub`).
        manifest: the generation's manifest (its ``progress``, ``config`` and ``source.format`` are used).
        decoded: the ``info`` of :func:`ckpt_archive.ops.audit_read.state_for_audit`; when some small
            tensors were left undecoded (``budget``, bytes), the audit's counters say so in
            ``counters["partial"]``.

    Returns:
        ``(audit, completeness findings, {"audit": ..., "completeness": [...]})``.
    """
    progress = (manifest or {}).get("progress") or {}
    config = (manifest or {}).get("config") or {}
    config = config if isinstance(config, dict) else {}  # [issue 17] a manifest's config is any JSON value
    a = audit(state, progress=progress)
    a.findings.extend(config_disagreements(state, config))
    if decoded and decoded.get("small_tensors_decoded", 0) < decoded.get("small_tensors", 0):
        a.counters["partial"] = (f"{decoded['small_tensors_decoded']} of {decoded['small_tensors']} small tensors "
                                 f"decoded (budget {int(decoded.get('budget', 0)) >> 20} MiB): step counters may be "
                                 f"incomplete; audit ckpt_archive.load(...) for all")
    src = (manifest or {}).get("source") or {}
    unseen = [f["relpath"] for f in src.get("files") or [] if f.get("kind") == "opaque"]
    dcp = bool((src.get("info") or {}).get("dcp"))
    lint = lint_completeness(state, config=config, progress=progress, unseen=unseen, dcp=dcp)
    if (manifest or {}).get("source", {}).get("format") in _REBUILDS_DATA_ORDER:
        lint = [f for f in lint if f.field != "data"]
    return a, lint, {"audit": a.to_json(), "completeness": [f.to_json() for f in lint]}

#: Source formats whose trainer rebuilds the data order from its seed and saved step on resume (the HF
#: Trainer re-seeds its sampler and skips ``global_step`` batches), so no saved permutation/cursor is
#: expected; the completeness lint's data-order warning would be a false alarm there.
_REBUILDS_DATA_ORDER = ("hf-trainer",)


def _stateless(opt_sd: dict) -> bool:
    """An optimizer that keeps no per-parameter state, so an empty ``state`` is complete: plain SGD (every
    group's ``momentum`` is 0; torch's ``SGD.step`` stores a momentum buffer only when momentum != 0)."""
    groups = opt_sd.get("param_groups") if isinstance(opt_sd, dict) else None
    return bool(groups) and all(isinstance(g, dict) and g.get("momentum", None) == 0 and "betas" not in g
                                for g in groups)
