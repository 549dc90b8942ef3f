"""The engine's overhead over a hand-written SPMD ZeRO-2 loop, by model size, with and
without gradient accumulation, and the peak host memory each one needs.

    python benchmarks/engine_overhead.py [--cases mlp-1M,mlp-17M,gpt2-100M-1k] [--gas 1,4]
    python benchmarks/engine_overhead.py --paired [--cores 1] --windows 8   # both sides in one process
    python benchmarks/engine_overhead.py --tpu v5e:2x4      # both steps compiled for a TPU, side by side
    python benchmarks/engine_overhead.py --memory v5e:2x4   # where the host memory goes

For each model and gradient_accumulation_steps, the engine (ZeRO-2, AdamW, no clipping) and
the hand loop run in separate processes on 8 CPU devices, interleaved (engine, hand,
engine, hand), each timing several windows of optimizer steps after warm-up; the table
shows the minimum step time of each and their ratio, in wall time and in the process's CPU
time (all its threads: the work done, which other jobs on a shared machine disturb far
less than the wall time). Each process also reports its own peak RSS, next to ZeRO's
accounting of the model states all 8 devices hold together (8 x (4P + 12P/8) bytes:
replicated fp32 params, sharded fp32 gradients and Adam moments). The hand loop's RSS is
what XLA:CPU needs for the same work without the engine.

``--paired`` runs both sides in one process instead, their timed windows alternating, and
adds the median of the adjacent windows' ratios: run to run, separate processes moved the
ratio by 10-25% on the shared two-core machine (docs/benchmarks.md).

``--tpu TOPOLOGY`` compiles both sides' step (gas 1) for 8 TPU chips with libtpu's
compile-only client instead and prints the compiler's figures side by side: the roofline
step time, HBM bytes accessed, bytes sent per chip, all-reduced bytes and temporaries. They
do not move with the load on this machine, and they are what a TPU runs: XLA:CPU has no
reduce-scatter (it all-reduces and slices), which is where the two sides' CPU times part
for GPT-2 at few tokens per step.

``--memory TOPOLOGY`` explains the RSS instead: the temporaries XLA:CPU's buffer assignment
gives each device for the engine's step programs, against the TPU program of the same step
compiled ahead of time for TOPOLOGY (8 chips, ``spmdzero.aot``), and the measured peak RSS.

The hand loop (issue #15): torch.optim.AdamW on replicated params, its moments created
eagerly and annotated with the ZeRO spec, ``mark_sharding(p.grad, ZeRO spec)`` after each
backward, params re-annotated replicated after ``step()``.

The torch_xla backend's benchmark (`SPMDZERO_BACKEND=torch_xla`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("SPMDZERO_BACKEND", "torch_xla")  # the torch_xla backend's benchmark (its children inherit it)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEVICES = 8
CASES = {  # name: (kind, size, batch rows per micro-step, optimizer steps per timed window, windows, rounds)
    "mlp-1M": ("mlp", 512, 64, 5, 3, 2),
    "mlp-17M": ("mlp", 2048, 64, 3, 3, 2),
    "gpt2-100M-1k": ("gpt2", 768, 8, 1, 3, 1),  # 8 x 128 tokens: more tokens per step than the model is wide
    "gpt2-100M": ("gpt2", 768, 8, 1, 2, 1),  # 8 x 32 tokens: fewer, the one regime where the hand loop's layout wins
    "gpt2-100M-2k": ("gpt2", 768, 8, 1, 2, 1),  # 8 x 256 tokens
}
SEQUENCE = {"gpt2-100M-1k": 128, "gpt2-100M": 32, "gpt2-100M-2k": 256}  # tokens per row
# Real training runs thousands of tokens per chip per step, far more than any weight has rows:
# gpt2-100M-1k is the smallest step of that kind (docs/benchmarks.md, "the gradient layout").
# gpt2-100M-2k: 35 s and 15 GiB a step here, run it with --gas 1
DEFAULT_CASES = ("mlp-1M", "mlp-17M", "gpt2-100M-1k")


# ---- child: one variant of one case ---------------------------------------------------------------

def build(case: str, rows: int | None = None):
    """(model, inputs on the host, loss function) for a case; the same seed on both sides."""
    import torch

    kind, size, case_rows = CASES[case][:3]
    rows = rows or case_rows
    torch.manual_seed(0)
    if kind == "mlp":  # 4 x Linear(size, size) + GELU, then Linear(size, 10): 1.05M and 16.8M params
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(size, size), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(size, 10))
        x = torch.randn(rows, size)
        return model, (x,), lambda m, x: m(x).pow(2).mean()
    from transformers import GPT2Config, GPT2LMHeadModel

    # ~96M params, most of them in the 10 blocks; short sequences keep the CPU step short
    seq = SEQUENCE[case]
    config = GPT2Config(vocab_size=32768, n_positions=seq, n_embd=size, n_layer=10, n_head=12)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, config.vocab_size, (rows, seq))
    return model, (tokens,), lambda m, t: m(input_ids=t, labels=t).loss


def engine_config(rows: int, gas: int) -> dict:
    return {"train_batch_size": rows * gas, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4,
                                                                                        "weight_decay": 0.01}}}


class Engine:
    def __init__(self, case: str, gas: int):
        import spmdzero
        from spmdzero.backends.torch_xla.batches import to_device_sharded

        model, inputs, self.loss_fn = build(case)
        self.gas = gas
        self.engine, *_ = spmdzero.initialize(model=model, config=engine_config(inputs[0].shape[0], gas))
        self.inputs = [to_device_sharded(t, self.engine.mesh, self.engine.plan.batch_spec, self.engine.dp_world_size)
                       for t in inputs]  # placed once: time the step, not the input transfer

        self.params = list(self.engine.module.parameters())

    def micro_step(self):
        loss = self.loss_fn(self.engine.module, *self.inputs)
        self.engine.backward(loss)
        return loss

    def step(self):
        for _ in range(self.gas):
            self.micro_step()
            self.engine.step()

    def gradients(self) -> list:
        """What the accumulating micro-steps add into: the engine's sharded gradient shards."""
        return [slot.grad for slot in self.engine._slots]


