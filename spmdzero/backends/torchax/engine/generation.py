"""``generate`` on the devices: a part of ``TorchaxEngine`` (``engine.generation``).

A transformers causal LM's ``generate``, called as ``engine.generate(...)``,
``engine.module.generate(...)`` or on the script's own model (``unwrap_model(model).generate``,
TRL's ``unwrap_model_for_generation``), decodes on the devices from the engine's weights where
they are (``programs/generate.py``): no copy of the parameters to the host, one program per
batch, prompt bucket and new-token bucket, no host read per token. Only the new tokens and
their count come back. Greedy search gives transformers' tokens; sampling (temperature, top-k,
top-p, min-p) draws with ``jax.random`` from a seed taken from torch's generator, so
``torch.manual_seed`` makes it reproducible, but the draws are not torch's. The rows are split
over the data-parallel devices when they divide evenly.

What it does not run on the devices yet goes to the host module's own ``generate``, as before,
said once with the reason: beam search, other logits processors than the sampling warpers, the
minimum lengths and the repetition penalty, stopping criteria,
encoder-decoder models, a module in training mode with dropout on (torch's dropout draws),
``inputs_embeds``, outputs other than the token ids (``return_dict_in_generate``). With several
processes every one runs the program with the others, on all of their prompts, and keeps its own
rows (``_agreed``). ``"spmd": {"generate": "host"}`` sends every call there: PyTorch's tokens and draws
exactly (the parity setting). Why a fallback rather than an error: those calls give plain
PyTorch's results today, and a script must not break because one of its calls is not yet fast."""

from __future__ import annotations

import functools
import weakref
import zlib
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from spmdzero.observe.console import say_once
from spmdzero.train import zero_params
from spmdzero.sharding.decode_plan import DATA_AXIS as PLAN_DATA, TENSOR_AXIS, DecodePlan, decode_plan
from spmdzero.sharding.mesh import DATA_AXIS, FSDP_AXES, FSDP_INNER_AXIS, data_parallel_axes, data_parallel_size
from spmdzero.backends.torchax.engine import other_engines
from spmdzero.backends.torchax.programs.decode import cache_shape
from spmdzero.backends.torchax.programs.generate import build_generate

# generate() arguments the device program follows, besides the prompt and its mask
FOLLOWED = frozenset({"max_new_tokens", "max_length", "eos_token_id", "pad_token_id", "do_sample", "num_beams",
                      "use_cache", "synced_gpus", "generation_config", "temperature", "top_k", "top_p", "min_p",
                      "min_length", "min_new_tokens", "repetition_penalty",
                      "bos_token_id", "return_dict_in_generate", "output_scores", "output_logits",
                      "output_attentions", "output_hidden_states", "num_return_sequences"})
# generation-config fields that change nothing in greedy search (the rest would: processors, beams)
NEUTRAL = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "max_length", "max_new_tokens", "do_sample",
                     "num_beams", "temperature", "top_k", "top_p", "use_cache", "transformers_version",
                     "_from_model_config", "decoder_start_token_id", "num_return_sequences",
                     "return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                     "output_hidden_states", "cache_implementation", "min_p", "disable_compile", "compile_config",
                     "min_length", "min_new_tokens", "repetition_penalty"})


class Agreed(NamedTuple):
    """What every process's call runs with (``Generation._agreed``): the longest prompt and
    new-token count of all, and process 0's seed."""

    fed: int
    new: int
    seed: int


def own_length(tokens: np.ndarray, eos: list, least: int) -> int:
    """How many of these new tokens transformers would keep for these rows alone: up to the
    step where the last of them reached EOS (at or after ``least`` tokens), else all."""
    if not eos or tokens.shape[1] == 0:
        return tokens.shape[1]
    ended = np.isin(tokens, eos)
    ended[:, :least] = False
    if not ended.any(axis=1).all():
        return tokens.shape[1]
    return int(ended.argmax(axis=1).max()) + 1


class Knobs(NamedTuple):
    """Sampling's settings, as transformers reads them (``None`` is off)."""

    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1: off
    min_p: float  # 0: off

    def structure(self) -> tuple:
        """What the program is built for: top-k's k (a partial sort of that size), whether top-p
        and min-p run. The temperature and the p values are its inputs."""
        return (self.top_k, self.top_p < 1.0, self.min_p > 0.0)

