"""How much of a training step the host spends tracing: spmdzero ZeRO-2 against the same model
as one ``jax.jit`` step (torchax), on 8 CPU devices, measured side by side in one run.

    python benchmarks/trace_overhead.py            # re-runs itself with 8 CPU devices for both
    python benchmarks/trace_overhead.py --sizes 12x64,124m --configs torchax,torch_xla --steps 3 --repeats 2
    python benchmarks/trace_overhead.py --first-step --sizes 2x64,12x64 --configs scan_layers,scan_stacked

For a transformers GPT-2 built from its config (batch 8, ``attention_mask`` passed, dropout
off, eager attention: transformers' sdpa path reads an all-ones mask back to the host) at 2
and 12 layers, n_embd 64 (host-bound on CPU) and 256, it prints per size and spmdzero
configuration (``torchax``: the default backend, the module traced once under ``jax.jit``;
``torch_xla``: ``"spmd": {"backend": "torch_xla"}``, re-traced by torch_xla every step; and
torch_xla's variants ``scan_layers``: ``"spmd": {"scan_layers": true}``; ``scan_stacked``:
``"spmd": {"scan_layers": "stacked"}``, one parameter per block parameter name; ``compile``:
``engine.compile()``, dynamo's openxla backend on the forward and backward):

* spmdzero step / JAX step: the fastest of interleaved repeats (A, B, A, B, ...) of each;
* tracing share: host time in forward + backward + the update's tracing, over the step time
  (under ``compile``, forward and backward are dynamo running its compiled graphs);
* host CPU share: the same calls' CPU time (thread time) over the step time. On these two
  cores the devices' work competes with the training loop's thread, so the wall time in a call
  also counts the thread waiting for a core (and, under ``torchax``, a dispatch waiting for the
  running program): the CPU share is what the host itself spends, as it would be next to a TPU;
* engine.step tracing: host time of the boundary update (clipping, optimizer, annotations);
* after the table, the host's CPU time (thread time) in forward, backward and the update: wall
  time in a call also counts waiting (the torchax engine's dispatch of a jitted program waits on
  XLA:CPU while its inputs are still in use by the running one); for ``torchax`` also its helper
  thread's, which releases the previous update's inputs (work moved off the training loop);
* graphs per step and recompiles while timed (1 and 0, but ``compile`` runs a graph each for
  the forward, the backward and the update, and ``torchax`` one for the forward and backward
  and one for the update; its recompiles are traces of its jitted programs);
* time to the first step (compilation included) of every configuration but ``compile``, each
  in a fresh process so that no compile cache is shared, and that process's peak host memory
  (max RSS: the model, the runtime and the compile, one configuration alone). ``--first-step`` measures only that,
  with XLA's compile time and the step program's fused computations (from XLA's HLO dump,
  independent of the host's load; the dump adds a little to the time), and prints per
  configuration the deepest size's over the shallowest's (issue #14: how the first step grows
  with depth).

After each size, its configurations' step ratios side by side. ``--sizes 124m`` is GPT-2 small
(12 layers, n_embd 768, 12 heads, vocabulary 50257: 124M parameters) at the same batch and
sequence length; a step takes seconds on a 2-core host. Its parameters, replicated on the 8
devices, fill 4 GiB per copy, and the JAX step and an engine together do not fit a 23 GiB host:
with 124m (or ``--separate``) each configuration and the JAX step run alone, each in a fresh
process, one after the other (``separate``), and the ratios are taken between those processes.

The JAX side is ``torchax.extract_jax`` of the same module with optax's AdamW, parameters
replicated and optimizer states sharded like spmdzero's ZeRO-2, under one ``jax.jit``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SIZES = [(2, 64), (12, 64), (12, 256)]
BATCH, SEQ, VOCAB, DEVICES = 8, 64, 1024, 8
GPT2_124M = (12, 768)  # `--sizes 124m`: GPT-2 small, 12 heads and its 50257-token vocabulary (124M parameters)


def parse_size(size: str) -> tuple[int, int]:
    """``LxW`` (layers x n_embd) or ``124m``."""
    return GPT2_124M if size.lower() == "124m" else tuple(int(v) for v in size.split("x"))


def gpt2(layers: int, width: int):
    """A transformers GPT-2 from its config: 4 heads and a 1024-token vocabulary (host-bound
    sizes), or GPT-2 small's 12 heads and 50257 tokens at 12 x 768."""
    import torch
    import transformers

    heads, vocab = (12, 50257) if (layers, width) == GPT2_124M else (4, VOCAB)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=SEQ, vocab_size=vocab,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)


