"""A realistic training state for the benchmarks: bf16 weights that went through a few Adam steps,
fp32 Adam moments, an optimizer ``state_dict`` with int keys, RNG state and progress.

Why not plain ``torch.randn``: the compressibility of floats lives in their exponents, and an
untrained ``randn`` tensor has one exponent distribution for the whole state. Here every layer gets
its own init scale (``1/sqrt(fan_in)``, LayerNorm gains near 1, zero-initialised biases), rows get
log-normal gain spread, gradients get per-layer scales over four orders of magnitude, an embedding
table has rows that were never seen (all-zero moments), and three real Adam updates are applied in
fp32 before the weights are cast to bf16 -- so exponent statistics look like those of a checkpoint
taken early in a mixed-precision run.

Sizes: the state is ``params * (2 + 4 + 4)`` bytes (bf16 weight + fp32 exp_avg + fp32 exp_avg_sq),
so moments are 80 % of the bytes ("fp32-heavy"); :func:`weights_only` gives the bf16-only state.
"""
from __future__ import annotations

import math

BYTES_PER_PARAM = 10  # bf16 weight + two fp32 moments


def _layer_shapes(d: int, vocab: int, n_layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of a GPT-like model; kind drives the init."""
    shapes: list[tuple[str, tuple[int, ...], str]] = [("embed.weight", (vocab, d), "embed")]
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes += [
            (p + "ln1.weight", (d,), "gain"), (p + "ln1.bias", (d,), "bias"),
            (p + "attn.qkv.weight", (3 * d, d), "linear"), (p + "attn.qkv.bias", (3 * d,), "bias"),
            (p + "attn.out.weight", (d, d), "linear"),
            (p + "ln2.weight", (d,), "gain"), (p + "ln2.bias", (d,), "bias"),
            (p + "mlp.up.weight", (4 * d, d), "linear"), (p + "mlp.up.bias", (4 * d,), "bias"),
            (p + "mlp.down.weight", (d, 4 * d), "linear"),
        ]
    shapes += [("ln_f.weight", (d,), "gain")]
    return shapes


def plan(total_bytes: int) -> tuple[int, int, int]:
    """Pick (d, vocab, n_layers) so the whole state is close to ``total_bytes``.

    Proportions of a small GPT: the embedding is ~10-25 % of the parameters, the rest are blocks.
    """
    n_layers = 6 if total_bytes <= (300 << 20) else 12 if total_bytes <= (1200 << 20) else 16
    vocab = 8192 if total_bytes <= (300 << 20) else 16384
    target = total_bytes / BYTES_PER_PARAM

    def params(d: int) -> int:
        return vocab * d + n_layers * (12 * d * d + 13 * d) + d

    d = min(range(64, 16384, 64), key=lambda d: abs(params(d) - target))
    return d, vocab, n_layers


def build_state(total_bytes: int, seed: int = 0, steps: int = 3) -> dict:
    """Build the benchmark state (a dict as a trainer would ``torch.save`` it).

    Args:
        total_bytes: target raw tensor bytes (within a few %).
        seed: torch RNG seed; the same seed gives bit-identical tensors.
        steps: Adam updates applied before the moments are taken.

    Returns:
        ``{"model": {name: bf16 tensor}, "optimizer": {"state": {int: {"step", "exp_avg",
        "exp_avg_sq"}}, "param_groups": [...]}, "step": int, "epoch": int, "rng": uint8 tensor}``.
    """
    import torch

    d, vocab, n_layers = plan(total_bytes)
    gen = torch.Generator().manual_seed(seed)
    lr, b1, b2, eps = 3e-4, 0.9, 0.999, 1e-8
    model: dict = {}
    opt_state: dict = {}
    for idx, (name, shape, kind) in enumerate(_layer_shapes(d, vocab, n_layers)):
        fan_in = shape[-1] if len(shape) > 1 else shape[0]
        if kind == "embed":
            w = torch.randn(shape, generator=gen) * 0.02
        elif kind == "linear":
            row_gain = torch.exp(torch.randn(shape[0], 1, generator=gen) * 0.3)
            w = torch.randn(shape, generator=gen) * (row_gain / math.sqrt(fan_in))
        elif kind == "gain":
            w = torch.ones(shape)
        else:
            w = torch.zeros(shape)
        # per-layer gradient scale over ~4 orders of magnitude; deeper layers get smaller grads
        gscale = 10 ** (-2.0 - 2.0 * torch.rand((), generator=gen).item())
        m = torch.zeros(shape)
        v = torch.zeros(shape)
        seen = None
        if kind == "embed":  # tokens never seen in these steps keep zero gradients and moments
            seen = (torch.rand(shape[0], 1, generator=gen) < 0.9).float()
        for t in range(1, steps + 1):
            g = torch.randn(shape, generator=gen) * gscale
            if kind == "linear":
                g *= row_gain
            if seen is not None:
                g *= seen
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            mhat = m / (1 - b1 ** t)
            vhat = v / (1 - b2 ** t)
            w.sub_(lr * mhat / (vhat.sqrt() + eps))
            del g, mhat, vhat
        model[name] = w.to(torch.bfloat16)
        opt_state[idx] = {"step": torch.tensor(float(steps)), "exp_avg": m, "exp_avg_sq": v}
        del w
    return {
        "model": model,
        "optimizer": {
            "state": opt_state,
            "param_groups": [{"lr": lr, "betas": (b1, b2), "eps": eps, "weight_decay": 0.0,
                              "amsgrad": False, "foreach": None, "maximize": False,
                              "capturable": False, "differentiable": False, "fused": None,
                              "params": list(range(len(opt_state)))}],
        },
        "step": steps,
        "epoch": 0,
        "rng": torch.get_rng_state(),
    }


def weights_only(state: dict) -> dict:
    """The bf16-only state (model weights and progress), for the bf16 stored-size target."""
    return {"model": state["model"], "step": state["step"]}


def tensor_bytes(obj) -> int:
    """Raw bytes of every tensor in a nested state."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def flat_tensors(obj, prefix: str = "") -> dict:
    """``{"a/b/0": tensor}`` for every tensor (for safetensors and zipnn baselines)."""
    import torch

    out: dict = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}/{i}" if prefix else str(i)))
    return out
