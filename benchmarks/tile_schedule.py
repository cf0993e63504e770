"""How unequal a packed call's programs are, and what launching them in the order of their work would save: a model
of the GPU's block scheduler (each program, in launch order, to the first free slot; ``--slots`` programs at once)
over the tiles of our kernels, from the documents' lengths alone (CPU, no GPU needed).

For each kernel (forward and dQ: one program per query tile and query head; dK/dV: per key tile and KV head, or
per query head with ``GQA_EXPAND``) it prints the makespan over the mean load (1.00: no tail) in grid order (tiles
along the grid's first axis, as the kernels launch by default) and in the order of ``TILE_ORDER`` (tiles by their
span, widest first, the heads of a tile together). A program's work is the number of tiles its loop visits (the
span of keys, or of query rows, its rows may see, causal within each document).

Run:  python benchmarks/tile_schedule.py [--lengths 1324,2607,...] [--heads 16] [--kv-heads 4] [--slots 132,264]
(default lengths: varlen_speed.py's documents, seed 0, 16,384 tokens)
"""
from __future__ import annotations

import argparse
import bisect
import heapq

VARLEN_SPEED_DOCS = [1324, 2607, 2933, 576, 2883, 1019, 579, 743, 1673, 2047]


def spans(lengths, tile: int, other: int, rows: bool):
    """Per tile: how many tiles of ``other`` its loop visits (causal within documents). ``rows``: query tiles
    (keys from the first row's document start to the tile's last row); else key tiles (rows from the tile's first
    key to the end of its last key's document)."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    total = starts[-1]
    out = []
    for t in range(0, total, tile):
        last = min(t + tile, total) - 1
        if rows:
            lo = starts[bisect.bisect_right(starts, t) - 1]
            hi = last + 1
        else:
            lo = t
            hi = starts[bisect.bisect_right(starts, last)]
        out.append(-(-(hi - lo // other * other) // other))
    return out


def makespan(works, slots: int) -> float:
    """The last program's end over the mean load of the slots (programs started in order, each on the first free
    slot)."""
    free = [0.0] * slots
    end = 0.0
    for w in works:
        start = heapq.heappop(free)
        end = max(end, start + w)
        heapq.heappush(free, start + w)
    return end / (sum(works) / slots)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default=",".join(map(str, VARLEN_SPEED_DOCS)))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--slots", default="132,264", help="programs resident at once (132 SMs x programs per SM)")
    ap.add_argument("--fwd-tiles", default="128,64", help="forward and dQ tiles: query rows, keys")
    ap.add_argument("--dkdv-tiles", default="128,64", help="dK/dV tiles: keys, query rows")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    slots = [int(x) for x in args.slots.split(",")]
    fm, fn = (int(x) for x in args.fwd_tiles.split(","))
    dn, dm = (int(x) for x in args.dkdv_tiles.split(","))
    group = args.heads // args.kv_heads
    cases = {
        "forward / dQ": (spans(lengths, fm, fn, True), args.heads, 1),
        "dK/dV per KV head": (spans(lengths, dn, dm, False), args.kv_heads, group),
        "dK/dV per query head": (spans(lengths, dn, dm, False), args.heads, 1),
    }
    print(f"{len(lengths)} documents, {sum(lengths)} tokens; makespan / mean load at {slots} programs at once")
    print(f"{'kernel':<22} {'programs':>8}  " + "  ".join(f"grid@{s:<4} by-work@{s:<4}" for s in slots))
    for name, (tiles, heads, mult) in cases.items():
        grid = [w * mult for _ in range(heads) for w in tiles]
        by_work = [w * mult for w in sorted(tiles, reverse=True) for _ in range(heads)]
        cells = "  ".join(f"{makespan(grid, s):9.2f} {makespan(by_work, s):12.2f}" for s in slots)
        print(f"{name:<22} {len(grid):8d}  {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
