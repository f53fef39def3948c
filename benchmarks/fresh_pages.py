"""What taking fresh pages costs ``load`` (issue 29): the byte-plane ungrouping of a repository's tensors
member, chunk by chunk on one thread, into (a) fresh anonymous memory taken by a fault per 4 KiB page,
(b) the same with each chunk's range populated first (``planes.populate``: ``madvise(MADV_POPULATE_WRITE)``,
what ``load`` does now), (c) one ``MAP_POPULATE`` of the whole buffer, (d) pages already taken (no page
cost at all). Rounds alternate the four; thread CPU per raw byte, min / median / max.

Run: ``python benchmarks/fresh_pages.py REPO [--chunks 128] [--rounds 8]`` with ``PYTHONPATH`` at the tree.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import mmap
import os
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    import zstandard

    from ckpt_archive.format import codec, planes
    from ckpt_archive.format.objects import object_key, parts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("repo")
    ap.add_argument("--chunks", type=int, default=128, help="first chunks of the largest tensors member")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args(argv)
    gen = sorted((Path(a.repo) / "generations").iterdir())[-1]
    m = json.loads((gen / "manifest.json").read_text())
    rec = max((x for x in m["members"] if x.get("entries")), key=lambda x: x["raw_bytes"])
    d = zstandard.ZstdDecompressor()
    chunks = []
    for p in parts(rec):
        path = Path(a.repo) / object_key(p.oid) if p.oid else gen / rec["stored_path"]
        with open(path, "rb") as fh:
            for c in p.record["chunks"]:
                stored = os.pread(fh.fileno(), c["stored_bytes"], c["stored_offset"])
                chunks.append((c["codec"], d.decompress(stored, max_output_size=c["raw_bytes"])
                               if c["codec"] != "store" else stored))
    chunks = chunks[:a.chunks]
    raw = sum(len(x) for _, x in chunks)

    def ungroup(out, pop: bool) -> None:
        off = 0
        for name, planes_bytes in chunks:
            n = len(planes_bytes)
            if pop:
                planes.populate(out, off, n)
            dst = memoryview(out)[off:off + n]
            if name in codec._GROUPED:
                k, rot = codec._GROUPED[name]
                planes.byte_ungroup(planes_bytes, k, dst, rotate=rot)
            else:
                dst[:] = memoryview(planes_bytes).cast("B")
            off += n

    def whole_populated():
        return np.frombuffer(mmap.mmap(-1, raw, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE),
                             dtype=np.uint8)

    cases = {"fault per page": lambda: ungroup(planes.anon_buffer(raw), False),
             "populate per chunk (load now)": lambda: ungroup(planes.anon_buffer(raw), True),
             "MAP_POPULATE whole buffer": lambda: ungroup(whole_populated(), False)}
    warm = planes.anon_buffer(raw)
    warm.fill(0)
    cases["pages already taken"] = lambda: ungroup(warm, False)
    res: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.rounds):
        for k, f in cases.items():
            t = time.thread_time()
            f()
            res[k].append((time.thread_time() - t) / raw * 1e9)
    doc = {"stamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ"), "raw_bytes": raw,
           "chunks": len(chunks), "loadavg": os.getloadavg(), "ns_per_raw_byte": res}
    out = HERE / "results" / f"{doc['stamp']}-fresh-pages.json"
    out.write_text(json.dumps(doc, indent=1))
    for k, v in res.items():
        print(f"| {k} | {min(v):.2f} / {statistics.median(v):.2f} / {max(v):.2f} |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
