"""``spmdzero aot`` at real sizes: model x topology x ZeRO stage -> per-chip HBM, fits,
collectives against the data-parallel minimum, roofline step time / MFU, compile time and
the peak host RSS of the whole answer (trace + compile).

    python benchmarks/aot_scale.py                       # every case, one at a time
    python benchmarks/aot_scale.py --cases gpt2-124m@v5e:2x2 --out results.jsonl
    python benchmarks/aot_scale.py --cases llama-7b@v5p:2x4x4 --stacked   # scanned cases with stacked parameters

Each case runs ``python -m spmdzero.aot --json`` in its own process (shape-only trace, one
CPU device per chip; the TPU compile in a grandchild). Peak RSS is the largest of that
process tree (``wait4``'s ru_maxrss). v5e-256 is traced on 64 devices with 4 x the micro-batch and
its shardings moved to 256 chips (``spmdzero.tpu.retarget``). Results are appended to ``--out`` as they come, and a
markdown table is printed at the end. Model configs are in ``benchmarks/configs``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "configs")

# (model config, DeepSpeed config, topology, stages, scan_layers); v5p-64 is 32 chips (2 TensorCores
# a chip). The 7B compiles with its 32 layers as one loop (--scan-layers): unrolled, libtpu needed
# more than the 14 GiB this machine had free.
CASES = [  # in the order they run: 4-chip cases first (16-chip figures depend on the mesh layout)
    ("gpt2-124m", "zero2-fp32", "v5e:2x2", "0,2", False),
    ("gpt2-350m", "zero2-fp32", "v5e:2x2", "2", False),
    ("gpt2-774m", "zero2-fp32", "v5e:2x2", "2", False),
    ("gpt2-1.5b", "zero2-fp32", "v5e:2x2", "2", False),
    ("llama-7b", "zero2-bf16", "v5p:2x4x4", "2", True),
    ("gpt2-124m", "zero2-fp32", "v5e:4x4", "2", False),
    ("gpt2-350m", "zero2-fp32", "v5e:4x4", "2", False),
    ("gpt2-774m", "zero2-fp32", "v5e:4x4", "2", False),
    ("gpt2-1.5b", "zero2-fp32", "v5e:4x4", "2", False),
    ("llama-7b", "zero2-bf16", "v5e:16x16", "2", True),  # traced on 64 devices (spmdzero.tpu.retarget)
]


def run_case(model: str, ds: str, topology: str, stages: str, scan: bool | str, seq_len: int,
             micro_batch: int) -> dict:
    from spmdzero.aot.command import scan_layers_args
    from spmdzero.tpu.retarget import trace_devices

    env = {**os.environ, "CPU_NUM_DEVICES": str(trace_devices(topology)), "PJRT_DEVICE": "CPU"}
    command = [sys.executable, "-m", "spmdzero.aot", "--json", "--topology", topology, "--stages", stages,
               "--model", os.path.join(CONFIGS, f"{model}.json"),
               "--deepspeed_config", os.path.join(CONFIGS, f"{ds}.json"),
               "--seq-len", str(seq_len), "--micro-batch", str(micro_batch)] + scan_layers_args(scan)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True)
        # wait4, not communicate: its rusage is this case's process tree alone
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    row = {"model": model, "config": ds, "topology": topology, "scan_layers": scan,
           "seconds": time.perf_counter() - start,
           "peak_rss_gib": usage.ru_maxrss / 2**20}  # KiB on Linux
    if proc.returncode != 0:
        failed = [line for line in stderr.splitlines() if line.startswith("spmdzero aot:")]
        row["error"] = failed[-1] if failed else f"exit {proc.returncode}: {stderr.strip()[-300:]}"
        return row
    row["result"] = json.loads(stdout[stdout.index("{"):])
    return row


def refreshed(row: dict) -> dict:
    """The row with each report's derived figures (roofline, traffic) recomputed by the
    current ``AotReport`` from the measured ones (memory, collectives, cost)."""
    import dataclasses

    from spmdzero.tpu.report import AotReport

    if "error" in row:
        return row
    names = {f.name for f in dataclasses.fields(AotReport)}
    reports = [AotReport(**{k: v for k, v in r.items() if k in names}).to_dict() for r in row["result"]["reports"]]
    return {**row, "result": {**row["result"], "reports": reports}}


def table(rows: list[dict]) -> str:
    lines = ["| model | topology | stage | per-chip HBM (GiB) | fits | traffic / minimum | roofline step (ms) "
             "| MFU | compile (s) | case wall (s) | peak host RSS (GiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        scan = row.get("scan_layers")
        name = row["model"] + (f" (scan_layers {scan})" if isinstance(scan, str) else " (scan_layers)" if scan else "")
        if "error" in row:
            lines.append(f"| {name} | {row['topology']} | | error: {row['error'][:120]} | | | | | | "
                         f"{row['seconds']:.0f} | {row['peak_rss_gib']:.1f} |")
            continue
        for r in row["result"]["reports"]:
            label = name + (f", {r['micro_batch']} seq/chip" if r.get("micro_batch") not in (None, 4) else "")
            roof = r["roofline"] or {}
            fits = "yes" if r["fits"] else f"NO (+{r['over_by'] / 2**30:.2f})"
            ratio = f"{r['traffic']['ratio']:.2f}" if "traffic" in r else "-"
            step = f"{roof['step_s'] * 1e3:.0f} ({roof['bound']})" if roof else "-"
            mfu = f"{roof['mfu']:.0%}" if roof.get('mfu') is not None else "-"
            oom = r.get("out_of_memory")  # the compiler's usable HBM, a little under the chip's
            hbm = (f"{oom['capacity'] / 2**30:.2f} usable" if oom and "capacity" in oom
                   else f"{r['hbm_per_chip'] / 2**30:.0f}")
            lines.append(f"| {label} | {row['topology']} | {r['stage']} | {r['total_bytes'] / 2**30:.2f} "
                         f"of {hbm} | {fits} | {ratio} | {step} | {mfu} | "
                         f"{r['compile_seconds']:.0f} | {row['seconds']:.0f} | {row['peak_rss_gib']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=None, help="comma-separated MODEL@TOPOLOGY (default: all)")
    parser.add_argument("--out", default=os.path.join(HERE, "aot_scale.jsonl"),
                        help="JSON lines, appended as cases finish")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per chip")
    parser.add_argument("--stacked", action="store_true",
                        help="compile the scanned cases with stacked layer parameters (spmd.scan_layers='stacked')")
    parser.add_argument("--table", default=None, metavar="JSONL",
                        help="print the table of earlier results; run nothing")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            print(table([refreshed(json.loads(line)) for line in f if line.strip()]))
        return 0
    wanted = set(args.cases.split(",")) if args.cases else None
    rows = []
    for model, ds, topology, stages, scan in CASES:
        if wanted is not None and f"{model}@{topology}" not in wanted:
            continue
        print(f"{model} on {topology} (stages {stages}) ...", file=sys.stderr, flush=True)
        scan = "stacked" if scan and args.stacked else scan
        row = run_case(model, ds, topology, stages, scan, args.seq_len, args.micro_batch)
        rows.append(row)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
