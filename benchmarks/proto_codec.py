"""Scratch prototype: float-aware codec choices measured on the benchmark state.

Compares, per dtype, on chunks of the same tensors:

* ``zstd``: plain zstd of the raw bytes;
* ``group``: byte grouping (byte k of every element in plane k), each plane zstd'd or stored;
* ``rot+group``: rotate each element left by one bit first (sign to the bottom, so the 8 exponent
  bits of bf16/fp32 share one byte), then byte grouping;
* ``tuned``: byte grouping, all planes in one frame, with ckpt_archive's float parameters
  (``codec.float_params()``: fast strategy, min match 7, tiny tables) -- what the codec ships;
* ``zipnn``: ZipNN on the whole tensor (threads = jobs).

for zstd levels and chunk sizes, with ``jobs`` threads (zstandard and hashlib release the GIL).
Prints ratio (raw/stored) and encode/decode throughput (raw MB/s). Results informed the defaults
in ``ckpt_archive/codec.py``; see benchmarks/README.md.

Run: ``python benchmarks/proto_codec.py --size-mib 128``
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time

import numpy as np
import zstandard

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
STORE_IF_ABOVE = 0.98  # a plane whose zstd output is > 98 % of its size is stored raw


def rotl(x: np.ndarray, bits: int) -> np.ndarray:
    """Rotate each unsigned element left by one bit."""
    return (x << x.dtype.type(1)) | (x >> x.dtype.type(bits - 1))


def rotr(x: np.ndarray, bits: int) -> np.ndarray:
    return (x >> x.dtype.type(1)) | (x << x.dtype.type(bits - 1))


def enc_plain(buf: memoryview, itemsize: int, cctx) -> list:
    return [cctx.compress(buf)]


def dec_plain(parts, itemsize, n, dctx):
    return dctx.decompress(parts[0], max_output_size=n)


def _planes(u8: np.ndarray, itemsize: int, cctx) -> list:
    rows = u8.reshape(-1, itemsize)
    out = []
    for k in range(itemsize):
        plane = np.ascontiguousarray(rows[:, k])
        c = cctx.compress(plane)
        out.append((True, c) if len(c) < STORE_IF_ABOVE * plane.nbytes else (False, plane.tobytes()))
    return out


def enc_group(buf, itemsize, cctx, rotate=False):
    a = np.frombuffer(buf, dtype=np.uint8)
    if rotate:
        a = rotl(a.view(UINT[itemsize]), itemsize * 8).view(np.uint8)
    return _planes(a, itemsize, cctx)


def dec_group(parts, itemsize, n, dctx, rotate=False):
    count = n // itemsize
    rows = np.empty((count, itemsize), dtype=np.uint8)
    for k, (compressed, data) in enumerate(parts):
        plane = dctx.decompress(data, max_output_size=count) if compressed else data
        rows[:, k] = np.frombuffer(plane, dtype=np.uint8)
    if rotate:
        return rotr(rows.reshape(-1).view(UINT[itemsize]), itemsize * 8).view(np.uint8).tobytes()
    return rows.reshape(-1).tobytes()


def enc_tuned(buf, itemsize, cctx):
    a = np.frombuffer(buf, dtype=np.uint8)
    return [cctx.compress(np.ascontiguousarray(a.reshape(-1, itemsize).T))]


def dec_tuned(parts, itemsize, n, dctx):
    planes = np.frombuffer(dctx.decompress(parts[0], max_output_size=n), dtype=np.uint8)
    return np.ascontiguousarray(planes.reshape(itemsize, -1).T).tobytes()


def stored_len(parts) -> int:
    if isinstance(parts[0], (bytes, bytearray)):
        return sum(len(p) for p in parts)
    return sum(len(p[1]) for p in parts)


def bench_method(name, data: bytes, itemsize: int, level: int, chunk: int, jobs: int) -> dict:
    cctxs = {}
    dctxs = {}
    import threading

    def cctx():
        t = threading.get_ident()
        if t not in cctxs:
            if name == "tuned":
                from ckpt_archive.format.codec import float_params
                cctxs[t] = zstandard.ZstdCompressor(compression_params=float_params())
            else:
                cctxs[t] = zstandard.ZstdCompressor(level=level)
        return cctxs[t]

    def dctx():
        t = threading.get_ident()
        if t not in dctxs:
            dctxs[t] = zstandard.ZstdDecompressor()
        return dctxs[t]

    mv = memoryview(data)
    spans = [(o, min(chunk, len(data) - o)) for o in range(0, len(data), chunk)]
    if name == "zstd":
        enc = lambda s: enc_plain(mv[s[0]:s[0] + s[1]], itemsize, cctx())
        dec = lambda p, s: dec_plain(p, itemsize, s[1], dctx())
    elif name == "tuned":
        enc = lambda s: enc_tuned(mv[s[0]:s[0] + s[1]], itemsize, cctx())
        dec = lambda p, s: dec_tuned(p, itemsize, s[1], dctx())
    else:
        rot = name == "rot+group"
        enc = lambda s: enc_group(mv[s[0]:s[0] + s[1]], itemsize, cctx(), rot)
        dec = lambda p, s: dec_group(p, itemsize, s[1], dctx(), rot)
    with cf.ThreadPoolExecutor(jobs) as ex:
        t0 = time.perf_counter()
        encoded = list(ex.map(enc, spans))
        t1 = time.perf_counter()
        decoded = list(ex.map(dec, encoded, spans))
        t2 = time.perf_counter()
    assert b"".join(bytes(d) for d in decoded[:2]) == bytes(mv[:sum(s[1] for s in spans[:2])]), name
    stored = sum(stored_len(p) for p in encoded)
    return {"method": name, "level": level, "chunk_mib": chunk / 2**20, "ratio": len(data) / stored,
            "enc_mbs": len(data) / (t1 - t0) / 1e6, "dec_mbs": len(data) / (t2 - t1) / 1e6}


def bench_zipnn(data: bytes, dtype: str, jobs: int) -> dict:
    try:
        import zipnn
    except ImportError:
        return {"method": "zipnn", "error": "not installed"}
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=jobs)
    if dtype not in ("bfloat16", "float16", "float32"):
        return {"method": "zipnn", "error": f"zipnn does not support {dtype}"}
    buf = bytearray(data)  # zipnn overwrites the buffer it is given
    t0 = time.perf_counter()
    comp = z.compress(buf)
    t1 = time.perf_counter()
    out = z.decompress(comp)
    t2 = time.perf_counter()
    assert bytes(out) == data
    return {"method": "zipnn", "level": 3, "chunk_mib": None, "ratio": len(data) / len(comp),
            "enc_mbs": len(data) / (t1 - t0) / 1e6, "dec_mbs": len(data) / (t2 - t1) / 1e6}


def main() -> None:
    import torch

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from state import build_state

    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=128)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--levels", default="1,2,3")
    ap.add_argument("--chunks-mib", default="1,4,16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    st = build_state(args.size_mib << 20)
    w = [t for t in st["model"].values()]
    m = [s["exp_avg"] for s in st["optimizer"]["state"].values()]
    v = [s["exp_avg_sq"] for s in st["optimizer"]["state"].values()]

    def cat(ts, dtype):
        return torch.cat([t.reshape(-1).to(dtype) for t in ts]).view(torch.uint8).numpy().tobytes()

    sets = {
        "bf16 weights": (cat(w, torch.bfloat16), 2, "bfloat16"),
        "fp16 weights": (cat(w, torch.float16), 2, "float16"),
        "fp32 exp_avg": (cat(m, torch.float32), 4, "float32"),
        "fp32 exp_avg_sq": (cat(v, torch.float32), 4, "float32"),
        "fp64 exp_avg": (cat(m[: max(1, len(m) // 4)], torch.float64), 8, "float64"),
    }
    levels = [int(x) for x in args.levels.split(",")]
    chunks = [int(float(x) * 2**20) for x in args.chunks_mib.split(",")]
    results = []
    for label, (data, isz, zdt) in sets.items():
        print(f"\n== {label}: {len(data) / 2**20:.0f} MiB")
        rows = []
        for lvl in levels:
            for ch in chunks:
                for meth in ("zstd", "group", "rot+group"):
                    rows.append(bench_method(meth, data, isz, lvl, ch, args.jobs))
        for ch in chunks:
            rows.append(bench_method("tuned", data, isz, 0, ch, args.jobs))
        rows.append(bench_zipnn(data, zdt, args.jobs))
        for r in rows:
            r["set"] = label
            if "error" in r:
                print(f"  {r['method']:10s} {r['error']}")
                continue
            print(f"  {r['method']:10s} L{r['level']} chunk {r['chunk_mib'] or '-':>4} MiB  ratio {r['ratio']:.3f}"
                  f"  enc {r['enc_mbs']:7.0f} MB/s  dec {r['dec_mbs']:7.0f} MB/s")
        results += rows
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"size_mib": args.size_mib, "jobs": args.jobs, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