# generation-config values that leave a processor off (transformers 5.x sets some explicitly)
INACTIVE = {"repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0), "typical_p": (None, 1.0),
            "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0), "min_length": (None, 0),
            "min_new_tokens": (None, 0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
            "diversity_penalty": (None, 0.0), "num_beam_groups": (None, 1), "length_penalty": (None, 1.0),
            "early_stopping": (None, False), "renormalize_logits": (None, False), "guidance_scale": (None, 1.0)}


def bucket(length: int, floor: int) -> int:
    """``length`` rounded up to a power of two, at least ``floor``: each bucket is one compile,
    and a bigger one costs cache slots and prefill work on every call."""
    return max(floor, 1 << max(length - 1, 0).bit_length())


PROMPT_FLOOR, NEW_TOKENS_FLOOR = 32, 16


def library_generate(cls: type) -> bool:
    """Whether ``cls.generate`` is transformers' (or PEFT's around it): the one this part runs. A
    model's own ``generate`` is the script's code and runs as it is."""
    for klass in cls.__mro__:
        if "generate" in klass.__dict__:
            return klass.__module__.split(".")[0] in ("transformers", "peft")
    return False


class GenerationLayout(NamedTuple):
    """Where generation's arrays lie on the training mesh (``NamedSharding``s)."""

    weights: dict  # trained parameter name -> its layout while generating (none: as training holds it)
    rows: Any  # the prompts' and the tokens' rows
    cache: Any  # each layer's KV cache, [batch, kv heads, length, head dim]
    plan: Optional[DecodePlan]  # the tensor-parallel plan at ZeRO-3
    group: tuple = ()  # at ZeRO-3, the mesh axes of a tensor-parallel group


class Generation:
    """The engine's ``generate`` (see the module docstring). Owns the generation programs, by
    batch, prompt bucket, new-token bucket and the module's mode."""

    def __init__(self, engine, where: str):
        self._engine = weakref.proxy(engine)  # the engine holds this part; the part does not keep it alive
        self.where = where  # spmd.generate: "devices", or "host" (the host module's own generate)
        self.programs: dict = {}
        self.calls = 0  # generate() calls run on the devices

    def generate(self, args: tuple, kwargs: dict, on_host):
        """``generate(*args, **kwargs)`` on the devices, or ``on_host()`` (the module's own
        ``generate``) for what they do not run yet, said once with why."""
        why = ('"spmd": {"generate": "host"}' if self.where == "host"
               else self.unsupported(args, kwargs))
        read = self._read(args, kwargs) if why is None else None
        if self.where == "devices" and self._engine.processes > 1:  # every process decides the same
            why, read = self._agreed(why, read)
        if why is not None:
            say_once([f"generate() runs on the host module ({why}): the weights are copied to the host for it"])
            with zero_params.gathered(self._engine.host.wrapped.parameters(), keep_edits=False):  # ZeRO-3's placeholders
                return on_host()
        return self._run(*read)

    def _agreed(self, why: Optional[str], read: Optional[tuple]) -> tuple:
        """With several processes the program runs on all of them, with one prompt bucket,
        new-token budget and seed: each process's call is told the others' (one small exchange
        of integers a call, outside any training step). Any process that cannot run its call on
        the devices sends every process's to its host module; so do calls that differ in what
        the program holds (the batch size, EOS and pad ids, the sampling settings)."""
        from jax.experimental import multihost_utils

        if read is None:
            mine = np.zeros(6, np.int64)
        else:
            ids, mask, new, eos, pad, knobs, least, penalty, seed = read
            shared = zlib.crc32(repr((ids.shape[0], eos, pad, knobs, least, penalty)).encode())
            mine = np.array([1, ids.shape[1], new, seed, shared, 0], np.int64)
        every = np.asarray(multihost_utils.process_allgather(mine))
        if why is not None or not every[:, 0].all():
            return why or "another process's call does not run on the devices", None
        if len(set(every[:, 4].tolist())) > 1:
            return "the processes' calls differ in batch size, EOS or pad ids, or sampling settings", None
        ids, mask, new, eos, pad, knobs, least, penalty, _ = read
        # the longest prompt and budget of all; process 0's seed
        agreed = Agreed(int(every[:, 1].max()), int(every[:, 2].max()), int(every[0, 3]))
        return None, (ids, mask, new, eos, pad, knobs, least, penalty, agreed.seed, agreed)

    def unsupported(self, args: tuple, kwargs: dict) -> Optional[str]:
        """Why this call does not run on the devices yet, or None."""
        module = self._engine.host.wrapped
        config = getattr(module, "config", None)
        if config is None or getattr(config, "is_encoder_decoder", False) or not hasattr(module, "generation_config"):
            return f"{type(module).__name__} is not a transformers decoder-only LM"
        if len(args) > 1 or (args and not isinstance(args[0], torch.Tensor)):
            return "positional arguments after the prompt"
        extra = sorted(set(kwargs) - FOLLOWED - {"input_ids", "inputs", "attention_mask"})
        if extra:
            return f"{', '.join(extra)}"
        generation = kwargs.get("generation_config") or module.generation_config
        changed = sorted(k for k, v in generation.to_diff_dict().items()
                         if k not in NEUTRAL and v not in INACTIVE.get(k, (None, False)))
        if changed:
            return f"generation_config sets {', '.join(changed)}"
        setting = {k: kwargs.get(k, getattr(generation, k, None)) for k in
                   ("do_sample", "num_beams", "return_dict_in_generate", "num_return_sequences")}
        if (setting["num_beams"] or 1) > 1 or (setting["num_return_sequences"] or 1) > 1:
            return "beam search"
        if setting["return_dict_in_generate"]:
            return "return_dict_in_generate"
        prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2:
            return "no [batch, length] input_ids"
        if module.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules()):
            return "the module is in training mode with dropout on (call model.eval() first)"
        return None

    def layout(self, batch: int) -> GenerationLayout:
        """The generation layout on the training mesh. Below ZeRO-3 the weights are replicated
        already: the rows split over the data-parallel devices (when they divide evenly), the
        cache with them. At ZeRO-3, DeepSpeed's Hybrid Engine as annotations
        (``sharding/decode_plan.py``): a tensor-parallel group of ``fsdp`` devices (heads and MLP
        columns split, the KV cache by heads when they divide), the other data-parallel devices
        split the rows. The group is every ``fsdp`` device, or on a two-axis mesh the
        ``fsdp_inner`` devices alone when only those divide the KV heads (a 70B's 8 KV heads on
        ``fsdp`` 16 x ``fsdp_inner`` 8: groups of 8, 16 of them, ``spmdzero aot``'s
        ``--tensor-parallel 8``); a cache split by heads is read once over the group, a
        replicated one by every chip. Gathering each weight whole for every token would send the
        whole model per token; this reshards once per call."""
        engine = self._engine
        shape = dict(engine.mesh.shape)
        sharding = engine.placement.sharding
        if engine.plan.stage < 3:
            axes = data_parallel_axes(shape)
            rows = axes if axes and batch % data_parallel_size(shape) == 0 else None
            return GenerationLayout({}, sharding((rows,)), sharding((rows, None, None, None)), None)
        kv_heads = cache_shape(engine.host.wrapped, 1, 1)[1]
        every = tuple(a for a in FSDP_AXES if a in shape)
        groups = [every] + ([(FSDP_INNER_AXIS,)] if len(every) > 1 else [])
        group = next((g for g in groups if kv_heads % int(np.prod([shape[a] for a in g])) == 0), every)
        row_axes = tuple(a for a in (DATA_AXIS, *FSDP_AXES) if a in shape and a not in group and shape[a] > 1)
        data = int(np.prod([shape[a] for a in row_axes]))
        plan = decode_plan([(n, tuple(a.shape)) for n, a in engine.state.params.items()], data,
                           int(np.prod([shape[a] for a in group])), kv_heads)
        names = {TENSOR_AXIS: group or None, PLAN_DATA: row_axes or None}
        rows = names[PLAN_DATA] if batch % data == 0 else None
        weights = {n: sharding(tuple(names.get(a) for a in spec)) for n, spec in plan.weights.items()}
        cache = (rows, names[TENSOR_AXIS] if plan.cache[1] else None, None, None)
        return GenerationLayout(weights, sharding((rows,)), sharding(cache), plan, group)

    def _read(self, args: tuple, kwargs: dict) -> tuple:
        """The prompt, its mask, the new-token count, the EOS ids and the pad id, as transformers
        reads them from the call and the generation config."""
        module = self._engine.host.wrapped
        generation = kwargs.get("generation_config") or module.generation_config
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        mask = kwargs.get("attention_mask")
        new = kwargs.get("max_new_tokens", generation.max_new_tokens)
        if new is None:
            new = kwargs.get("max_length", generation.max_length) - ids.shape[1]
        eos = kwargs.get("eos_token_id", generation.eos_token_id)
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        pad = kwargs.get("pad_token_id", generation.pad_token_id)
        pad = pad if pad is not None else eos[0] if eos else 0  # as transformers, which warns
        if mask is None:  # transformers' default: every token, but pad tokens when pad is not EOS
            mask = torch.ones_like(ids) if pad in eos or not (ids == pad).any() else (ids != pad).long()
        setting = {k: kwargs.get(k, getattr(generation, k, None)) for k in ("do_sample", "temperature", "top_k",
                                                                            "top_p", "min_p")}
        knobs = None
        if setting["do_sample"]:  # as transformers reads them: None is off (temperature 1, top-k 0, top-p 1)
            knobs = Knobs(float(setting["temperature"] or 1.0), int(setting["top_k"] or 0),
                          1.0 if setting["top_p"] is None else float(setting["top_p"]), float(setting["min_p"] or 0.0))
        # min_length counts the prompt as fed (its padding too), min_new_tokens the new tokens only
        least = max(kwargs.get("min_new_tokens", generation.min_new_tokens) or 0,
                    (kwargs.get("min_length", generation.min_length) or 0) - ids.shape[1])
        penalty = float(kwargs.get("repetition_penalty", generation.repetition_penalty) or 1.0)
        # the seed: drawn from torch's generator, which torch.manual_seed sets (one draw a call)
        seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64)) if knobs is not None else 0
        return ids, mask, int(new), eos, int(pad), knobs, int(least), penalty, seed

    def _run(self, ids: torch.Tensor, mask: torch.Tensor, new: int, eos: list, pad: int,
             knobs: Optional[Knobs], least: int, penalty: float, seed: int,
             agreed: Optional["Agreed"] = None) -> torch.Tensor:
        import jax

        engine = self._engine
        if (agreed.new if agreed else new) <= 0:
            return ids
        engine.host.take_changes()
        own_rows, fed = ids.shape
        prompt = bucket(agreed.fed if agreed else fed, PROMPT_FLOOR)
        budget = bucket(agreed.new if agreed else new, NEW_TOKENS_FLOOR)
        left = prompt - fed  # more left padding, masked: the prompt reaches its bucket
        padded = np.full((own_rows, prompt), pad, np.int32)
        padded[:, left:] = ids.cpu().numpy()
        padded_mask = np.zeros((own_rows, prompt), np.int32)
        padded_mask[:, left:] = mask.cpu().numpy()
        lefts = np.full(own_rows, left, np.int32)  # where each row's prompt as fed starts
        if agreed:  # every process's prompts, in process order: the program's batch
            from jax.experimental import multihost_utils

            padded, padded_mask = (np.asarray(multihost_utils.process_allgather(a)).reshape(-1, prompt)
                                   for a in (padded, padded_mask))
            lefts = np.asarray(multihost_utils.process_allgather(lefts)).reshape(-1)
        batch = padded.shape[0]
        placement, sample = engine.placement, knobs is not None
        layout = self.layout(batch)
        rows = layout.rows
        # which warpers run is the program's (top-k's k sizes a partial sort); their values are inputs
        sampling = None if knobs is None else knobs.structure()
        key = (batch, prompt, budget, sampling, engine.host.wrapped.training, len(eos), penalty != 1.0)
        if key not in self.programs:
            if layout.plan is not None:
                say_once([f"generate() at ZeRO-3: {layout.plan.describe()}; the tensor-parallel groups are the "
                          f"training mesh's {' x '.join(layout.group)} devices"])
            tracing = functools.partial(other_engines.tracing, engine, [], None, engine.env)
            self.programs[key] = build_generate(engine.setup, batch, prompt, budget, sampling, layout, tracing,
                                                penalize=penalty != 1.0)
        put = lambda value, layout=placement.replicated: placement.put(torch.as_tensor(value), layout)  # noqa: E731
        knobs = np.array([*(knobs or (1.0, 0, 1.0, 0.0)), penalty], np.float32)  # the repetition penalty last
        out, count = self.programs[key](engine.state.params, engine.state.constants, put(padded, rows),
                                        put(padded_mask, rows), put(np.array(eos, np.int32)), put(np.int32(pad)),
                                        put(np.int32(agreed.new if agreed else new)), put(knobs), put(np.uint32(seed)),
                                        put(np.int32(least)), put(lefts, rows))
        engine.runs["generate"] += 1
        self.calls += 1
        if agreed:  # the one read: every row's tokens, then this process's rows
            from jax.experimental import multihost_utils

            out, count = np.asarray(multihost_utils.process_allgather(out, tiled=True)), int(np.asarray(count))
            first = jax.process_index() * own_rows
            out = out[first:first + own_rows, :min(count, new)]
            count = own_length(out, eos, least)  # where transformers would have stopped these rows
        else:
            out, count = jax.device_get((out, count))  # the one read: the tokens, and how many
        tokens = torch.from_numpy(np.array(out[:, :int(count)])).to(ids.dtype)  # a copy: a device array is read-only
        return torch.cat([ids.cpu(), tokens], dim=1)