def batch():
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.ones_like(ids)


def config(variant: str = "torchax") -> dict:
    cfg = {"train_batch_size": BATCH, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    cfg["spmd"] = {"backend": "torchax" if variant == "torchax" else "torch_xla"}
    if variant == "scan_layers":
        cfg["spmd"]["scan_layers"] = True
    if variant == "scan_stacked":
        cfg["spmd"]["scan_layers"] = "stacked"
    return cfg


# torchax: the default backend; torch_xla: "spmd": {"backend": "torch_xla"}, and its variants
CONFIGS = ("torchax", "torch_xla", "scan_layers", "scan_stacked", "compile")


class SpmdzeroRunner:
    def __init__(self, layers: int, width: int, variant: str = "torchax"):
        import spmdzero

        self.engine, *_ = spmdzero.initialize(model=gpt2(layers, width), config=config(variant))
        if variant == "compile":
            self.engine.compile()
        self.ids, self.mask = batch()
        self.host = {"forward": 0.0, "backward": 0.0, "update": 0.0}
        self.cpu = dict.fromkeys(self.host, 0.0)
        for name, attr in (("forward", "forward"), ("backward", "backward"), ("update", "_take_model_step")):
            setattr(self.engine, attr, self._timed(name, getattr(self.engine, attr)))

    def _timed(self, name, fn):
        def wrapper(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.host[name] += time.perf_counter() - start
                self.cpu[name] += time.thread_time() - cpu
        return wrapper

    def step(self) -> None:
        out = self.engine(input_ids=self.ids, attention_mask=self.mask, labels=self.ids)
        self.engine.backward(out.loss)
        self.engine.step()

    def wait(self) -> None:
        wait(self.engine)

    def counts(self) -> tuple[int, int]:
        """(compiles, programs run) so far: torch_xla's metrics, or the torchax engine's counters
        (a trace of a jitted program is its compile)."""
        from spmdzero.observe.monitor import compile_count, graph_count

        if hasattr(self.engine, "traces"):
            return sum(self.engine.traces.values()), sum(self.engine.runs.values())
        return compile_count(), graph_count()


def wait(engine) -> None:
    if hasattr(engine, "traces"):  # spmd.backend='torchax'
        engine.wait()
        return
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()


class JaxRunner:
    def __init__(self, layers: int, width: int):
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax
        import torch
        import torchax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        model = gpt2(layers, width)

        class Loss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, ids, mask):
                return self.model(input_ids=ids, attention_mask=mask, labels=ids).loss

        states, forward = torchax.extract_jax(Loss())
        trainable = {f"model.{n}" for n, _ in model.named_parameters()}
        mesh = Mesh(np.array(jax.devices("cpu")[:DEVICES]), ("fsdp",))
        rep = NamedSharding(mesh, P())

        def zero(a):  # spmdzero's ZeRO spec: split the largest dim (first on ties) when it divides
            if a.ndim == 0 or max(a.shape) % DEVICES:
                return rep
            axis = list(a.shape).index(max(a.shape))
            return NamedSharding(mesh, P(*[("fsdp" if i == axis else None) for i in range(a.ndim)]))

        self.params = jax.device_put({k: v for k, v in states.items() if k in trainable}, rep)
        buffers = jax.device_put({k: v for k, v in states.items() if k not in trainable}, rep)
        self.tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))
        self.opt_state = jax.tree.map(lambda a: jax.device_put(a, zero(a)), self.tx.init(self.params))
        ids, mask = batch()
        rows = NamedSharding(mesh, P("fsdp", None))
        self.ids = jax.device_put(jnp.asarray(ids.numpy()), rows)
        self.mask = jax.device_put(jnp.asarray(mask.numpy()), rows)

        def loss_fn(params, ids, mask):
            return forward({**params, **buffers}, (ids, mask))

        from jax_zero2 import zero2_train_step

        self._step = zero2_train_step(loss_fn, self.tx, zero, rep, self.opt_state)
        self.jax = jax

    def step(self) -> None:
        self.params, self.opt_state, self.loss = self._step(self.params, self.opt_state, self.ids, self.mask)

    def wait(self) -> None:
        self.jax.block_until_ready(self.params)


