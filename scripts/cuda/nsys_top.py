"""Prints the top rows of an `nsys stats -f csv` report (stdin): time share,
total ms, calls, mean µs and the name, shortened."""
import csv
import sys

rows = list(csv.DictReader(line for line in sys.stdin if "," in line))
if not rows:
    sys.exit("nsys_top.py: empty report")
key = {k.lower(): k for k in rows[0]}


def col(*names):
    for n in names:
        for k, orig in key.items():
            if k.startswith(n):
                return orig
    return None


pct, total, calls, avg, name = (
    col("time (%)", "time(%)"),
    col("total time"),
    col("instances", "num calls", "count"),
    col("avg", "med"),
    col("name"),
)
rows.sort(key=lambda r: float(r[total] or 0), reverse=True)
print(f"{'%':>5} {'total ms':>9} {'calls':>7} {'mean µs':>9}  name")
for r in rows[:25]:
    print(
        f"{float(r[pct]):5.1f} {float(r[total]) / 1e6:9.2f} {r[calls]:>7} "
        f"{float(r[avg]) / 1e3:9.1f}  {r[name][:90]}"
    )
print(f"all: {sum(float(r[total] or 0) for r in rows) / 1e6:.2f} ms in {len(rows)} names")
