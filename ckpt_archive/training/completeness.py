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
    out: list[Finding] = []
    nb = "not bitwise-resumable: "
    cc = "could not check: "

    def hidden(part: str) -> str | None:
        """Where ``part`` may be although it is not in the readable state (opaque files, DCP shards)."""
        if dcp:
            return ("the torch.distributed.checkpoint shards (kept byte for byte, not read here) hold the "
                    f"checkpoint's state; {part} state may be inside them")
        names = [u for u in unseen if norm_key(u) in ALIASES.get(part, ()) or part in norm_key(u)]
        if names:
            return f"{part} state is inside an opaque file ({', '.join(names)}), kept byte for byte and never loaded"
        if unseen:
            return (f"no {part} state in the readable files; {len(unseen)} opaque file(s) ({', '.join(unseen[:4])}"
                    f"{', ...' if len(unseen) > 4 else ''}) were not read and may hold it")
        return None

    rng_entries = parts.get("rng")
    if not rng_entries and hidden("rng"):
        out.append(Finding("info", "rng", cc + hidden("rng")))
    elif not rng_entries:
        out.append(Finding("warning", "rng", nb + "no RNG state saved (Python, NumPy, torch): dropout masks, "
                           "augmentations and shuffles draw different numbers after the resume"))
    else:
        streams = rng_streams_by_key(rng_entries[0][1])
        if not streams and is_tensor(rng_entries[0][1]):
            streams = {"torch": rng_entries[0][1]}
        missing = [s for s in RNG_STREAMS if s not in streams]
        if missing:
            out.append(Finding("warning", str(rng_entries[0][0]),
                               nb + f"RNG streams missing: {', '.join(missing)}: those draw different numbers "
                               f"after the resume"))
    prog_cursor = (progress or {}).get("cursor")
    data = parts.get("data")
    if not data and prog_cursor is None and not _has_data_order(state):
        # the manifest's progress counts too (what Checkpointer.save(step=) and pack --step record)
        counters = parts.get("progress") or any((progress or {}).get(k) is not None for k in ("step", "epoch"))
        if hidden("data"):
            out.append(Finding("info", "data", cc + hidden("data")))
        elif counters:
            # A script may derive its position in the epoch from the saved step and epoch (and reseed its
            # sampler): then nothing is lost. Only a guess either way.
            out.append(Finding("info", "data", cc + "no data permutation or cursor found, only step/epoch "
                               "counters: if the script derives its position in the epoch from them (and reseeds "
                               "its sampler per epoch), the resume is exact; if not, the resumed run probably "
                               "restarts the epoch's sample order"))
        else:
            out.append(Finding("warning", "data", nb + "no data permutation, cursor or step counter saved: the "
                               "resumed run probably restarts the epoch's sample order, replaying some samples "
                               "and never seeing others"))
    opt = parts.get("optimizer")
    if not opt and hidden("optimizer"):
        out.append(Finding("info", "optimizer", cc + hidden("optimizer")))
    elif not opt:
        out.append(Finding("warning", "optimizer", nb + "no optimizer state: moments and step counters restart "
                           "from zero (Adam's bias correction starts over)"))
    else:
        for path, o in opt:
            st = o.get("state") if isinstance(o, dict) else None
            if not st and not _stateless(o):
                out.append(Finding("warning", f"{path}.state",
                                   nb + "optimizer state is empty: no moments saved, the resumed run restarts "
                                   "them from zero"))
    if not parts.get("scheduler") and opt and any(
            isinstance(g, dict) and "initial_lr" in g for _, o in opt for g in (o.get("param_groups") or [])):
        a = audit(state, progress=progress, keys=keys)
        out.append(Finding("warning", "scheduler", nb + missing_scheduler_message(a.counters)))
    amp = _amp_configured(cfg)
    if amp and not parts.get("scaler") and hidden("scaler"):
        out.append(Finding("info", "scaler", cc + f"AMP configured ({amp}); " + hidden("scaler")))
    elif amp and not parts.get("scaler"):
        out.append(Finding("warning", "scaler", nb + f"AMP configured ({amp}) but no GradScaler state: the loss "
                           f"scale restarts at its initial value, so the first steps after the resume are "
                           f"skipped or scaled differently"))
    return out


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


def archived_config(state: Any, config: Any = None) -> tuple[dict, str]:
    """The run's own config: ``config`` (packed with ``--config``) if given, else the copy inside the state
    (``config``, ``hyper_parameters`` (Lightning), ``hparams``, ``args``, ``cfg``). Returns ``(dict, where)``."""
    cfg = load_config(config) if config else {}
    if cfg:
        return cfg, "the packed config"
    if isinstance(state, dict):
        for key in ("config", "hyper_parameters", "hparams", "args", "cfg"):
            if isinstance(state.get(key), dict) and state[key]:
                return state[key], f"the state's {key}"
    return {}, ""


def config_disagreements(state: Any, config: Any = None) -> list[Finding]:
    """The archived config's LR keys against the optimizer/scheduler state of the same checkpoint.

    A config that says ``lr: 1e-4`` while the state's ``initial_lr`` and ``base_lrs`` say ``1e-6`` means the
    state was not trained (or will not resume) with that config: the resumed run follows the state. Each
    differing field is a warning naming both values and the config key.
    """
    from ckpt_archive.training.session import compare_with_session

    cfg, where = archived_config(state, config)
    if not cfg:
        return []
    out = []
    for d in compare_with_session(state, session_config=cfg, archived_config=cfg):
        key = d.config_key or d.field.rsplit(".", 1)[-1]
        out.append(Finding("warning", d.field,
                           f"{where} says {key} = {fmt_value(d.session)} but the state holds {fmt_value(d.archived)} "
                           f"(takes effect {d.when}): optimizer and scheduler state do not follow the config they "
                           f"were archived with; the resumed run uses the state's value"))
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