def release_thread_cpu() -> float:
    """CPU time so far of the torchax backend's thread that releases the update's inputs, 0
    before it starts."""
    import threading

    thread = next((t for t in threading.enumerate() if t.name == "spmdzero-release"), None)
    return 0.0 if thread is None else time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def timed(runner, steps: int) -> float:
    runner.wait()
    start = time.perf_counter()
    for _ in range(steps):
        runner.step()
    runner.wait()
    return (time.perf_counter() - start) / steps


def compare(variant: str, theirs: JaxRunner, layers: int, width: int, steps: int, repeats: int) -> dict:
    """One spmdzero configuration against the JAX step, interleaved; step times are the
    fastest repeat of each (the least disturbed by other load), host times per step the
    fastest too."""
    import warnings

    ours = SpmdzeroRunner(layers, width, variant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # engine.compile() runs several graphs per step: warned, and counted below
        for _ in range(3):  # warm-up: every program compiled
            ours.step()
        ours.wait()
        theirs.step()
        theirs.wait()
        compiles, graphs = ours.counts()
        t_ours, t_theirs, host, cpu = [], [], [], []
        for _ in range(repeats):
            ours.host, ours.cpu = dict.fromkeys(ours.host, 0.0), dict.fromkeys(ours.cpu, 0.0)
            released = release_thread_cpu()
            t_ours.append(timed(ours, steps))
            host.append({k: v / steps for k, v in ours.host.items()})
            cpu.append({k: v / steps for k, v in ours.cpu.items()})
            if variant == "torchax":
                cpu[-1]["release thread"] = (release_thread_cpu() - released) / steps
            t_theirs.append(timed(theirs, steps))
    n = steps * repeats
    compiles_after, graphs_after = ours.counts()
    step_ours, step_theirs = min(t_ours), min(t_theirs)
    tracing = min(sum(h.values()) for h in host)
    busy = min(sum(v for k, v in c.items() if k in host[0]) for c in cpu)  # the training loop's thread only
    return {"config": variant, "ours_ms": 1e3 * step_ours, "jax_ms": 1e3 * step_theirs, "ratio": step_ours / step_theirs,
            "tracing_share": tracing / step_ours, "cpu_share": busy / step_ours,
            "update_ms": 1e3 * min(h["update"] for h in host),
            "graphs_per_step": (graphs_after - graphs) / n, "recompiles": compiles_after - compiles,
            "cpu_ms": {k: 1e3 * min(c[k] for c in cpu) for k in cpu[0]}}


FIRST_STEP = """
import json, resource, sys, time
start = time.perf_counter()
sys.path.insert(0, {here!r})
import spmdzero
if {variant!r} != "torchax":
    spmdzero.runtime.start_torch_xla()
from trace_overhead import gpt2, batch, config, wait
engine, *_ = spmdzero.initialize(model=gpt2({layers}, {width}), config=config({variant!r}))
ids, mask = batch()
ready = time.perf_counter()
out = engine(input_ids=ids, attention_mask=mask, labels=ids)
engine.backward(out.loss)
engine.step()
wait(engine)
compile_time = None
if {variant!r} != "torchax":
    import torch_xla.debug.metrics as met
    compile_time = met.metric_data("CompileTime")  # (count, total ns, samples); None if nothing compiled
print(json.dumps({{"first_step_s": time.perf_counter() - ready,
                  "compile_s": compile_time[1] / 1e9 if compile_time else None,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def first_step(layers: int, width: int, variant: str, count_fusions: bool = False) -> dict | None:
    """{"first_step_s", "compile_s" (XLA compile time within it; None under torchax),
    "peak_rss_mib" (the process's peak host memory: this configuration's alone, model and
    runtime included), "fusions" (with ``count_fusions``)}, or None if it failed."""
    code = FIRST_STEP.format(here=HERE, layers=layers, width=width, variant=variant)
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ)
        if count_fusions:  # XLA writes each compiled program's optimized HLO
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"first step ({layers} layers, {variant}) failed: {proc.stderr.strip().splitlines()[-1]}",
                  file=sys.stderr)
            return None
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if count_fusions:
            result["fusions"] = step_fusions(dump)
    return result


def step_fusions(dump: str) -> int | None:
    """Fused computations in the largest optimized program XLA dumped (the training step): a
    load-independent measure of how much it compiles, where wall times on a shared host are not."""
    programs = glob.glob(os.path.join(dump, "*after_optimizations.txt"))
    if not programs:
        return None
    with open(max(programs, key=os.path.getsize)) as f:
        return sum(1 for line in f if line.startswith("%fused_computation"))


def first_steps(sizes: list, configs: list, repeats: int) -> None:
    """Only the time to first step (trace, compile, run) per size and configuration, each in a
    fresh process, ``repeats`` rounds interleaved, the fastest kept; then per configuration
    and width the deepest size's time over the shallowest's."""
    runs: dict = {}
    for _ in range(repeats):
        for layers, width in sizes:
            for variant in configs:
                result = first_step(layers, width, variant, count_fusions=True)
                if result is not None:
                    runs.setdefault((layers, width, variant), []).append(result)
    best = {key: min(results, key=lambda r: r["first_step_s"]) for key, results in runs.items()}
    print("| layers | n_embd | config | first step (s) | XLA compile (s) | step program fusions |\n"
          "|---|---|---|---|---|---|")
    for (layers, width, variant), r in best.items():
        compiled = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        print(f"| {layers} | {width} | {variant} | {r['first_step_s']:.1f} | {compiled} | {r['fusions']} |")
    for width in sorted({w for _, w in sizes}):
        depths = sorted(l for l, w in sizes if w == width)
        if len(depths) < 2:
            continue
        for variant in configs:
            deep, shallow = best.get((depths[-1], width, variant)), best.get((depths[0], width, variant))
            if deep and shallow:
                fusions = (f", fusions {deep['fusions'] / shallow['fusions']:.2f}x"
                           if deep["fusions"] and shallow["fusions"] else "")
                print(f"{variant}, n_embd {width}: {depths[-1]} / {depths[0]} layers: first step "
                      f"{deep['first_step_s'] / shallow['first_step_s']:.2f}x{fusions}")


ALONE = """
import json, sys
sys.path.insert(0, {here!r})
import spmdzero
if {variant!r} not in ("jax", "torchax"):
    spmdzero.runtime.start_torch_xla()  # before any backward on the host
from trace_overhead import measure_alone
print(json.dumps(measure_alone({layers}, {width}, {variant!r}, {steps}, {repeats})))
"""


def measure_alone(layers: int, width: int, variant: str, steps: int, repeats: int) -> dict:
    """One configuration (``jax``: the JAX step) alone in this fresh process: the time to its
    first step (trace, compile, run), then the fastest of ``repeats`` timings of ``steps`` steps
    after two more warm-up steps, the programs compiled and run while timed, and the process's
    peak host memory."""
    import resource

    runner = JaxRunner(layers, width) if variant == "jax" else SpmdzeroRunner(layers, width, variant)
    start = time.perf_counter()
    runner.step()
    runner.wait()
    first = time.perf_counter() - start
    for _ in range(2):
        runner.step()
    runner.wait()
    counted = variant != "jax"
    compiles, graphs = runner.counts() if counted else (0, 0)
    best = min(timed(runner, steps) for _ in range(repeats))
    compiles_after, graphs_after = runner.counts() if counted else (0, 0)
    return {"step_ms": 1e3 * best, "first_step_s": first, "recompiles": compiles_after - compiles if counted else None,
            "graphs_per_step": (graphs_after - graphs) / (steps * repeats) if counted else None,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def separate(sizes: list, configs: list, steps: int, repeats: int) -> None:
    """Each configuration and the JAX step in a fresh process of its own, one after the other
    (``--separate``): for models whose replicated parameters, twice over, do not fit the host
    (GPT-2 124M on 8 CPU devices), at the price of interleaving."""
    print("| layers | n_embd | config | step (ms) | JAX step (ms) | step / JAX | graphs/step | recompiles | "
          "first step (s) | peak host MiB |\n|---|---|---|---|---|---|---|---|---|---|")
    for layers, width in sizes:
        results = {}
        for variant in ["jax", *configs]:
            code = ALONE.format(here=HERE, layers=layers, width=width, variant=variant, steps=steps, repeats=repeats)
            proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
                print(f"{variant} ({layers} x {width}) failed: {last}", file=sys.stderr, flush=True)
                continue
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        jax_ms = results.get("jax", {}).get("step_ms")
        ratios = []
        for variant in ["jax", *configs]:
            r = results.get(variant)
            if r is None:
                continue
            ratio = f"{r['step_ms'] / jax_ms:.2f}" if jax_ms else "-"
            graphs = "-" if r["graphs_per_step"] is None else f"{r['graphs_per_step']:.2f}"
            recompiles = "-" if r["recompiles"] is None else r["recompiles"]
            print(f"| {layers} | {width} | {variant} | {r['step_ms']:.1f} | {jax_ms or float('nan'):.1f} | {ratio} | "
                  f"{graphs} | {recompiles} | {r['first_step_s']:.1f} | {r['peak_rss_mib']:.0f} |", flush=True)
            if variant != "jax" and jax_ms:
                ratios.append(f"{variant} {r['step_ms'] / jax_ms:.2f}x")
        print(f"  {layers} x {width}, step / one jax.jit step, each alone in its process: {', '.join(ratios)}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default=",".join(f"{l}x{w}" for l, w in SIZES),
                        help="layers x n_embd, ..., or 124m (GPT-2 small)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"spmdzero configurations, of {CONFIGS}")
    parser.add_argument("--first-step", action="store_true",
                        help="only the time to first step, each in a fresh process, --repeats rounds")
    parser.add_argument("--separate", action="store_true",
                        help="each configuration and the JAX step alone in a fresh process (the default with 124m)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(size) for size in args.sizes.split(",")]
    if not args.child:
        env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(DEVICES), "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"}
        command = [sys.executable, __file__, "--child", "--steps", str(args.steps), "--repeats", str(args.repeats),
                   "--sizes", args.sizes, "--configs", args.configs] + ["--first-step"] * args.first_step + [
                   "--separate"] * args.separate
        sys.exit(subprocess.run(command, env=env, cwd=REPO).returncode)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS) | ({"compile"} & set(configs) if args.first_step else set()))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)} (compile: not with --first-step)")
    if args.separate or GPT2_124M in sizes:
        print(f"{DEVICES} CPU devices; GPT-2, batch {BATCH}, seq {SEQ}, vocab {VOCAB} (50257 at 124m); each "
              f"configuration alone in a fresh process: fastest of {args.repeats} timings of {args.steps} steps\n")
        separate(sizes, configs, args.steps, args.repeats)
        return
    if args.first_step:
        print(f"{DEVICES} CPU devices; GPT-2, batch {BATCH}, seq {SEQ}, vocab {VOCAB}; time to the first step "
              f"(trace, compile, run), each in a fresh process, fastest of {args.repeats}\n")
        first_steps(sizes, configs, args.repeats)
        return
    import spmdzero  # noqa: F401  (starts the 8-device runtime before anything else)
    if set(configs) - {"torchax"}:
        spmdzero.runtime.start_torch_xla()  # beside JAX's devices, before any backward on the host
    print(f"{DEVICES} CPU devices; GPT-2, batch {BATCH}, seq {SEQ}, vocab {VOCAB} (50257 at 124m); fastest of {args.repeats} "
          f"interleaved repeats of {args.steps} steps\n")
    print("| layers | n_embd | config | spmdzero step (ms) | JAX step (ms) | spmdzero / JAX | tracing share | "
          "host CPU share | engine.step tracing (ms) | graphs/step | recompiles | first step (s) | peak host MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    show = lambda s: "failed" if s is None else f"{s:.1f}"  # noqa: E731
    cpu_lines, ratios = [], []
    for layers, width in sizes:
        theirs = JaxRunner(layers, width)
        for _ in range(3):
            theirs.step()
        theirs.wait()
        for variant in configs:
            r = compare(variant, theirs, layers, width, args.steps, args.repeats)
            first = first_step(layers, width, variant) if variant != "compile" else None
            cold = show(first and first["first_step_s"]) if variant != "compile" else "-"
            peak = f"{first['peak_rss_mib']:.0f}" if first else "-"
            print(f"| {layers} | {width} | {variant} | {r['ours_ms']:.1f} | {r['jax_ms']:.1f} | {r['ratio']:.2f} | "
                  f"{100 * r['tracing_share']:.0f}% | {100 * r['cpu_share']:.0f}% | {r['update_ms']:.1f} | {r['graphs_per_step']:.2f} | "
                  f"{r['recompiles']} | {cold} | {peak} |", flush=True)
            ratios.append(f"{variant} {r['ratio']:.2f}x")
            cpu = ", ".join(f"{k} {v:.1f} ms" for k, v in r["cpu_ms"].items())
            cpu_lines.append(f"{layers} x {width} {variant}: {cpu}")
        print(f"  {layers} x {width}, step / one jax.jit step, side by side: {', '.join(ratios)}", flush=True)
        ratios = []
    # Wall time in a call counts waiting too: a jitted program's dispatch (torchax) waits while its
    # inputs are still in use by the running one. The host's own CPU time in each call, per step:
    print("\nhost CPU time per step (thread time, fastest repeat):\n  " + "\n  ".join(cpu_lines))


if __name__ == "__main__":
    main()
