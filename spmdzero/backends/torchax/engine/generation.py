"""``generate`` on the devices: a part of ``TorchaxEngine`` (``engine.generation``).

A transformers LM's ``generate``, decoder-only or an encoder-decoder over token ids (T5, BART,
Marian), called as ``engine.generate(...)``, ``engine.module.generate(...)`` or on the script's
own model (``unwrap_model(model).generate``, TRL's ``unwrap_model_for_generation``,
``Seq2SeqTrainer``'s ``predict_with_generate``), decodes on the devices from the engine's
weights where they are (``programs/generate.py``): no copy of the parameters to the host, one
program per batch, prompt bucket and new-token bucket, no host read per token. Only the new
tokens and their count come back. Greedy search gives transformers' tokens; sampling
(temperature, top-k, top-p, min-p) draws with ``jax.random`` from a seed taken from torch's
generator, so ``torch.manual_seed`` makes it reproducible, but the draws are not torch's. Beam
search is transformers', step for step (``programs/beam_search.py``). The processors before the
warpers that run there: the repetition penalty, the minimum lengths, the forced BOS and EOS
tokens. The rows are split over the data-parallel devices when they divide evenly.

What it does not run on the devices yet goes to the host module's own ``generate``, as before,
said once with the reason: beam search with sampling or in groups, other logits processors, stopping criteria, models
whose ``generate`` is their own (Whisper's) or whose prompt is not ``input_ids``, a module in
training mode with dropout on (torch's dropout draws), ``inputs_embeds``, outputs other than the
token ids (``return_dict_in_generate``). With several processes every one runs the program with
the others, on all of their prompts, and keeps its own rows (``_agreed``).
``"spmd": {"generate": "host"}`` sends every call there: PyTorch's tokens and draws exactly (the
parity setting). Why a fallback rather than an error: those calls give plain PyTorch's results
today, and a script must not break because one of its calls is not yet fast."""

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
from spmdzero.backends.torchax.programs.beam_search import build_beam_search
from spmdzero.backends.torchax.programs.generate import build_generate

# generate() arguments the device program follows, besides the prompt and its mask
FOLLOWED = frozenset({"max_new_tokens", "max_length", "eos_token_id", "pad_token_id", "do_sample", "num_beams",
                      "use_cache", "synced_gpus", "generation_config", "temperature", "top_k", "top_p", "min_p",
                      "min_length", "min_new_tokens", "repetition_penalty",
                      "bos_token_id", "return_dict_in_generate", "output_scores", "output_logits",
                      "output_attentions", "output_hidden_states", "num_return_sequences",
                      "forced_bos_token_id", "forced_eos_token_id", "length_penalty", "early_stopping",
                      "labels"})  # Seq2SeqTrainer passes its batch's labels: a loss at most, never a token
# generation-config fields that change nothing in greedy search (the rest would: processors, beams)
NEUTRAL = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "max_length", "max_new_tokens", "do_sample",
                     "num_beams", "temperature", "top_k", "top_p", "use_cache", "transformers_version",
                     "_from_model_config", "decoder_start_token_id", "num_return_sequences",
                     "return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                     "output_hidden_states", "cache_implementation", "min_p", "disable_compile", "compile_config",
                     "min_length", "min_new_tokens", "repetition_penalty", "forced_bos_token_id",
                     "forced_eos_token_id", "length_penalty", "early_stopping",
                     # assisted generation's settings, read only with an assistant model (a kwarg
                     # the devices do not follow); transformers 5.x writes their defaults in
                     "assistant_confidence_threshold", "assistant_lookbehind", "num_assistant_tokens",
                     "num_assistant_tokens_schedule", "target_lookbehind"})


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


class Processors(NamedTuple):
    """transformers' logits processors the program runs before the warpers, in their order."""

    penalty: float  # the repetition penalty (1: off)
    least: int  # no EOS before this many new tokens (min_length, min_new_tokens)
    forced_bos: Optional[int]  # the first new token, when the sequence holds one token (an encoder-decoder's start)
    forced_eos: tuple  # the last token allowed by max_length is one of these (empty: off)


class Search(NamedTuple):
    """Beam search's settings, as transformers reads them (``beams`` 1: greedy search or sampling)."""

    beams: int
    returned: int  # num_return_sequences: of each prompt's finished beams, or its samples
    length_penalty: float
    early_stopping: Any  # True, False or "never"


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