class Hand:
    def __init__(self, case: str, gas: int):
        import numpy as np
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.spmd as xs

        from hand_zero2 import zero2_adamw
        from spmdzero.backends.torch_xla.annotate import shard

        model, inputs, self.loss_fn = build(case)
        self.gas, self.shard = gas, shard
        self.mesh = xs.Mesh(np.arange(DEVICES), (DEVICES,), ("fsdp",))
        self.model = model.to(torch_xla.device())
        if hasattr(self.model, "tie_weights"):  # .to() an XLA device gives each module its own copy of a
            self.model.tie_weights()            # shared Parameter: a transformers model ties its tables again
        self.opt, self.params, self.specs = zero2_adamw(self.model, self.mesh, lr=1e-4)
        spec = xs.ShardingSpec(self.mesh, ("fsdp",) + (None,) * (inputs[0].dim() - 1))
        self.inputs = xm.send_cpu_data_to_device(list(inputs), torch_xla.device(), spec)
        torch_xla.sync()

    def step(self):
        import torch_xla

        for micro in range(self.gas):
            self.micro_step()
            if micro < self.gas - 1:  # one program per micro-step, as the engine runs them
                torch_xla.sync()
        self.update()
        torch_xla.sync()

    def micro_step(self):
        import torch

        loss = self.loss_fn(self.model, *self.inputs)
        (loss / self.gas if self.gas > 1 else loss).backward()
        with torch.no_grad():
            for p, spec in zip(self.params, self.specs):
                self.shard(p.grad, self.mesh, spec)
        return loss

    def update(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for p, spec in zip(self.params, self.specs):
            self.shard(p, self.mesh, (None,) * p.dim())
            self.shard(self.opt.state[p]["exp_avg"], self.mesh, spec)
            self.shard(self.opt.state[p]["exp_avg_sq"], self.mesh, spec)

    def gradients(self) -> list:
        """What the accumulating micro-steps add into: each parameter's sharded ``.grad``."""
        return [p.grad for p in self.params]

    def state(self) -> list:
        """Everything a step updates in place: each parameter and its two moments."""
        return [t for p in self.params for t in (p, self.opt.state[p]["exp_avg"], self.opt.state[p]["exp_avg_sq"])]


def child(variant: str, case: str, gas: int, steps: int, windows: int) -> None:
    import spmdzero  # noqa: F401  (starts the runtime)
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() for p in build(case)[0].parameters())
    runner = (Engine if variant == "engine" else Hand)(case, gas)
    for _ in range(2):  # warm-up: every program compiled (and run once compiled)
        runner.step()
    xm.wait_device_ops()
    compiles = met.metric_data("CompileTime")[0]
    with open("/proc/self/clear_refs", "w") as f:  # from here the peak RSS is the steps' own, not the compiler's
        f.write("5")
    times, cpu = [], []
    for _ in range(windows):
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            runner.step()
        xm.wait_device_ops()
        times.append((time.perf_counter() - start) / steps)
        cpu.append((time.process_time() - start_cpu) / steps)
    print(json.dumps({"times": times, "cpu": cpu, "params": params, "runtime_rss": start_rss,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "step_rss": step_rss(),
                      "recompiles": met.metric_data("CompileTime")[0] - compiles}), flush=True)


