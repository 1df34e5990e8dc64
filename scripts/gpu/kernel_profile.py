"""Summarises ncu's raw CSV (one row per kernel launch, in launch order) of `gpu_bench
--profile`: one 2048-token prefill, one decode step at batch 1, one at batch 128. Each forward
pass starts with the `embed_rows` kernel, which splits the three. Prints, per pass, the total
kernel time and the kernels that take most of it (count, total, share, grid, registers).

Usage: python3 kernel_profile.py profile.csv"""
import csv
import sys
from collections import defaultdict

PASSES = ["prefill 2048 tokens", "decode batch 1", "decode batch 128"]


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main(path):
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.DictReader(lines))
    # ncu's raw page puts a units row first ("nsecond", "usecond", ...).
    unit = "nsecond"
    if rows and number(rows[0].get("gpu__time_duration.sum", "")) is None:
        unit = rows[0].get("gpu__time_duration.sum", unit)
        rows = rows[1:]
    scale = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0,
             "ms": 1.0}.get(unit, 1e-6)
    passes = []
    for row in rows:
        name = row.get("Kernel Name", "?")
        if name.startswith("embed_rows") or not passes:
            passes.append([])
        passes[-1].append(row)
    if len(passes) != len(PASSES):
        print(f"expected {len(PASSES)} forward passes, found {len(passes)}")
    summary = {}
    for title, launches in zip(PASSES, passes):
        per = defaultdict(lambda: [0, 0.0, "", ""])
        total = 0.0
        for row in launches:
            ms = (number(row.get("gpu__time_duration.sum", "")) or 0.0) * scale
            name = row.get("Kernel Name", "?")[:60]
            entry = per[name]
            entry[0] += 1
            entry[1] += ms
            entry[2] = row.get("launch__grid_size", "")
            entry[3] = row.get("launch__registers_per_thread", "")
            total += ms
        print(f"## {title}: {len(launches)} launches, {total:.2f} ms of kernel time")
        print("| kernel | launches | ms | share | grid | regs |")
        print("| --- | --- | --- | --- | --- | --- |")
        top = sorted(per.items(), key=lambda kv: -kv[1][1])[:8]
        for name, (count, ms, grid, regs) in top:
            print(f"| {name} | {count} | {ms:.3f} | {ms / total:.2f} | {grid} | {regs} |")
        summary[title] = {"launches": len(launches), "kernel_ms": round(total, 3),
                          "top": {n: round(v[1], 3) for n, v in top[:4]}}
    import json
    print(json.dumps({"kernel_profile": summary}))


if __name__ == "__main__":
    main(sys.argv[1])
