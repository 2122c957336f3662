#!/usr/bin/env python3
"""Condenses `ncu --csv --metrics gpu__time_duration.sum,dram__throughput...` output.

  ncu_table.py FILE            one line per kernel launch: id, kernel, grid,
                               duration (us), DRAM % of peak; launches before the
                               first decode-step kernel (weight initialisation)
                               are left out
  ncu_table.py --by-name FILE  every launch in the file (a profiler range's),
                               summed by kernel: launches, total and mean us,
                               mean DRAM %, share of the total; then the total
"""
import csv
import sys

by_name = "--by-name" in sys.argv[1:]
path = [a for a in sys.argv[1:] if not a.startswith("--")][0]
rows = {}
with open(path, newline="") as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    key = int(r["ID"])
    e = rows.setdefault(key, {"name": r["Kernel Name"], "grid": r.get("Grid Size", "")})
    v = r["Metric Value"].replace(",", "")
    if r["Metric Name"] == "gpu__time_duration.sum":
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
        e["us"] = float(v) * scale.get(r["Metric Unit"], 1.0)
    else:
        e["dram"] = float(v)

if by_name:
    groups = {}
    for e in rows.values():
        name = e["name"].split("(")[0][:60]
        g = groups.setdefault(name, [0, 0.0, 0.0])
        g[0] += 1
        g[1] += e.get("us", 0.0)
        g[2] += e.get("dram", 0.0) * e.get("us", 0.0)
    total = sum(g[1] for g in groups.values()) or 1.0
    print(f'{"kernel":60s} {"launches":>8s} {"total us":>10s} {"mean us":>8s} {"DRAM %":>6s} {"share":>6s}')
    for name, (n, us, dram_us) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:60s} {n:8d} {us:10.1f} {us / n:8.2f} {dram_us / max(us, 1e-9):6.1f} {100 * us / total:5.1f}%")
    n = sum(g[0] for g in groups.values())
    print(f'{"all":60s} {n:8d} {total:10.1f} {total / max(n, 1):8.2f}')
    sys.exit(0)

started = False
for key in sorted(rows):
    e = rows[key]
    name = e["name"].split("(")[0][:48]
    started |= "rms" in name or "moe" in name
    if not started:
        continue
    print(f'{key:5d} {name:48s} {e["grid"]:>16s} {e.get("us", 0):9.1f} us {e.get("dram", 0):5.1f}%')
