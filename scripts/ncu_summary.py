"""Short summaries of Nsight Compute's output (`reports/kernels/ncu_kernels.sh`), for reports/kernels/.

    python3 scripts/ncu_summary.py ncu_prefill.txt [...]           # one line per kernel
    python3 scripts/ncu_summary.py --sass ncu_prefill__K_sass.csv [TOP]  # where one kernel's warps stall

Details pages (`ncu -i REP --page details`): duration, DRAM and L2 throughput as the share of peak,
L2 hit rate, registers per thread, achieved occupancy and local-memory spill requests (register
spills). Source pages (`--page source --csv --print-source sass`): the warp-stall samples by reason,
the TOP instructions by samples with their two main reasons, and the samples by opcode (run 83 found
the selected dk/dv kernel's loop-top wait for the pipelined copies this way).
"""

import collections
import csv
import re
import sys

FIELDS = {  # column: metric name on the details page
    "us": "Duration",
    "DRAM %": "DRAM Throughput",
    "L2 %": "L2 Cache Throughput",
    "L2 hit %": "L2 Hit Rate",
    "regs": "Registers Per Thread",
    "occ %": "Achieved Occupancy",
    "spills": "Local Memory Spilling Requests",
}
TO_US = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "nsecond": 1e-3}
KERNEL = re.compile(r"^  (\w+) \(([\d, ]+)\)x\(([\d, ]+)\)")


def to_number(text):
    """A metric's value as ncu prints it ("1,184", "27.95", "n/a"): a float, or None if not a number."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def kernels(lines):
    """Yields (name, grid, {column: value}) per profiled launch, in launch order."""
    name, grid, vals = None, None, {}
    for line in lines:
        m = KERNEL.match(line)
        if m:
            if name:
                yield name, grid, vals
            name, grid, vals = m.group(1), m.group(2).replace(" ", ""), {}
            continue
        for col, metric in FIELDS.items():
            if col not in vals and line.strip().startswith(metric + " "):
                *_, unit, value = line.split()
                number = to_number(value)
                if number is not None:
                    vals[col] = number * (TO_US.get(unit, 1.0) if col == "us" else 1.0)
    if name:
        yield name, grid, vals


def sass_summary(path, top=25):
    """Warp-stall samples of one kernel's per-instruction table, by reason, instruction and opcode."""
    with open(path) as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]  # rows[0] names the kernel
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = "Warp Stall Sampling (All Samples)"

    def count(row, name):
        return int(to_number(row[col[name]] or "0") or 0)

    data = [r for r in data if to_number(r[col[samples]].strip() or "x") is not None]
    total = sum(count(r, samples) for r in data) or 1
    print(f"{path}: {total} samples")
    by_reason = collections.Counter({c: sum(count(r, c) for r in data) for c in reasons})
    for reason, n in by_reason.most_common(12):
        print(f"  {reason:28} {n:10d} {100 * n / total:5.1f}%")
    print(f"  top {top} instructions:")
    for r in sorted(data, key=lambda r: -count(r, samples))[:top]:
        main_two = sorted(reasons, key=lambda c: -count(r, c))[:2]
        print(f"  {100 * count(r, samples) / total:5.1f}% {r[col['Address']][-5:]} "
              f"{r[col['Source']].strip()[:60]:60} {' '.join(main_two)}")
    by_opcode = collections.Counter()
    for r in data:
        words = r[col["Source"]].split() or ["?"]
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        by_opcode[op.split(".")[0]] += count(r, samples)
    print("  by opcode: " + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_opcode.most_common(15)))


def main(paths):
    cols = list(FIELDS)
    print(f"{'kernel':<32} {'grid':<12}" + "".join(f"{c:>10}" for c in cols))
    for path in paths:
        print(f"# {path}")
        with open(path) as f:
            for name, grid, vals in kernels(f):
                cells = "".join(f"{vals[c]:>10.{0 if c in ('regs', 'spills') else 1}f}" if c in vals
                                else f"{'-':>10}" for c in cols)
                print(f"{name:<32} {grid:<12}{cells}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sass"]:
        sass_summary(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 25)
    else:
        main(sys.argv[1:])