def paired_child(case: str, gas: int, steps: int, windows: int) -> None:
    """Both sides in one process, their timed windows alternating (engine, hand, engine, ...):
    whatever else the machine does at a moment falls on both, where separate processes each
    meet their own share of it. Each window's wall time and the process's CPU time."""
    import spmdzero  # noqa: F401  (starts the runtime)
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    runners = {"engine": Engine(case, gas), "hand": Hand(case, gas)}
    for runner in runners.values():
        for _ in range(2):  # warm-up: every program compiled (and run once compiled)
            runner.step()
    xm.wait_device_ops()
    compiles = met.metric_data("CompileTime")[0]
    times = {name: [] for name in runners}
    cpu = {name: [] for name in runners}
    for _ in range(windows):
        for name, runner in runners.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                runner.step()
            xm.wait_device_ops()
            times[name].append((time.perf_counter() - start) / steps)
            cpu[name].append((time.process_time() - start_cpu) / steps)
    print(json.dumps({"times": times, "cpu": cpu, "recompiles": met.metric_data("CompileTime")[0] - compiles,
                      "params": sum(p.numel() for p in runners["hand"].params)}), flush=True)


def step_rss() -> int:
    """Peak RSS since the last reset of the process's high-water mark (VmHWM)."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


# ---- parent ----------------------------------------------------------------------------------------

# glibc keeps freed blocks for reuse (its mmap threshold rises with every large free); these
# make it hand freed memory back, so the RSS shows what is live rather than what was once used
TRIMMED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def run_child(variant: str, case: str, gas: int, steps: int, windows: int, **env_extra: str) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(DEVICES), "PYTHONPATH": REPO, **env_extra}
    cmd = [sys.executable, __file__, "--child", variant, case, str(gas), str(steps), str(windows)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} {case} gas={gas} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def timing(args) -> None:
    gib = 2**30
    print(f"{DEVICES} CPU devices; min over interleaved processes per side x windows x optimizer steps "
          f"({', '.join('{}: {} x {} x {}'.format(c, rounds(c, args), *window(c, args)[::-1]) for c in args.cases)}); "
          f"load average {os.getloadavg()[0]:.1f} at the start\n")
    print("| model | params | gas | engine step (ms) | hand step (ms) | engine / hand | engine CPU (s/step) | "
          "hand CPU (s/step) | engine / hand, CPU | ZeRO model states, 8 devices (GiB) | engine peak RSS stepping "
          "(GiB) | hand peak RSS stepping (GiB) | recompiles while timed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        for gas in args.gas:
            runs = {"engine": [], "hand": []}
            for _ in range(rounds(case, args)):
                for variant in runs:
                    runs[variant].append(run_child(variant, case, gas, *window(case, args)))
            best = {v: min(t for r in rs for t in r["times"]) for v, rs in runs.items()}
            cpu = {v: min(t for r in rs for t in r["cpu"]) for v, rs in runs.items()}
            peak = {v: max(r["step_rss"] for r in rs) for v, rs in runs.items()}
            P = runs["engine"][0]["params"]
            recompiles = sum(r["recompiles"] for rs in runs.values() for r in rs)
            print(f"| {case} | {P:,} | {gas} | {best['engine'] * 1e3:.1f} | {best['hand'] * 1e3:.1f} | "
                  f"{best['engine'] / best['hand']:.3f} | {cpu['engine']:.2f} | {cpu['hand']:.2f} | "
                  f"{cpu['engine'] / cpu['hand']:.3f} | {accounting(P) / gib:.2f} | {peak['engine'] / gib:.2f} | "
                  f"{peak['hand'] / gib:.2f} | {recompiles} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs)")


def paired(args) -> None:
    """``--paired``: engine and hand loop in one process per case and gas (see paired_child).
    The ratio of each adjacent pair of windows, in wall time and in CPU time, and their
    median: a load change between pairs moves both sides of a pair together. ``--cores N``
    pins the process to N cores (1: the 8 devices' threads take turns on one core, so the
    wall time is the work done, with no waits for a second core that another job holds)."""
    print(f"{DEVICES} CPU devices; both sides in one process, windows alternating"
          f"{f', pinned to {args.cores} core(s)' if args.cores else ''}; load average "
          f"{os.getloadavg()[0]:.1f} at the start\n")
    print("| model | params | gas | windows x steps | engine step, min (ms) | hand step, min (ms) | engine / hand, "
          "wall: median of pairs (range) | engine / hand, CPU: median of pairs (range) | recompiles while timed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        for gas in args.gas:
            steps, windows = window(case, args)
            env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(DEVICES), "PYTHONPATH": REPO}
            cmd = [sys.executable, __file__, "--paired-child", case, str(gas), str(steps), str(windows),
                   str(args.cores or 0)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                raise RuntimeError(f"paired {case} gas={gas} failed:\n{proc.stderr[-3000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            engine, hand = result["times"]["engine"], result["times"]["hand"]
            print(f"| {case} | {result['params']:,} | {gas} | {windows} x {steps} | {min(engine) * 1e3:.1f} | "
                  f"{min(hand) * 1e3:.1f} | {pair_ratios(engine, hand)} | "
                  f"{pair_ratios(result['cpu']['engine'], result['cpu']['hand'])} | {result['recompiles']} |",
                  flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs)")


def pair_ratios(engine: list[float], hand: list[float]) -> str:
    """'median (lowest-highest)' of the ratios of adjacent windows."""
    pairs = sorted(e / h for e, h in zip(engine, hand))
    half = len(pairs) // 2
    median = pairs[half] if len(pairs) % 2 else (pairs[half - 1] + pairs[half]) / 2
    return f"{median:.3f} ({pairs[0]:.3f}-{pairs[-1]:.3f})"


def window(case: str, args) -> tuple[int, int]:
    """(optimizer steps per timed window, windows) for a case: its own unless overridden."""
    return args.steps or CASES[case][3], args.windows or CASES[case][4]


def rounds(case: str, args) -> int:
    """Processes per side for a case: its own unless overridden."""
    return args.rounds or CASES[case][5]


def accounting(params: int) -> float:
    """ZeRO-2's model states on all devices together: replicated fp32 params, sharded fp32
    gradients and Adam moments."""
    return DEVICES * (4 * params + 12 * params / DEVICES)


# ---- --memory: where the host memory goes ------------------------------------------------------

def cpu_temporaries(dump: str) -> int:
    """The largest per-device temporary allocation XLA:CPU's buffer assignment gave a step
    program (one program runs at a time; each of the 8 devices holds its own)."""
    sizes = [0]
    for path in glob.glob(os.path.join(dump, "*SyncTensorsGraph*buffer-assignment.txt")):
        with open(path) as f:
            sizes += [int(n) for n in re.findall(r"^allocation \d+: size (\d+), preallocated-temp", f.read(), re.M)]
    return max(sizes)


def engine_tpu_report(case: str, gas: int, topology: str):
    """The engine's ZeRO-2 step for this case compiled for a TPU topology (shape-only)."""
    import torch

    import spmdzero  # noqa: F401  (starts the runtime)
    from spmdzero.aot.steps import compile_step
    from spmdzero.aot.models import ModelSource

    class WithLoss(torch.nn.Module):  # the forward returns the loss, as aot's model sources do
        def __init__(self):
            super().__init__()
            self.model, _, self.loss_fn = build(case)

        def forward(self, *inputs):
            return self.loss_fn(self.model, *inputs)

    source = ModelSource(case, WithLoss, lambda m, rows: (build(case, rows)[1], {}), lambda loss: loss)
    return compile_step(source, engine_config(CASES[case][2], gas), topology, stage=2)


