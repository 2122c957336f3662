#!/usr/bin/env python3
"""Condenses `ncu --csv --metrics gpu__time_duration.sum,dram__throughput...` output
into one line per kernel launch: id, kernel, grid, duration (us), DRAM % of peak.
Launches before the first decode-step kernel (weight initialisation) are left out."""
import csv
import sys

rows = {}
with open(sys.argv[1], newline="") as f:
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
started = False
for key in sorted(rows):
    e = rows[key]
    name = e["name"].split("(")[0][:48]
    started |= "rms" in name or "moe" in name
    if not started:
        continue
    print(f'{key:5d} {name:48s} {e["grid"]:>16s} {e.get("us", 0):9.1f} us {e.get("dram", 0):5.1f}%')