def decoder_start(generation) -> Optional[int]:
    """An encoder-decoder's first decoder token, as transformers takes it: the start token, else
    BOS; None when neither is one token id."""
    start = generation.decoder_start_token_id
    start = generation.bos_token_id if start is None else start
    return start if isinstance(start, int) else None


def _unless_none(value, default):
    """transformers 5.x leaves unset generation settings None: its defaults then."""
    return default if value is None else value


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

    @property
    def encoder_decoder(self) -> bool:
        return bool(getattr(getattr(self._engine.host.wrapped, "config", None), "is_encoder_decoder", False))

    def _start_token(self) -> Optional[int]:
        """An encoder-decoder's first decoder token; None for a decoder-only LM."""
        return decoder_start(self._engine.host.wrapped.generation_config) if self.encoder_decoder else None

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
            ids, mask, new, eos, pad, knobs, processors, _, seed = read
            # a forced EOS token is the last of each process's own budget: those must agree too
            shared = zlib.crc32(repr((ids.shape[0], eos, pad, knobs, processors,
                                      new if processors.forced_eos else None)).encode())
            mine = np.array([1, ids.shape[1], new, seed, shared, 0], np.int64)
        every = np.asarray(multihost_utils.process_allgather(mine))
        if why is not None or not every[:, 0].all():
            return why or "another process's call does not run on the devices", None
        if len(set(every[:, 4].tolist())) > 1:
            return "the processes' calls differ in batch size, EOS or pad ids, or sampling settings", None
        ids, mask, new, eos, pad, knobs, processors, search, _ = read
        # the longest prompt and budget of all; process 0's seed
        agreed = Agreed(int(every[:, 1].max()), int(every[:, 2].max()), int(every[0, 3]))
        return None, (ids, mask, new, eos, pad, knobs, processors, search, agreed.seed, agreed)

    def unsupported(self, args: tuple, kwargs: dict) -> Optional[str]:
        """Why this call does not run on the devices yet, or None."""
        module = self._engine.host.wrapped
        config = getattr(module, "config", None)
        if config is None or not hasattr(module, "generation_config"):
            return f"{type(module).__name__} is not a transformers LM"
        if getattr(config, "is_encoder_decoder", False):
            why = self._unsupported_encoder_decoder(module)
            if why is not None:
                return why
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
        beams, returned = setting["num_beams"] or 1, setting["num_return_sequences"] or 1
        if beams > 1 and setting["do_sample"]:
            return "beam search with sampling"
        if returned > beams and not setting["do_sample"]:
            return "num_return_sequences above num_beams"  # transformers says why
        if (beams > 1 or returned > 1) and self._engine.processes > 1:
            return "beam search or num_return_sequences with several processes"
        if setting["return_dict_in_generate"]:
            return "return_dict_in_generate"
        prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2:
            return "no [batch, length] input_ids"
        if module.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules()):
            return "the module is in training mode with dropout on (call model.eval() first)"
        return None

    @staticmethod
    def _unsupported_encoder_decoder(module) -> Optional[str]:
        """Why this encoder-decoder does not run on the devices, or None: its ``generate`` must be
        transformers' own loop over token ids (Whisper's or a speech model's is not), with a
        decoder start token."""
        name = type(module).__name__
        owner = next(klass for klass in type(module).__mro__  # past the engine's own subclass (module_calls.py)
                     if "generate" in klass.__dict__ and not klass.__dict__.get("_spmdzero_engine_class"))
        if not owner.__module__.startswith(("transformers.generation", "peft")):
            return f"{name} has a generate of its own"
        if getattr(module, "main_input_name", "input_ids") != "input_ids" or not hasattr(module, "get_encoder"):
            return f"{name} is not an encoder-decoder over token ids"
        if decoder_start(module.generation_config) is None:
            return f"{name} has no decoder_start_token_id"
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
        # what max_length and min_length count: the prompt, or an encoder-decoder's decoder
        # tokens (its start token, then the new ones)
        counted = 1 if self.encoder_decoder else ids.shape[1]
        new = kwargs.get("max_new_tokens", generation.max_new_tokens)
        if new is None:
            new = kwargs.get("max_length", generation.max_length) - counted
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
                    (kwargs.get("min_length", generation.min_length) or 0) - counted)
        penalty = float(kwargs.get("repetition_penalty", generation.repetition_penalty) or 1.0)
        forced_bos = kwargs.get("forced_bos_token_id", generation.forced_bos_token_id)
        forced_eos = kwargs.get("forced_eos_token_id", generation.forced_eos_token_id)
        forced_eos = () if forced_eos is None else (forced_eos,) if isinstance(forced_eos, int) else tuple(forced_eos)
        # transformers forces BOS where the sequence holds one token: an encoder-decoder's start token
        forced_bos = forced_bos if forced_bos is not None and (self.encoder_decoder or ids.shape[1] == 1) else None
        processors = Processors(penalty, int(least), forced_bos, tuple(int(t) for t in forced_eos))
        # the seed: drawn from torch's generator, which torch.manual_seed sets (one draw a call)
        seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64)) if knobs is not None else 0
        search = Search(int(kwargs.get("num_beams", generation.num_beams) or 1),
                        int(kwargs.get("num_return_sequences", generation.num_return_sequences) or 1),
                        float(_unless_none(kwargs.get("length_penalty", generation.length_penalty), 1.0)),
                        _unless_none(kwargs.get("early_stopping", generation.early_stopping), False))
        return ids, mask, int(new), eos, int(pad), knobs, processors, search, seed

    def _run(self, ids: torch.Tensor, mask: torch.Tensor, new: int, eos: list, pad: int,
             knobs: Optional[Knobs], processors: Processors, search: Search, seed: int,
             agreed: Optional["Agreed"] = None) -> torch.Tensor:
        import jax

        engine = self._engine
        start = self._start_token()
        if (agreed.new if agreed else new) <= 0:
            return ids if start is None else torch.full((ids.shape[0], 1), start, dtype=ids.dtype)
        engine.host.take_changes()
        if search.returned > 1 and search.beams == 1:  # samples of each prompt: its row repeated, as transformers does
            ids, mask = ids.repeat_interleave(search.returned, 0), mask.repeat_interleave(search.returned, 0)
        own_rows, fed = ids.shape
        prompt = bucket(agreed.fed if agreed else fed, PROMPT_FLOOR)
        budget = bucket(agreed.new if agreed else new, NEW_TOKENS_FLOOR)
        # more padding, masked, to reach the bucket: on the left of a decoder-only LM's prompt (its
        # new tokens follow it), on the right of an encoder's (whose positions may be absolute)
        left = 0 if start is not None else prompt - fed
        padded = np.full((own_rows, prompt), pad, np.int32)
        padded[:, left:left + fed] = ids.cpu().numpy()
        padded_mask = np.zeros((own_rows, prompt), np.int32)
        padded_mask[:, left:left + fed] = mask.cpu().numpy()
        lefts = np.full(own_rows, left, np.int32)  # where each row's prompt as fed starts
        if agreed:  # every process's prompts, in process order: the program's batch
            from jax.experimental import multihost_utils

            padded, padded_mask = (np.asarray(multihost_utils.process_allgather(a)).reshape(-1, prompt)
                                   for a in (padded, padded_mask))
            lefts = np.asarray(multihost_utils.process_allgather(lefts)).reshape(-1)
        if search.beams > 1:
            return self._beam_search(ids, start, padded, padded_mask, lefts, new, budget, eos, pad, processors,
                                     search)
        batch = padded.shape[0]
        placement, sample = engine.placement, knobs is not None
        layout = self.layout(batch)
        rows = layout.rows
        # which warpers run is the program's (top-k's k sizes a partial sort); their values are inputs
        sampling = None if knobs is None else knobs.structure()
        penalty = processors.penalty
        # the forced tokens are the program's: a model's constants
        key = (batch, prompt, budget, sampling, engine.host.wrapped.training, len(eos), penalty != 1.0, start,
               processors.forced_bos, processors.forced_eos)
        if key not in self.programs:
            if layout.plan is not None:
                say_once([f"generate() at ZeRO-3: {layout.plan.describe()}; the tensor-parallel groups are the "
                          f"training mesh's {' x '.join(layout.group)} devices"])
            tracing = functools.partial(other_engines.tracing, engine, [], None, engine.env)
            self.programs[key] = build_generate(engine.setup, batch, prompt, budget, sampling, layout, tracing,
                                                penalize=penalty != 1.0, start_token=start,
                                                forced=(processors.forced_bos, processors.forced_eos))
        put = lambda value, layout=placement.replicated: placement.put(torch.as_tensor(value), layout)  # noqa: E731
        knobs = np.array([*(knobs or (1.0, 0, 1.0, 0.0)), penalty], np.float32)  # the repetition penalty last
        out, count = self.programs[key](engine.state.params, engine.state.constants, put(padded, rows),
                                        put(padded_mask, rows), put(np.array(eos, np.int32)), put(np.int32(pad)),
                                        put(np.int32(agreed.new if agreed else new)), put(knobs), put(np.uint32(seed)),
                                        put(np.int32(processors.least)), put(lefts, rows))
        engine.runs["generate"] += 1
        self.calls += 1
        if agreed:  # the one read: every row's tokens, then this process's rows
            from jax.experimental import multihost_utils

            out, count = np.asarray(multihost_utils.process_allgather(out, tiled=True)), int(np.asarray(count))
            first = jax.process_index() * own_rows
            out = out[first:first + own_rows, :min(count, new)]
            count = own_length(out, eos, processors.least)  # where transformers would have stopped these rows
        else:
            out, count = jax.device_get((out, count))  # the one read: the tokens, and how many
        tokens = torch.from_numpy(np.array(out[:, :int(count)])).to(ids.dtype)  # a copy: a device array is read-only
        # what transformers returns: the prompt and the new tokens, or an encoder-decoder's decoder tokens
        before = ids.cpu() if start is None else torch.full((own_rows, 1), start, dtype=ids.dtype)
        return torch.cat([before, tokens], dim=1)

    def _beam_search(self, ids, start, padded, padded_mask, lefts, new: int, budget: int, eos: list, pad: int,
                     processors: Processors, search: Search) -> torch.Tensor:
        """transformers' beam search on the devices (``programs/beam_search.py``): each prompt
        given ``num_beams`` times, the best ``num_return_sequences`` finished beams back, the
        longest one's length; one read."""
        import jax

        engine = self._engine
        batch, prompt = padded.shape
        beams = search.beams
        padded, padded_mask, lefts = (np.repeat(a, beams, axis=0) for a in (padded, padded_mask, lefts))
        layout = self.layout(batch * beams)
        penalize = processors.penalty != 1.0
        key = ("beam search", batch, beams, search.returned, prompt, budget, len(eos), search.length_penalty,
               search.early_stopping, penalize, start, processors.forced_bos, processors.forced_eos)
        if key not in self.programs:
            tracing = functools.partial(other_engines.tracing, engine, [], None, engine.env)
            self.programs[key] = build_beam_search(
                engine.setup, batch, beams, search.returned, prompt, budget, len(eos), search.length_penalty,
                search.early_stopping, layout, tracing, penalize=penalize, start_token=start,
                forced=(processors.forced_bos, processors.forced_eos))
        # what transformers fills a beam's unused slots with: the pad token unless it is 0, else
        # the first EOS token; -1 without EOS tokens
        fill = (pad or eos[0]) if eos else -1
        placement = engine.placement
        put = lambda value, layout=placement.replicated: placement.put(torch.as_tensor(value), layout)  # noqa: E731
        knobs = np.array([1.0, 0, 1.0, 0.0, processors.penalty], np.float32)
        out, length = self.programs[key](engine.state.params, engine.state.constants, put(padded, layout.rows),
                                         put(padded_mask, layout.rows), put(np.array(eos, np.int32)),
                                         put(np.int32(fill)), put(np.int32(new)), put(knobs),
                                         put(np.int32(processors.least)), put(lefts, layout.rows))
        engine.runs["generate"] += 1
        self.calls += 1
        out, length = jax.device_get((out, length))  # the one read: the finished beams, and their length
        tokens = torch.from_numpy(np.array(out[:, :, :int(length)]).reshape(batch * search.returned, -1))
        before = (ids.cpu().repeat_interleave(search.returned, 0) if start is None
                  else torch.full((batch * search.returned, 1), start, dtype=ids.dtype))
        return torch.cat([before, tokens.to(ids.dtype)], dim=1)