def hand_tpu_report(case: str, topology: str):
    """The hand loop's step (gas 1) traced on this process's devices, not executed, and
    compiled for a TPU topology as spmdzero.aot compiles the engine's: exported as StableHLO,
    each parameter's and moment's old buffer donated to its new value."""
    hand = Hand(case, 1)
    before = [t.clone() for t in hand.state()]  # the values before the step: the program's inputs
    loss = hand.micro_step()
    hand.update()
    return traced_tpu_report(hand.state() + [loss], before, hand.params, case, topology)


def micro_tpu_report(variant: str, case: str, topology: str):
    """One side's accumulating micro-step (gas 4, inside the window: forward, backward, and the
    gradient added into what the earlier micro-steps left) compiled for a TPU topology. The
    first micro-step runs here, so that the second one's program reads real accumulators."""
    import torch_xla

    runner = Engine(case, 4) if variant == "engine" else Hand(case, 4)
    runner.micro_step()
    torch_xla.sync()
    before = [g.clone() for g in runner.gradients()]
    loss = runner.micro_step()
    return traced_tpu_report(runner.gradients() + [loss], before, runner.params, case, topology)


def traced_tpu_report(outputs: list, before: list, params: list, case: str, topology: str):
    """Traced ``outputs`` exported as StableHLO and compiled for ``topology``, each tensor of
    ``before`` (the values the step updates in place) donated to its new value; ``params`` are
    the model's parameters, for the report's ZeRO accounting."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    from spmdzero.tpu.report import AotReport
    from spmdzero.tpu.capture import compile_mlir

    lowering = torch_xla._XLAC.lowering.LoweringContext("step")
    lowering.build(outputs)
    donate = [(arg, index) for index, arg in enumerate(map(lowering.tensor_parameter_id, before)) if arg >= 0]
    result = compile_mlir(xm.get_stablehlo(outputs), topology, donate)
    return AotReport(stage=2, gradient_bytes=4 * sum(p.numel() for p in params), micro_batch=CASES[case][2] // DEVICES, **result)


def aot_child(case: str, gas: int, topology: str) -> None:
    report = engine_tpu_report(case, gas, topology)
    print(json.dumps({"memory": report.memory, "chips": report.chips}), flush=True)


def tpu_child(variant: str, case: str, topology: str) -> None:
    """One side's step compiled for ``topology``: the roofline and what it is made of."""
    import spmdzero  # noqa: F401  (starts the runtime)

    if variant.endswith("-micro"):
        report = micro_tpu_report(variant.removesuffix("-micro"), case, topology)
    else:
        report = engine_tpu_report(case, 1, topology) if variant == "engine" else hand_tpu_report(case, topology)
    roofline = report.roofline()
    print(json.dumps({"step_s": roofline["step_s"], "bound": roofline["bound"], "hbm_bytes": report.cost["bytes accessed"],
                      "sent": report.traffic.total_traffic, "temp": report.memory["temp"],
                      "all_reduced": sum(c["bytes"] for k, c in report.collectives.items() if k == "all-reduce")}),
          flush=True)


def tpu(args) -> None:
    """``--tpu TOPOLOGY``: both sides' steps compiled for the TPU (libtpu's compile-only
    client), side by side: the compiler's own figures, which no load on this machine moves.
    With a gas above 1, also the micro-step inside an accumulation window."""
    mib = 2**20
    print(f"The engine's and the hand loop's ZeRO-2 programs compiled for {args.tpu} (8 chips), per chip; "
          "roofline: max(FLOPs / peak, HBM bytes / bandwidth, bytes sent / ICI bandwidth); 'step': a whole "
          "step at gas 1, 'micro-step': one inside an accumulation window (forward, backward, the gradient "
          "added to the accumulated one)\n")
    print("| model | program | engine roofline (ms) | hand roofline (ms) | engine / hand | bound | engine HBM bytes "
          "(MiB) | hand HBM bytes (MiB) | engine sent (MiB) | hand sent (MiB) | engine all-reduced (MiB) | hand "
          "all-reduced (MiB) | engine temporaries (MiB) | hand temporaries (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    programs = [("step", "")] + ([("micro-step", "-micro")] if any(g > 1 for g in args.gas) else [])
    for case in args.cases:
        for program, suffix in programs:
            e, h = (libtpu_child("--tpu-child", variant + suffix, case, args.tpu) for variant in ("engine", "hand"))
            print(f"| {case} | {program} | {e['step_s'] * 1e3:.3f} | {h['step_s'] * 1e3:.3f} | "
                  f"{e['step_s'] / h['step_s']:.3f} | {e['bound']} / {h['bound']} | {e['hbm_bytes'] / mib:,.0f} | "
                  f"{h['hbm_bytes'] / mib:,.0f} | {e['sent'] / mib:,.1f} | {h['sent'] / mib:,.1f} | "
                  f"{e['all_reduced'] / mib:,.1f} | {h['all_reduced'] / mib:,.1f} | {e['temp'] / mib:,.1f} | "
                  f"{h['temp'] / mib:,.1f} |", flush=True)


def libtpu_child(*argv: str) -> dict:
    """This script's child that compiles for a TPU (libtpu, beside other clients): its JSON."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(DEVICES), "PYTHONPATH": REPO,
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    proc = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory(args) -> None:
    mib = 2**20
    print(f"Host memory of the engine's ZeRO-2 step on {DEVICES} CPU devices against the same step compiled for "
          f"{args.memory} (all devices / chips together)\n")
    print("| model | params | gas | ZeRO model states (MiB) | XLA:CPU step temporaries (MiB) | TPU step "
          "temporaries (MiB) | runtime before the model (MiB) | peak RSS stepping (MiB) | the same, glibc "
          "trimming (MiB) | peak RSS with compiles (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        for gas in args.gas:
            with tempfile.TemporaryDirectory() as dump:
                run = run_child("engine", case, gas, 1, 1, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text")
                cpu_temp = cpu_temporaries(dump) * DEVICES
            trimmed = run_child("engine", case, gas, 1, 1, **TRIMMED_MALLOC)
            aot = libtpu_child("--aot-child", case, str(gas), args.memory)
            tpu_temp = aot["memory"]["temp"] * aot["chips"]
            print(f"| {case} | {run['params']:,} | {gas} | {accounting(run['params']) / mib:,.0f} | "
                  f"{cpu_temp / mib:,.0f} | {tpu_temp / mib:,.0f} | {run['runtime_rss'] / mib:,.0f} | "
                  f"{run['step_rss'] / mib:,.0f} | {trimmed['step_rss'] / mib:,.0f} | {run['peak_rss'] / mib:,.0f} |",
                  flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        variant, case, gas, steps, windows = sys.argv[2:7]
        child(variant, case, int(gas), int(steps), int(windows))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--paired-child":
        case, gas, steps, windows, cores = sys.argv[2:7]
        if int(cores):  # before the runtime starts its threads: they inherit it
            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:int(cores)])
        paired_child(case, int(gas), int(steps), int(windows))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--tpu-child":
        tpu_child(*sys.argv[2:5])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--aot-child":
        aot_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--gas", default="1,4")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per timed window (default: per case)")
    parser.add_argument("--windows", type=int, default=None, help="timed windows per process (default: per case)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="processes per variant, interleaved (default: per case)")
    parser.add_argument("--paired", action="store_true",
                        help="both sides in one process, windows alternating (step time only; no RSS)")
    parser.add_argument("--cores", type=int, default=None,
                        help="with --paired: pin the process to this many cores (1: the least noise)")
    parser.add_argument("--tpu", metavar="TOPOLOGY", default=None,
                        help="instead of timing: both sides' steps (gas 1) compiled for TOPOLOGY (8 chips), side by side, "
                             "and with a --gas above 1 their accumulating micro-steps")
    parser.add_argument("--memory", metavar="TOPOLOGY", default=None,
                        help="instead of timing: host memory against the TPU step compiled for TOPOLOGY (8 chips)")
    args = parser.parse_args()
    args.cases = args.cases.split(",")
    args.gas = [int(g) for g in args.gas.split(",")]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)} (choose from {', '.join(CASES)})")
    memory(args) if args.memory else tpu(args) if args.tpu else paired(args) if args.paired else timing(args)


if __name__ == "__main__":
    main()
