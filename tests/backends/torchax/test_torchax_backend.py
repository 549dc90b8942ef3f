"""spmd.backend='torchax': the same results as the torch_xla engine, the plan's layouts on the JAX
arrays, one trace per program, and clear refusals."""

import io
import warnings

import numpy as np
import pytest
import torch

import spmdzero
from spmdzero.config.errors import ConfigError

from conftest import ReadsBack, batches, tiny_mlp

STEPS = 4


class WithLoss(torch.nn.Module):
    """The model and its criterion in one module: the torchax backend needs the loss returned."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)


def config(backend: str, gas: int = 1, **extra) -> dict:
    return {"train_batch_size": 16 * gas, "gradient_accumulation_steps": gas,
            "gradient_clipping": 0.05,  # below the gradients' norm: clipping is applied at every step
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-2}},
            "spmd": {"backend": backend}, **extra}


def train(backend: str, gas: int):
    engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=config(backend, gas))
    losses, traces = [], []
    for x, y in batches(STEPS * gas, 16):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        traces.append(sum(engine.traces.values()) if backend == "torchax" else 0)
    params = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    return engine, losses, params, traces


@pytest.fixture(scope="module", params=[1, 2], ids=["gas1", "gas2"])
def trained(request):
    gas = request.param
    return gas, train("torch_xla", gas), train("torchax", gas)


def test_same_losses_and_parameters_as_the_torch_xla_engine(trained):
    gas, (ref, ref_losses, ref_params, _), (engine, losses, params, _) = trained
    assert engine.global_steps == ref.global_steps == STEPS
    assert engine.get_lr() == pytest.approx(ref.get_lr())
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert engine.get_global_grad_norm() > 0.05  # clipping was on
    assert engine.get_global_grad_norm() == pytest.approx(ref.get_global_grad_norm(), rel=1e-5)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, atol=1e-5, rtol=1e-5)
    initial = dict(WithLoss(tiny_mlp(seed=0)).named_parameters())
    assert all((params[n] - p).abs().max() > 1e-3 for n, p in initial.items())  # it trained


def test_the_state_reads_as_the_torch_xla_engines(trained):
    """Both backends name, shape and lay out the training state alike (what checkpoints read)."""
    _, (ref, *_), (engine, *_) = trained
    ours, theirs = engine.state_tensors(), ref.state_tensors()
    assert sorted(ours) == sorted(theirs)
    for key, (value, spec) in theirs.items():
        assert tuple(ours[key][0].shape) == tuple(value.shape), key
        assert tuple(ours[key][1]) == tuple(spec), key
        assert str(ours[key][0].dtype) == str(value.dtype).removeprefix("torch."), key
    host = {n: p.detach().cpu() for n, p in engine.module.named_parameters()}
    for name, value in host.items():
        torch.testing.assert_close(torch.from_numpy(np.asarray(ours[f"model.{name}"][0])), value)


def test_no_retrace_after_warm_up(trained):
    """One trace per program: the first micro-step's forward, the later ones' (gas > 1), the
    update; a changing lr (the warm-up schedule) is an input, not a constant."""
    gas, _, (engine, _, _, traces) = trained
    assert traces[-1] == traces[gas] == (3 if gas > 1 else 2)
    assert engine.traces["update"] == 1


def test_optimizer_states_sharded_by_the_plan(trained):
    from jax.sharding import PartitionSpec

    _, _, (engine, *_) = trained
    states = engine.optimizer_states()
    for name in engine.trained.names:
        planned = engine.plan[name]
        for key, value in states[name].items():
            if key == "step":
                assert value.sharding.is_fully_replicated
                continue
            assert value.sharding.spec == PartitionSpec(*planned.optimizer_state), (name, key)
            shard = value.addressable_shards[0].data.shape
            dim = planned.shard_dims[0]
            assert shard[dim] == planned.shape[dim] // 8, (name, key)
        assert engine.params()[name].sharding.is_fully_replicated
    assert any(engine.plan[n].shard_dims for n in engine.trained.names)
    # every parameter steps together: one step counter, not one per parameter, goes through the update
    assert len({id(states[n]["step"]) for n in engine.trained.names}) == 1
    assert int(states[engine.trained.names[0]]["step"]) == STEPS


def test_eval_forward_leaves_the_gradients_alone(trained):
    gas, _, (engine, *_) = trained
    x, y = batches(1, 16)[0]
    engine.eval()
    with torch.no_grad():
        loss = engine(x, y)
    engine.train()
    assert torch.isfinite(torch.tensor(loss.item()))
    assert engine.state.accum is None
    with pytest.raises(RuntimeError, match="no engine.backward"):
        engine.set_gradient_accumulation_boundary(True)
        try:
            engine.step()
        finally:
            engine.set_gradient_accumulation_boundary(None)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_loss_computed_outside_the_module_trains_as_the_torch_xla_engine(precision):
    """``loss = criterion(engine(x), y)``, as most DeepSpeed scripts write it (it used to be
    refused): the same losses, gradient norms and parameters as the torch_xla engine, with
    accumulation, clipping and fp16's loss scaler; the forward, its VJP and the backward are each
    traced once (the training programs, first and later micro-steps, are traced once each too, to
    find that the output holds no loss)."""
    extra = {"fp16": {"enabled": True, "initial_scale_power": 8}} if precision == "fp16" else {}
    runs = {}
    for backend in ("torch_xla", "torchax"):
        engine, *_ = spmdzero.initialize(model=tiny_mlp(seed=0), config=config(backend, 2, **extra))
        losses, norms = [], []
        for x, y in batches(2 * STEPS, 16):
            out = engine(x.half() if precision == "fp16" else x)
            loss = torch.nn.functional.mse_loss(out.float(), y.to(engine.device))
            engine.backward(loss)
            steps = engine.global_steps
            engine.step()
            losses.append(loss.item())
            if engine.global_steps > steps:
                norms.append(engine.get_global_grad_norm())
        runs[backend] = engine, losses, norms
    (ref, ref_losses, ref_norms), (engine, losses, norms) = runs["torch_xla"], runs["torchax"]
    tolerance = 1e-5 if precision == "fp32" else 2e-3
    assert losses == pytest.approx(ref_losses, abs=tolerance)
    assert norms == pytest.approx(ref_norms, rel=tolerance)
    for (name, p), (_, q) in zip(engine.module.named_parameters(), ref.module.named_parameters()):
        torch.testing.assert_close(p.detach().float(), q.detach().cpu().float(), atol=tolerance, rtol=tolerance)
    assert dict(engine.traces) == {"train_forward": 2, "vjp_forward": 1, "backward": 2, "update": 1}


def test_a_loss_outside_the_module_is_as_torchs_whatever_it_is_made_of():
    """The module's own loss plus a term of its outputs; two forwards in one loss; a loss given
    to backward twice (with retain_graph first): torch's gradients each time. A loss made of
    no training output, or backward twice without retain_graph, says what happened."""
    model, reference = MaybeLoss(tiny_mlp(seed=0)), MaybeLoss(tiny_mlp(seed=0))
    engine, *_ = spmdzero.initialize(model=model, config=plain_config())
    optimizer = torch_optimizer(reference)
    (x1, y1), (x2, y2) = batches(2, 16)

    def mixed(module, x, y):
        out = module(x, y)
        return out["loss"] + 0.5 * out["logits"].pow(2).mean()

    def pair(module):
        return (torch.nn.functional.mse_loss(module(x1)["logits"], y1)
                + torch.nn.functional.l1_loss(module(x2)["logits"], y2))

    engine.backward(mixed(engine, x1, y1))
    engine.step()
    torch_step(reference, optimizer, mixed(reference, x1, y1))
    assert_as_in_torch(engine, reference)
    engine.backward(pair(engine))
    engine.step()
    torch_step(reference, optimizer, pair(reference))
    assert_as_in_torch(engine, reference)
    loss = torch.nn.functional.mse_loss(engine(x1, y1)["logits"], y1)
    engine.backward(loss, retain_graph=True)
    engine.backward(loss)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):  # torch's own words
        engine.backward(loss)
    engine.step()
    twice = torch.nn.functional.mse_loss(reference(x1, y1)["logits"], y1)
    twice.backward(retain_graph=True)
    torch_step(reference, optimizer, twice)
    assert_as_in_torch(engine, reference)
    with torch.no_grad():
        logits = engine(x1, y1)["logits"]
    with pytest.raises(RuntimeError, match="depends on no output of this engine's forward with grad enabled"):
        engine.backward(torch.nn.functional.mse_loss(logits, y1))


def test_a_loss_outside_the_module_on_sequence_lengths_that_come_back_trains_as_torch():
    """Lengths 4, 6, then 4 again (TRL's SFTTrainer pads each batch to its longest row and
    computes the loss from per-token outputs): the third forward reuses the first one's compiled
    program, and its backward takes the VJP of that length, not of the length traced last
    (it was handed the 6-long VJP: "unexpected JAX type ... for argument to vjp function")."""
    model, reference = MaybeLoss(tiny_mlp(seed=0)), MaybeLoss(tiny_mlp(seed=0))
    engine, *_ = spmdzero.initialize(model=model, config=plain_config())
    optimizer = torch_optimizer(reference)
    g = torch.Generator().manual_seed(3)
    for length in (4, 6, 4, 6):
        x, y = torch.randn(16, length, 16, generator=g), torch.randn(16, length, 8, generator=g)
        engine.backward(torch.nn.functional.mse_loss(engine(x)["logits"], y))
        engine.step()
        torch_step(reference, optimizer, torch.nn.functional.mse_loss(reference(x)["logits"], y))
        assert_as_in_torch(engine, reference)
    assert engine.traces["vjp_forward"] == 2


class MaybeLoss(torch.nn.Module):
    """Logits, and their loss when given targets (as Hugging Face models with and without labels)."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y=None):
        logits = self.net(x)
        return {"logits": logits} if y is None else {"loss": torch.nn.functional.mse_loss(logits, y), "logits": logits}


def test_scan_layers_on_a_model_without_identical_blocks_is_refused_naming_the_key():
    """The torch_xla backend's refusal, word for word."""
    cfg = {**config("torchax"), "spmd": {"backend": "torchax", "scan_layers": True}}
    with pytest.raises(ConfigError, match=r"spmd\.scan_layers: WithLoss has no nn\.ModuleList of two or more "
                                          r"identical blocks"):
        spmdzero.initialize(model=WithLoss(tiny_mlp()), config=cfg)


@pytest.mark.parametrize("extra", [{"communication_data_type": "fp16"}, {"data_types": {"grad_accum_dtype": "fp16"}}])
def test_fp16_gradients_without_fp16s_loss_scaling_train_as_on_torch_xla(extra):
    """DeepSpeed reduces (or accumulates) fp16 gradients of an unscaled loss if asked; so do both
    backends, alike (it was refused on torchax)."""
    runs = {}
    for backend in ("torchax", "torch_xla"):
        cfg = {**config(backend), **extra}
        engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=cfg)
        losses = []
        for x, y in batches(4, 16):
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[backend] = losses
    assert runs["torchax"] == pytest.approx(runs["torch_xla"], abs=1e-5)


@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
@pytest.mark.parametrize("bf16", [False, True])
def test_without_an_optimizer_the_engine_evaluates_and_step_says_what_it_needs(tmp_path, backend, bf16):
    """As DeepSpeed (DeepSpeed-Chat builds its reference and reward models so): no optimizer,
    no returned optimizer or schedule; forward, backward and checkpoints work, and the step
    names both ways to give an optimizer."""
    cfg = {**config(backend), "bf16": {"enabled": bf16}}
    del cfg["optimizer"], cfg["scheduler"]
    model = MaybeLoss(tiny_mlp())
    expected = model.net(batches(1, 16)[0][0]).detach()
    engine, optimizer, _, scheduler = spmdzero.initialize(model=model, config=cfg)
    assert optimizer is None and scheduler is None and engine.get_lr() == []
    x, y = batches(1, 16)[0]
    engine.eval()
    with torch.no_grad():
        out = engine(x)["logits"]
    torch.testing.assert_close(out.float().cpu(), expected, atol=0.02 if bf16 else 1e-6, rtol=0.02 if bf16 else 1e-5)
    engine.train()
    engine.backward(engine(x, y)["loss"])
    with pytest.raises(RuntimeError, match=r"needs an optimizer: pass optimizer= to initialize\(\) or add an "
                                           r"'optimizer' section to the config"):
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    engine.load_checkpoint(str(tmp_path))


def test_an_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match="spmd.backend"):
        spmdzero.initialize(model=tiny_mlp(), config=config("jax"))


class BatchNormNet(torch.nn.Module):
    """Every kind of batch norm the torchax backend updates: momentum, momentum=None (the
    cumulative average) and SyncBatchNorm (the global batch's statistics, as every BatchNorm here)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4, momentum=0.3)
        self.fc, self.cumulative = torch.nn.Linear(64, 8), torch.nn.BatchNorm1d(8, momentum=None)
        self.sync, self.head = torch.nn.SyncBatchNorm(8), torch.nn.Linear(8, 2)

    def forward(self, x, y):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        out = self.head(self.sync(torch.relu(self.cumulative(self.fc(h)))))
        return torch.nn.functional.mse_loss(out, y), out


def test_batch_norm_running_statistics_are_updated_as_torch_updates_them():
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 3, 4, 4, generator=g) * 2 + 1, torch.randn(16, 2, generator=g)) for _ in range(3)]
    ref = BatchNormNet()
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        sgd.zero_grad()
        ref(x, y)[0].backward()
        sgd.step()
    engine, *_ = spmdzero.initialize(model=BatchNormNet(), config={
        "train_batch_size": 16, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "spmd": {"backend": "torchax"}})
    for x, y in data:
        loss, _ = engine(x, y)
        engine.backward(loss)
        engine.step()
    assert engine.traces["train_forward"] == 1  # compiled once
    got = engine.module.state_dict()
    assert engine.module.cumulative.num_batches_tracked.item() == 3
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, atol=1e-5, rtol=1e-5, msg=name)
    assert not torch.equal(engine.module.bn.running_mean, torch.zeros(4))
    x, y = data[0]
    engine.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(np.asarray(engine(x, y)[1]._elem)), ref(x, y)[1], atol=1e-5, rtol=1e-5)


def test_a_batch_norm_subclass_with_its_own_forward_is_refused():
    class Custom(torch.nn.BatchNorm1d):
        def forward(self, input):
            return super().forward(input) * 2

    model = WithLoss(torch.nn.Sequential(torch.nn.Linear(16, 8), Custom(8)))
    with pytest.raises(ValueError, match="'net.1' \\(Custom\\) has its own forward"):
        spmdzero.initialize(model=model, config=config("torchax"))


class LossFirst(WithLoss):
    def forward(self, x, y):
        out = self.net(x)
        return torch.nn.functional.mse_loss(out, y), out


def test_a_tuple_output_gives_its_first_item_as_the_loss():
    engine, *_ = spmdzero.initialize(model=LossFirst(tiny_mlp()), config=config("torchax"))
    x, y = batches(1, 16)[0]
    loss, out = engine(x, y)
    assert tuple(out.shape) == (16, 8) and loss.item() > 0
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1
    with pytest.raises(RuntimeError, match="an earlier backward already committed"):
        engine.backward(loss)  # its gradients were committed already


def test_a_batch_encoding_passed_whole_reaches_the_module_as_a_dict():
    """transformers' collators return a BatchEncoding, which torch's pytree takes as one leaf."""
    from transformers import BatchEncoding

    class ByBatch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = tiny_mlp()

        def forward(self, batch):
            return torch.nn.functional.mse_loss(self.mlp(batch["x"]), batch["y"])

    engine, *_ = spmdzero.initialize(model=ByBatch(), config=config("torchax"))
    x, y = batches(1, 16)[0]
    loss = engine(BatchEncoding({"x": x, "y": y}))
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1 and loss.item() > 0


def gpt2():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=128, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)


def test_gpt2_with_attention_mask_matches_the_torch_xla_engine():
    """A transformers model: the loss read from ``outputs.loss``, the tied embedding in the plan."""
    ids = torch.randint(0, 128, (3, 16, 16), generator=torch.Generator().manual_seed(1))
    results = {}
    for backend in ("torch_xla", "torchax"):
        engine, *_ = spmdzero.initialize(model=gpt2(), config=config(backend))
        losses = []
        for batch in ids:
            out = engine(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
        assert tuple(out.logits.shape) == (16, 16, 128)
        module = engine.module
        assert module.lm_head.weight is module.transformer.wte.weight
        results[backend] = losses, {n: p.detach().cpu() for n, p in module.named_parameters()}
    assert results["torchax"][0] == pytest.approx(results["torch_xla"][0], abs=1e-5)
    for name, value in results["torch_xla"][1].items():
        torch.testing.assert_close(results["torchax"][1][name], value, atol=1e-5, rtol=1e-4)


class Dropped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x).square().mean()


def test_dropout_draws_anew_at_every_step_without_retracing():
    # stage 0: zero_grad drops the micro-step's gradients, as DeepSpeed's (ZeRO-2 keeps them)
    engine, *_ = spmdzero.initialize(model=Dropped(), config=config("torchax", zero_optimization={"stage": 0}))
    x = torch.ones(16, 16)
    losses = []
    for _ in range(3):
        loss = engine(x)
        engine.backward(loss)
        losses.append(loss.item())
        engine.zero_grad()
        engine.micro_steps += 1  # a new micro-step without an update: the same weights, new masks
    assert len(set(losses)) == 3
    engine.eval()
    with torch.no_grad():
        assert engine(x).item() == engine(x).item()  # no dropout
    assert engine.traces == {"train_forward": 1, "forward": 1}


class Noisy(torch.nn.Module):
    """Dropout and a draw of its own, as MAE's random patch masking (``torch.rand`` in the forward)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x) * torch.rand(x.shape[0], 1, device=x.device)


def test_every_forward_draws_anew_as_in_torch():
    """Two training forwards of one input (R-Drop, SimCSE's two passes) drew the same masks, so
    their KL term was 0; evaluation calls drew the same numbers at every call (MAE's masks). Each
    call draws anew now, and an evaluation between two steps leaves the training draws alone."""
    def run(evaluate_between: bool):
        torch.manual_seed(0)
        engine, *_ = spmdzero.initialize(model=Noisy(), config=config("torchax", optimizer={
            "type": "SGD", "params": {"lr": 0.1}}))
        x, kls, evaluations = torch.ones(16, 16), [], []
        for _ in range(2):
            a, b = engine(x), engine(x)
            kl = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True,
                                            reduction="batchmean")
            engine.backward(a.square().mean() + b.square().mean() + kl)
            engine.step()
            kls.append(kl.item())
            if evaluate_between:
                with torch.no_grad():
                    engine.eval()
                    evaluations += [engine(x).sum().item() for _ in range(2)]
                    engine.train()
        return kls, evaluations, {n: p.detach().cpu() for n, p in engine.module.named_parameters()}

    kls, evaluations, params = run(evaluate_between=True)
    assert min(kls) > 1e-3, kls
    assert len(set(evaluations)) == 4, evaluations  # a new torch.rand at every call, in eval mode too
    kls_alone, _, params_alone = run(evaluate_between=False)
    assert kls_alone == kls
    for name, value in params_alone.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [0, 1])
def test_zero_stages_0_and_1_follow_the_plan(stage):
    from jax.sharding import PartitionSpec

    results = {}
    for backend in ("torch_xla", "torchax"):
        cfg = config(backend, zero_optimization={"stage": stage})
        engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=cfg)
        for x, y in batches(2, 16):
            engine.backward(engine(x, y))
            engine.step()
        results[backend] = {n: p.detach().cpu() for n, p in engine.module.named_parameters()}
    for name, value in results["torch_xla"].items():
        torch.testing.assert_close(results["torchax"][name], value, atol=1e-5, rtol=1e-5)
    assert all(engine.trained.grad_specs[n].is_fully_replicated for n in engine.trained.names)  # below stage 2
    states = engine.optimizer_states()
    assert {states[n]["exp_avg"].sharding.spec for n in engine.trained.names} == {
        PartitionSpec(*engine.plan[n].optimizer_state) for n in engine.trained.names}
    assert any(not states[n]["exp_avg"].sharding.is_fully_replicated for n in engine.trained.names) == (stage == 1)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_zero_stage_3_shards_the_parameters_and_trains_as_stage_2(bf16):
    """Stage 3 lays the parameters out as the optimizer states (the compiler gathers each where the
    step uses it): the same losses and parameters as stage 2, every parameter that divides split
    over the devices, before and after the update, with no recompile."""
    from jax.sharding import PartitionSpec

    results, losses = {}, {}
    for stage in (2, 3):
        cfg = config("torchax", 2, zero_optimization={"stage": stage}, **({"bf16": {"enabled": True}} if bf16 else {}))
        engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=cfg)
        losses[stage] = []
        for x, y in batches(6, 16):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[stage].append(loss.item())
        results[stage] = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
    np.testing.assert_allclose(losses[3], losses[2], rtol=1e-6)
    # bf16: a gradient summed in another order can round a parameter to the next bf16 value (one ulp)
    tolerance = dict(atol=2 ** -11, rtol=2 ** -7) if bf16 else dict(atol=1e-6, rtol=1e-6)
    for name, value in results[2].items():
        torch.testing.assert_close(results[3][name], value, **tolerance)
    params = engine.params()
    assert {params[n].sharding.spec for n in engine.trained.names} == {
        PartitionSpec(*engine.plan[n].optimizer_state) for n in engine.trained.names}
    assert all(not params[n].sharding.is_fully_replicated for n in engine.trained.names)  # tiny_mlp's all divide by 8
    assert engine.traces["train_forward"] == 2 and engine.traces["update"] == 1  # first micro-step, later ones


def test_dims_that_do_not_divide_by_the_devices_are_sharded_where_they_do():
    """A 10-class head on 8 devices: XLA pads a split of its rows, JAX refuses one, so the
    torchax engine's plan splits the head's columns and replicates its bias. Same training."""
    from jax.sharding import PartitionSpec

    results = {}
    for backend in ("torch_xla", "torchax"):
        engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0, d_out=10)), config=config(backend))
        for x, y in batches(2, 16, d_out=10):
            engine.backward(engine(x, y))
            engine.step()
        results[backend] = {n: p.detach().cpu() for n, p in engine.module.named_parameters()}
    for name, value in results["torch_xla"].items():
        torch.testing.assert_close(results["torchax"][name], value, atol=1e-5, rtol=1e-5)
    states = engine.optimizer_states()
    assert states["net.2.weight"]["exp_avg"].sharding.spec == PartitionSpec(None, "fsdp")
    assert states["net.2.bias"]["exp_avg"].sharding.is_fully_replicated


def test_bf16_matches_the_torch_xla_engine():
    """bf16 parameters and activations, fp32 master weights and states laid out by the plan."""
    from jax.sharding import PartitionSpec

    results = {}
    for backend in ("torch_xla", "torchax"):
        cfg = config(backend, 2, bf16={"enabled": True})
        engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=cfg)
        losses = []
        for x, y in batches(4, 16):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[backend] = losses, {n: p.detach().cpu() for n, p in engine.module.named_parameters()}
    assert engine.bfloat16_enabled() and engine.skipped_steps == 0 and engine.was_step_applied()
    assert results["torchax"][0] == pytest.approx(results["torch_xla"][0], rel=1e-2)  # a bf16 ulp is 2^-8
    for name, value in results["torch_xla"][1].items():
        assert results["torchax"][1][name].dtype == torch.bfloat16
        torch.testing.assert_close(results["torchax"][1][name], value, atol=1e-2, rtol=1e-2)
    for name, master in engine.state.masters.items():
        assert master.dtype == "float32"
        assert master.sharding.spec == PartitionSpec(*engine.plan[name].master)


def test_bf16_skips_a_step_with_non_finite_gradients():
    engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=config("torchax", bf16={"enabled": True}))
    before = {n: p.clone() for n, p in engine.module.named_parameters()}
    x, y = batches(1, 16)[0]
    x[0, 0] = float("inf")
    engine.backward(engine(x, y))
    engine.step()
    assert engine.skipped_steps == 1 and not engine.was_step_applied() and engine.global_steps == 1
    for name, p in engine.module.named_parameters():
        assert torch.equal(p, before[name])
    masters = dict(engine.state.masters)
    assert all(p.data.dtype == torch.bfloat16 for p in engine.module.parameters())  # a read through .data
    x[0, 0] = 0.0
    engine(x, y)
    assert all(engine.state.masters[n] is m for n, m in masters.items())  # not replaced by their bf16 casts


def test_fp16_loss_scaling_matches_the_torch_xla_engine(tmp_path):
    """DeepSpeed's dynamic loss scaler on both backends: two overflowed steps (an inf input)
    skipped, the scale halved once hysteresis is used up and doubled after a stable window, the
    same parameters; the scale is an input of the programs (no retrace) and checkpoints carry it.
    DeepSpeed's WarmupLR does not step on the skipped steps, on either backend (it counts on the
    devices: no host read)."""
    def fp16_config(backend):
        return config(backend, fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2})

    results = {}
    for backend in ("torch_xla", "torchax"):
        engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=fp16_config(backend))
        scales, skipped = [], []
        for i, (x, y) in enumerate(batches(7, 16)):
            if i in (2, 3):
                x[0, 0] = float("inf")
            engine.backward(engine(x, y))
            engine.step()
            scales.append(engine.current_loss_scale())
            skipped.append(engine.skipped_steps)
        results[backend] = engine, scales, skipped, {n: p.detach().cpu() for n, p in engine.module.named_parameters()}
    (ref, ref_scales, ref_skipped, ref_params), (engine, scales, skipped, params) = results.values()
    assert scales == ref_scales == [256.0, 256.0, 256.0, 128.0, 128.0, 128.0, 256.0]
    assert skipped == ref_skipped == [0, 0, 1, 2, 2, 2, 2]
    assert engine.loss_scale() == ref.loss_scale() == 0 and not engine.overflow()
    assert engine.traces == {"train_forward": 1, "update": 1}
    assert engine.get_lr() == pytest.approx(ref.get_lr()) and engine.lr_scheduler.last_batch_iteration == 4
    for name, value in ref_params.items():
        assert params[name].dtype == torch.float16
        torch.testing.assert_close(params[name], value, atol=1e-2, rtol=1e-2)
    assert sorted(engine.state_tensors()) == sorted(ref.state_tensors())  # loss_scale.* included
    engine.save_checkpoint(str(tmp_path))
    again, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=1)), config=fp16_config("torchax"))
    again.load_checkpoint(str(tmp_path))
    assert again.current_loss_scale() == 256.0 and again.skipped_steps == 2
    for key, (value, _) in engine.state_tensors().items():
        if key.startswith("loss_scale."):
            assert float(again.state_tensors()[key][0]) == float(value), key
    assert again.lr_scheduler.last_batch_iteration == 4 and again.get_lr() == pytest.approx(engine.get_lr())
    model = WithLoss(tiny_mlp(seed=0))  # a torch scheduler steps on the host, skipped steps too: said once
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match="including steps skipped for overflow"):
        spmdzero.initialize(model=model, optimizer=optimizer, lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1),
                            config={k: v for k, v in fp16_config("torchax").items() if k not in ("optimizer", "scheduler")})


def test_a_retrace_after_warm_up_is_held_to_max_recompiles():
    """The torch_xla backend's recompile guard, counting this backend's traces: a new input shape
    after warm-up retraces the training program, an error past spmd.max_recompiles."""
    cfg = config("torchax", train_batch_size=32, spmd={"backend": "torchax", "max_recompiles": 0})
    engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=cfg)
    for x, y in batches(5, 32):
        engine.backward(engine(x, y))
        engine.step()
    x, y = batches(1, 24)[0]  # an epoch's partial last batch
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match=r"recompiled after warm-up \(global step 6.*input shapes changed: "
                                           r"\[\(32, 16\), \(32, 8\)\] -> \[\(24, 16\), \(24, 8\)\].*"
                                           r"JAX_LOG_COMPILES.*max_recompiles=0"):
        engine.step()


def test_the_training_loader_feeds_host_batches():
    x, y = torch.randn(64, 16), torch.randn(64, 8)
    engine, _, loader, _ = spmdzero.initialize(model=WithLoss(tiny_mlp()), config=config("torchax"),
                                               training_data=torch.utils.data.TensorDataset(x, y))
    assert len(loader) == 4 and loader.batch_size == 2  # 2 rows per rank, 8 ranks
    for bx, by in loader:
        assert bx.device.type == "cpu" and tuple(bx.shape) == (16, 16)
        engine.backward(engine(bx, by))
        engine.step()
    assert engine.global_steps == 4 and engine.global_samples == 64


def test_missing_torchax_is_a_clear_error(monkeypatch):
    import builtins

    from spmdzero.backends.torchax.engine import engine as backend_torchax

    real_import = builtins.__import__

    def no_torchax(name, *args, **kwargs):
        if name == "torchax" or name.startswith("torchax."):
            raise ImportError("No module named 'flax'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchax)
    from spmdzero.backends.torchax import build as torchax_build

    with pytest.raises(ConfigError, match=r"needs the torchax package .*pip install torchax==0.0.13"):
        torchax_build._require_torchax()


def test_the_torchax_version_named_in_errors_is_pyprojects_pin():
    import tomllib

    from conftest import REPO
    from spmdzero.backends.torchax.build import TORCHAX_VERSION

    with open(f"{REPO}/pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert f"torchax=={TORCHAX_VERSION}" in project["dependencies"]  # the default backend's: no extra
    assert not any(d.startswith("torch_xla") for d in project["dependencies"])  # an extra: spmdzero[torch_xla]
    # torch_xla is frozen at 2.9, on torch 2.9: its extra says so, where the default install takes a range
    assert {"torch_xla==2.9.0", "torch>=2.9,<2.10"} <= set(project["optional-dependencies"]["torch_xla"])
    assert "torch>=2.9,<2.13" in project["dependencies"]


def test_torchax_files_overwritten_by_torch_xlas_copy_get_the_repair_command(monkeypatch, tmp_path):
    """pip installs torch_xla's wheel, with its older torchax copy, over torchax 0.0.13's files
    (checked: ``pip install --no-deps torch_xla==2.9.0 torchax==0.0.13`` leaves torchax 0.0.6's
    ``__init__.py`` under pip's 0.0.13): the error says so and gives the command that repairs it."""
    import builtins
    import importlib.metadata
    import importlib.util
    from types import SimpleNamespace

    from spmdzero.backends.torchax import build as torchax_build

    (tmp_path / "__init__.py").write_text('import flax\n__version__ = "0.0.6"\n')
    real_import, real_find, real_version = builtins.__import__, importlib.util.find_spec, importlib.metadata.version

    def old_copy(name, *args, **kwargs):
        if name == "torchax":
            raise ImportError("No module named 'flax'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(
        origin=str(tmp_path / "__init__.py")) if name == "torchax" else real_find(name, *a))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.13" if name == "torchax" else real_version(name))
    monkeypatch.setattr(builtins, "__import__", old_copy)
    with pytest.raises(ConfigError, match=r"pip lists torchax 0\.0\.13, but the files installed are torchax 0\.0\.6.*"
                                          r"pip install --force-reinstall --no-deps torchax==0\.0\.13"):
        torchax_build._require_torchax()


# ---- the default process: JAX owns the devices, torch_xla is not imported until a config asks for it ----

JAX_OWNED = """
    import json, sys
    sys.path[:0] = ["tests", "tests/backends/torchax"]  # conftest, and this folder's test modules
    import jax, numpy as np, torch
    import spmdzero
    from conftest import tiny_mlp
    from test_torchax_backend import WithLoss, config, train

    out = {"jax_devices": len(jax.devices()), "torch_xla_at_import": "torch_xla" in sys.modules}
    for gas in (1, 2):  # two initialize() in one process, as a notebook re-run
        engine, losses, params, _ = train("torchax", gas)
        engine.wait()
        out[gas] = {"losses": losses, "norm": engine.get_global_grad_norm(), "mesh": engine.mesh.devices.size,
                    "params": {n: p.tolist() for n, p in params.items()}}
    from spmdzero.compat.deepspeed import comm

    out["deepspeed_world_size"] = comm.get_world_size()  # what a DeepSpeed script asks, answered by JAX
    from spmdzero.compat.deepspeed.accelerator import get_accelerator

    acc = get_accelerator()  # what a DeepSpeed script moves its batches to, counts and seeds
    acc.manual_seed(0)
    acc.synchronize()
    out["accelerator"] = {"device": acc.device_name(0), "current": acc.current_device_name(),
                          "count": acc.device_count(), "memory": acc.memory_allocated(),
                          "rng": acc.get_rng_state().equal(torch.get_rng_state())}
    unnamed = config("torchax")
    del unnamed["spmd"]  # a config that names no backend: the default's
    out["unnamed_backend"] = type(spmdzero.initialize(model=WithLoss(tiny_mlp()), config=unnamed)[0]).__name__
    try:
        spmdzero.initialize(model=WithLoss(tiny_mlp()), config=unnamed, mesh=object())
    except TypeError as err:
        out["mesh"] = str(err)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(2, 2), ("data", "fsdp"))
    engine = spmdzero.initialize(model=WithLoss(tiny_mlp()), config=unnamed, mesh=mesh)[0]
    out["jax_mesh"] = [dict(engine.mesh.shape), [d.id for d in engine.mesh.devices.flat]]
    out["torch_xla_imported"] = "torch_xla" in sys.modules
    engine = spmdzero.initialize(model=WithLoss(tiny_mlp()), config=config("torch_xla"))[0]  # starts it, on CPU
    out["torch_xla_backend"] = type(engine).__name__
    import torch_xla.runtime as xr
    out["torch_xla_devices"] = xr.global_runtime_device_count()
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def jax_owned():
    """One default process (no SPMDZERO_BACKEND) with 4 CPU devices (this one has 8)."""
    import json

    from conftest import run_python

    out = run_python(JAX_OWNED, env={"SPMDZERO_BACKEND": "", "CPU_NUM_DEVICES": "4"})
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_in_the_default_process_jax_owns_the_devices_and_trains_the_same(trained, jax_owned):
    gas, (_, ref_losses, ref_params, _), (engine, losses, _, _) = trained
    run = jax_owned[str(gas)]
    assert jax_owned["jax_devices"] == run["mesh"] == 4  # CPU_NUM_DEVICES, JAX's own
    assert run["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert run["losses"] == pytest.approx(losses, abs=1e-5)
    assert run["norm"] == pytest.approx(engine.get_global_grad_norm(), rel=1e-5)
    for name, value in ref_params.items():
        torch.testing.assert_close(torch.tensor(run["params"][name]), value, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_in_the_default_process_torch_xla_is_imported_only_for_its_backend(jax_owned):
    """Not at import, not in initialize, training, engine.wait(), a JAX mesh or the refusals; a
    config naming torch_xla then starts its runtime beside JAX's CPU devices."""
    assert not jax_owned["torch_xla_at_import"] and not jax_owned["torch_xla_imported"]
    assert jax_owned["deepspeed_world_size"] == 1
    # DeepSpeed scripts keep their batches on the host (the engine places them); counts are JAX's
    assert jax_owned["accelerator"] == {"device": "cpu", "current": "cpu", "count": 4, "memory": 0, "rng": True}
    assert jax_owned["unnamed_backend"] == "TorchaxEngine"
    assert "mesh must be a jax.sharding.Mesh or a torch_xla.distributed.spmd.Mesh, got object" in jax_owned["mesh"]
    assert jax_owned["jax_mesh"] == [{"data": 2, "fsdp": 2}, [3, 2, 1, 0]]  # the given mesh, in its order
    assert jax_owned["torch_xla_backend"] == "SpmdZeroEngine" and jax_owned["torch_xla_devices"] == 4
    # several hosts: tests/sharding/test_multihost.py


def test_the_backend_variable_is_checked(monkeypatch):
    from spmdzero.runtime import jax_runtime

    monkeypatch.delenv("SPMDZERO_BACKEND", raising=False)
    assert jax_runtime.from_environment()  # the default: JAX takes the devices
    monkeypatch.setenv("SPMDZERO_BACKEND", "torchax")
    assert jax_runtime.from_environment()
    monkeypatch.setenv("SPMDZERO_BACKEND", "torch_xla")
    assert not jax_runtime.from_environment()
    # this process's runtime started without it (conftest): set now, as in a notebook, it changes nothing
    assert jax_runtime.selected()
    monkeypatch.setenv("SPMDZERO_BACKEND", "jax")
    with pytest.raises(ValueError, match="SPMDZERO_BACKEND='jax'"):
        jax_runtime.from_environment()


@pytest.mark.parametrize("device_type, jax_platforms, expected", [
    ("TPU", None, [("jax_platforms", "tpu,cpu")]),
    ("TPU", "tpu", []),  # the user's JAX_PLATFORMS stands
    ("CPU", None, [("jax_platforms", "cpu"), ("jax_num_cpu_devices", 4)]),
])
def test_jax_is_told_which_devices_to_take(monkeypatch, device_type, jax_platforms, expected):
    import jax
    from jax._src import xla_bridge

    from spmdzero.runtime import jax_runtime

    updates = []
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(jax.config, "update", lambda key, value: updates.append((key, value)))
    monkeypatch.setattr(jax_runtime, "_device_type", lambda: device_type)
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    monkeypatch.setenv("SPMDZERO_DISTRIBUTED", "0")  # joining the hosts of a TPU VM: tests/sharding/test_multihost.py
    if jax_platforms is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", jax_platforms)
    jax_runtime.configure()
    assert updates == expected


def test_jax_owned_devices_on_a_tpu_vm_are_its_tpu_chips(monkeypatch):
    """What jax.devices() gives is checked against the host: a TPU JAX fell back from is an error."""
    from types import SimpleNamespace

    import jax

    from spmdzero.backends.torchax.engine import mesh as backend_torchax
    from spmdzero.runtime import jax_runtime

    chips = [SimpleNamespace(platform="tpu", id=i) for i in range(4)]
    monkeypatch.setattr(jax_runtime, "_decided", True)  # JAX's process (the default)
    monkeypatch.setattr(jax_runtime, "_device_type", lambda: "TPU")
    monkeypatch.setattr(jax_runtime, "configure", lambda: None)
    monkeypatch.setattr(jax, "devices", lambda *backend: chips)
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    assert backend_torchax.jax_devices(4) == chips and jax_runtime.device_count() == 4
    assert spmdzero.runtime.device_count() == 4 and spmdzero.runtime.hosts()[1] == 1
    monkeypatch.setattr(jax, "devices", lambda *backend: [SimpleNamespace(platform="cpu", id=0)])
    with pytest.raises(RuntimeError, match="TPU host but JAX started on cpu"):
        jax_runtime.devices()

    def held(*backend):
        raise RuntimeError("Unable to initialize backend 'tpu': TPU in use by process 1234")

    monkeypatch.setattr(jax, "devices", held)
    with pytest.raises(RuntimeError, match="spmdzero: JAX could not open .* TPU in use by process"):
        spmdzero.runtime.hosts()


def test_the_torchax_backend_where_torch_xla_holds_the_tpu_says_to_unset_the_variable(monkeypatch):
    import torch_xla.runtime as xr

    from spmdzero.backends.torchax.engine import mesh as torchax_mesh
    from spmdzero.runtime import jax_runtime

    monkeypatch.setattr(jax_runtime, "_decided", False)  # as if started with SPMDZERO_BACKEND=torch_xla
    monkeypatch.setattr(xr, "device_type", lambda: "TPU")
    with pytest.raises(RuntimeError, match=r"SPMDZERO_BACKEND=torch_xla gave the TPU devices to torch_xla's runtime "
                                           r"at `import spmdzero`: unset the variable"):
        torchax_mesh.jax_devices(4)


def test_the_torch_xla_backend_where_jax_holds_the_tpu_says_to_set_the_variable(monkeypatch):
    """The default process gives a TPU's chips to JAX: a config naming torch_xla there cannot
    start torch_xla's runtime, and the error says how to choose it (on CPU it starts beside JAX's)."""
    from spmdzero.runtime import jax_runtime, process

    monkeypatch.setattr(process, "_torch_xla_started", False)
    monkeypatch.setattr(process, "select_device_type", lambda: "TPU")
    monkeypatch.setattr(jax_runtime, "_decided", True)
    with pytest.raises(RuntimeError, match=r"spmd.backend='torch_xla' needs torch_xla's runtime on the TPU devices, "
                                           r"which JAX holds .* Set SPMDZERO_BACKEND=torch_xla in the environment "
                                           r"before `import spmdzero` \(`spmdzero launch` does it"):
        process.start_torch_xla()


# ---- the module on the host and the engine's device copy (review findings) -------------------------

def dropout_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 8))


def host_loss(model: torch.nn.Module, x, y) -> float:
    model = model.eval()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def test_weights_loaded_on_the_host_after_initialize_are_what_trains():
    """engine.module.load_state_dict(...) (pretrained weights), and the script's own model
    reference loaded after some steps: the next forward uses them, the step starts from them."""
    loaded = tiny_mlp(seed=5)
    (x, y), = batches(1, 16)
    for after_steps in (0, 2):
        model = WithLoss(tiny_mlp(seed=0))
        cfg = config("torchax")
        del cfg["scheduler"]  # a fixed lr: WarmupLR's first steps have lr 0
        engine, *_ = spmdzero.initialize(model=model, config=cfg)
        for xb, yb in batches(after_steps, 16):
            engine.backward(engine(xb, yb))
            engine.step()
        model.net.load_state_dict(loaded.state_dict())  # the script's reference, not engine.module
        engine.eval()
        with torch.no_grad():
            got = engine(x, y).item()
        assert got == pytest.approx(host_loss(loaded, x, y), rel=1e-5)
        engine.train()
        engine.backward(engine(x, y))
        engine.step()
        moved = max((p - q).abs().max().item()
                    for p, q in zip(engine.module.net.parameters(), loaded.parameters()))
        assert 0 < moved < 0.05  # one small step from the loaded weights, not from the old ones


def test_the_scripts_model_reference_holds_the_trained_weights():
    """model.state_dict() (save_pretrained, torch.save) without reading engine.module first."""
    model = WithLoss(tiny_mlp(seed=0))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    engine, *_ = spmdzero.initialize(model=model, config=config("torchax"))
    for x, y in batches(3, 16):
        engine.backward(engine(x, y))
        engine.step()
    saved = model.state_dict()
    assert all((saved[k] - initial[k]).abs().max() > 1e-3 for k in initial)
    device = {k: torch.from_numpy(__import__("numpy").asarray(v)) for k, v in engine.params().items()}
    for name, value in device.items():
        torch.testing.assert_close(saved[name], value)


def test_a_model_initialized_again_takes_only_the_new_engines_values():
    """A re-run notebook cell: the first engine, still alive, must not write its trained
    values into the model the second engine now trains."""
    model = WithLoss(tiny_mlp(seed=0))
    cfg = config("torchax")
    del cfg["scheduler"]  # a fixed lr: WarmupLR's first steps have lr 0
    first, *_ = spmdzero.initialize(model=model, config=cfg)
    for x, y in batches(2, 16):
        first.backward(first(x, y))
        first.step()
    first.module  # noqa: B018 (synced: the model holds the first engine's values)
    second, *_ = spmdzero.initialize(model=model, config=cfg)
    for x, y in batches(2, 16):
        second.backward(second(x, y))
        second.step()
    second.module  # noqa: B018 (synced: nothing of the second engine's left to copy back)
    first.host.params_changed()  # as if the first engine had stepped again since
    saved = model.state_dict()
    for name, value in second.params().items():
        torch.testing.assert_close(saved[name], torch.from_numpy(__import__("numpy").asarray(value)))


class CountingMean(torch.nn.Module):
    """A buffer updated in place by every forward (running statistics, a step counter)."""

    def __init__(self):
        super().__init__()
        self.net = tiny_mlp(seed=0)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, y):
        self.calls.add_(1)
        return torch.nn.functional.mse_loss(self.net(x), y)


def test_buffers_a_forward_updates_reach_the_module():
    engine, *_ = spmdzero.initialize(model=CountingMean(), config=config("torchax"))
    for x, y in batches(3, 16):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.module.state_dict()["calls"].item() == 3
    assert engine.state_dict()["module.calls"].item() == 3  # named as DeepSpeed's engine names them


def test_an_eval_forward_runs_in_eval_mode_whichever_mode_traced_first():
    model = WithLoss(dropout_mlp())
    reference = dropout_mlp()
    engine, *_ = spmdzero.initialize(model=model, config=config("torchax"))
    (x, y), = batches(1, 16)
    with torch.no_grad():
        engine(x, y)  # train mode, no grad: a plain forward with dropout on
    engine.eval()
    with torch.no_grad():
        got = engine(x, y).item()
    assert got == pytest.approx(host_loss(reference, x, y), rel=1e-5)


def test_training_in_eval_mode_and_a_validation_forward_between_forward_and_backward():
    """Fine-tuning with dropout off (the module in eval mode, grad enabled), and a no-grad
    forward between a training forward and its backward: the same steps as the torch_xla engine."""
    results = {}
    for backend in ("torch_xla", "torchax"):
        engine, *_ = spmdzero.initialize(model=WithLoss(dropout_mlp()), config=config(backend))
        engine.eval()
        for i, (x, y) in enumerate(batches(3, 16)):
            loss = engine(x, y)
            if i == 1:
                with torch.no_grad():
                    engine(x, y)  # validation in between
            engine.backward(loss)
            engine.step()
        results[backend] = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    for name, value in results["torch_xla"].items():
        torch.testing.assert_close(results["torchax"][name], value, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["torch SGD", "AdamW", "AdamW bf16"])
def test_the_optimizers_state_dict_is_torchs_and_resumes_the_training(optimizer):
    """``optimizer.state_dict()`` / ``load_state_dict()`` as a plain PyTorch loop saves and
    resumes with them (DeepSpeedExamples' ImageNet example): torch's format, the states read
    from the devices (the base optimizer's own ``state`` holds none: both used to be refused).
    A torch optimizer's dict equals plain torch's after the same steps; loaded into a fresh
    engine, before its first step, it continues as the engine that saved it does, bit for bit,
    the fp32 master weights included under bf16 (``optimizer_state_dict``)."""
    cfg = {**config("torchax"), "gradient_clipping": 0.0, "scheduler": None}
    cfg.pop("scheduler")
    if optimizer == "AdamW bf16":
        cfg["bf16"] = {"enabled": True}
    data = batches(4, 16)

    def start():
        model = WithLoss(tiny_mlp(seed=0))
        client = None
        if optimizer == "torch SGD":
            cfg.pop("optimizer", None)
            client = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engine, opt, *_ = spmdzero.initialize(model=model, optimizer=client, config=cfg)
        return engine, opt

    def steps(engine, batches_):
        for x, y in batches_:
            engine.backward(engine(x.to(torch.bfloat16) if optimizer == "AdamW bf16" else x, y))
            engine.step()
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}

    engine, opt = start()
    steps(engine, data[:2])
    saved = opt.state_dict()
    assert sorted(saved) == ["param_groups", "state"] and sorted(saved["state"]) == [0, 1, 2, 3]
    if optimizer == "torch SGD":
        reference = WithLoss(tiny_mlp(seed=0))
        sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        for x, y in data[:2]:
            reference(x, y).backward()
            sgd.step()
            sgd.zero_grad()
        want = sgd.state_dict()
        assert saved["param_groups"] == want["param_groups"]
        for i, states in want["state"].items():
            torch.testing.assert_close(saved["state"][i]["momentum_buffer"], states["momentum_buffer"],
                                       atol=1e-6, rtol=1e-5)
    else:
        assert {"exp_avg", "exp_avg_sq", "step"} <= saved["state"][0].keys()
        assert ("fp32_master_weight" in saved["state"][0]) == (optimizer == "AdamW bf16")
    buffer = io.BytesIO()
    torch.save({"state_dict": engine.module.state_dict(), "optimizer": saved}, buffer)
    continued = steps(engine, data[2:])
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed, opt = start()
    resumed.module.load_state_dict(checkpoint["state_dict"])
    opt.load_state_dict(checkpoint["optimizer"])
    for name, value in steps(resumed, data[2:]).items():
        assert torch.equal(value, continued[name]), name
    with pytest.raises(ValueError, match="number of parameter groups"):
        opt.load_state_dict({**saved, "param_groups": saved["param_groups"] * 2})


def test_the_batch_rule_holds_for_training_forwards():
    """More rows than configured are trained and counted (DeepSpeed does not check them),
    fewer warn once."""
    engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=config("torchax"))
    (x, y), = batches(1, 32)
    engine.backward(engine(x, y))
    assert engine._rows_since_step == 32
    with pytest.warns(UserWarning, match="partial batch"):
        engine(x[:8], y[:8])
    with torch.no_grad():
        engine(x, y)  # evaluation takes any batch


def test_parameter_groups_the_module_does_not_own_are_refused_and_empty_ones_dropped():
    model = WithLoss(tiny_mlp(seed=0))
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"param group 1 .* not parameters of the model \(shapes \[\(3,\)\]\)"):
        spmdzero.initialize(model=model, config=config("torchax"),
                            model_parameters=[{"params": list(model.parameters())}, {"params": [stray]}])
    model.net[2].requires_grad_(False)
    engine, *_ = spmdzero.initialize(model=model, config=config("torchax"), model_parameters=[
        {"params": list(model.net[0].parameters())}, {"params": list(model.net[2].parameters()), "lr": 0.5}])
    assert len(engine.get_lr()) == 1  # the all-frozen group is dropped, as DeepSpeed drops it
    assert not engine.was_step_applied()  # no step yet
    with pytest.raises(AttributeError, match="engine.snapshot is not supported by the torchax backend"):
        engine.snapshot


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_the_collectives_report_compiles_one_step_and_runs_nothing(stage):
    """The step traced (not run) and compiled for XLA:CPU: ZeRO-2 reduce-scatters the gradients
    (all-reduce + partition-indexed slices on CPU) where ZeRO-0 all-reduces them, at the
    data-parallel minimum's traffic; the engine trains on as before, its programs unchanged, with
    the loss given by ``loss_fn`` (the module's output is not a loss) or the module's own."""
    cfg = {**config("torchax"), "zero_optimization": {"stage": stage}}
    engine, *_ = spmdzero.initialize(model=tiny_mlp(seed=0), config=cfg)
    (x, y), = batches(1, 16)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    teacher = torch.nn.Linear(16, 8)  # targets computed in the loss function, moved as scripts move them
    report = engine.collectives_report(x, loss_fn=lambda out: torch.nn.functional.mse_loss(
        out, teacher(x).detach().to(engine.device)))
    assert engine.global_steps == 0 and engine.traces == {}
    for name, p in engine.module.named_parameters():
        assert torch.equal(p.detach(), before[name])
    kinds = set(report.collectives)
    assert any(k.startswith("reduce-scatter") for k in kinds) == (stage == 2), kinds
    assert report.ratio == pytest.approx(1.0, abs=0.15), str(report)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))  # the engine's own programs: one VJP forward
    engine.step()
    assert engine.traces["vjp_forward"] == 1 and engine.global_steps == 1
    module_loss, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=cfg)
    assert set(module_loss.collectives_report(x, y).collectives) == kinds


def test_engine_compile_is_a_no_op_that_says_so():
    """DeepSpeed's engine.compile() (accelerate calls it with dynamo on): the programs are jax.jit's."""
    engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=config("torchax"))
    assert not engine.is_compiled
    engine.compile(backend="inductor")
    assert engine.is_compiled
    (x, y), = batches(1, 16)
    engine.backward(engine(x, y))
    engine.step()


def test_the_deepspeed_engine_api_a_script_reaches_for(tmp_path):
    engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=config("torchax"))
    (x, y), = batches(1, 16)
    assert engine.local_rank == engine.global_rank == 0
    engine.backward(engine(x.to(engine.device), y.to(engine.device)))
    engine.step()
    assert engine.save_16bit_model(str(tmp_path))
    saved = torch.load(tmp_path / "pytorch_model.bin")
    for name, p in engine.module.named_parameters():
        torch.testing.assert_close(saved[name], p.detach())


class Aliased(torch.nn.Module):
    """A submodule registered under two names (``self.alias = self.shared``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = torch.nn.Linear(16, 8)
        self.alias = self.shared

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.alias(x) + self.shared(x), y)


def test_a_submodule_under_two_names_keeps_its_host_parameters():
    engine, *_ = spmdzero.initialize(model=Aliased(), config=config("torchax"))
    for x, y in batches(2, 16):
        engine.backward(engine(x, y))
        engine.step()
    from torchax.tensor import Tensor as Traced

    # the host's own, not the traced tensors
    assert all(isinstance(p, torch.nn.Parameter) and not isinstance(p, Traced) for p in engine.module.parameters())
    assert set(engine.module.state_dict()) == {f"{m}.{k}" for m in ("shared", "alias") for k in ("weight", "bias")}


def test_the_torch_xla_only_names_are_exactly_what_the_torchax_engine_lacks():
    """The list behind "engine.X is not supported by the torchax backend" cannot fall behind
    either engine."""
    from spmdzero.backends.torch_xla.engine import SpmdZeroEngine
    from spmdzero.backends.torchax.engine.engine import TorchaxEngine
    from spmdzero.backends.torchax.engine.host_module import TORCH_XLA_ONLY

    public = lambda cls: {n for n in dir(cls) if not n.startswith("_")}  # noqa: E731
    assert TORCH_XLA_ONLY == public(SpmdZeroEngine) - public(torch.nn.Module) - public(TorchaxEngine)


def test_the_step_log_monitors_and_a_nonfinite_fp32_loss_are_told(tmp_path):
    """steps_per_print and the csv/TensorBoard monitors write as on the torch_xla backend (they
    were refused, and steps_per_print ignored), and a NaN loss in fp32, which poisons the
    parameters as in DeepSpeed, is told once at the print step that reads it, with no device
    read of its own."""
    import warnings

    from conftest import spmdzero_log

    class Scaled(WithLoss):
        def forward(self, x, y, scale):
            return super().forward(x, y) * scale

    engine, *_ = spmdzero.initialize(model=Scaled(tiny_mlp(seed=0)), config=config(
        "torchax", steps_per_print=2, csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"}))
    (x, y), = batches(1, 16)
    with spmdzero_log() as records, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            engine.backward(engine(x, y, torch.tensor(float("nan") if i == 2 else 1.0)))
            engine.step()
    lines = [r.getMessage() for r in records if r.getMessage().startswith("step=")]
    assert [line.split(",")[0] for line in lines] == ["step=2", "step=4", "step=6"]
    assert "loss=nan" in lines[1] and "grad_norm=nan" in lines[1]
    told = [str(w.message) for w in caught if "no longer finite" in str(w.message)]
    assert len(told) == 1 and "the loss is nan at global step 4" in told[0], told
    logged = (tmp_path / "j" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert logged[0] == "step,train_loss" and [row.split(",")[0] for row in logged[1:]] == ["32", "64", "96"]
    assert logged[2].endswith(",nan")


# ---- issue #32: edits through .data, backward's loss, zero_grad, dict outputs ---------------------

def plain_config(gas: int = 1, **extra) -> dict:
    """SGD with momentum at a fixed lr, no clipping: a step is ``torch_optimizer``'s, so the
    engine is checked against plain torch (SGD's step is linear in the gradient: rounding
    differences stay rounding-sized, where Adam's first step magnifies them on tiny gradients)."""
    cfg = config("torchax", gas, optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                 gradient_clipping=0.0, **extra)  # DeepSpeed's default clips at 1.0
    del cfg["scheduler"]
    return cfg


def torch_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def torch_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *losses) -> None:
    """Plain torch's step over ``losses``, each backpropagated in turn."""
    for loss in losses:
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def assert_as_in_torch(engine, reference: torch.nn.Module) -> None:
    """The engine's parameters equal plain torch's, on every device alike."""
    for name, value in reference.named_parameters():
        shards = [np.asarray(s.data) for s in engine.params()[name].addressable_shards]
        assert all(np.array_equal(s, shards[0]) for s in shards), f"{name}: the devices disagree"
        torch.testing.assert_close(engine.module.get_parameter(name).detach(), value.detach(), atol=1e-6, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_edits_of_parameters_after_initialize_train_as_in_torch():
    """Through ``.data`` (whole, partial, set), in place under no_grad, ``copy_``: each reaches
    every device and the next step starts from it (an edit through ``.data`` used to leave the
    first device sharing the host's memory: after a step the bias was a mix of shards)."""
    model, reference = WithLoss(tiny_mlp(seed=0)), WithLoss(tiny_mlp(seed=0))
    engine, *_ = spmdzero.initialize(model=model, config=plain_config())
    optimizer = torch_optimizer(reference)

    def in_place(m):
        with torch.no_grad():
            m.net[0].weight.mul_(0.5)
            m.net[2].bias.copy_(torch.arange(8.0))

    edits = [lambda m: m.net[0].bias.data.fill_(0.5),
             lambda m: m.net[2].weight.data[0].zero_(),  # partial, on a host not read since the last step
             in_place,
             lambda m: setattr(m.net[2].bias, "data", torch.full((8,), -1.0))]
    for edit, (x, y) in zip(edits, batches(len(edits), 16)):
        edit(model), edit(reference)
        engine.backward(engine(x, y))
        engine.step()
        torch_step(reference, optimizer, reference(x, y))
    assert_as_in_torch(engine, reference)


def test_backward_of_an_earlier_forwards_loss_takes_its_gradient():
    """Two forwards, then backward of each loss in either order: torch's sum of both gradients
    (it used to say the module must return its loss); with retain_graph, a loss twice. A second
    backward of one loss without it, or one after the optimizer step, says what happened."""
    model, reference = WithLoss(tiny_mlp(seed=0)), WithLoss(tiny_mlp(seed=0))
    engine, *_ = spmdzero.initialize(model=model, config=plain_config())
    optimizer = torch_optimizer(reference)
    (x1, y1), (x2, y2) = batches(2, 16)
    first, second = engine(x1, y1), engine(x2, y2)
    engine.backward(first)
    engine.backward(second)
    with pytest.raises(RuntimeError, match="an earlier backward already committed"):
        engine.backward(first)
    engine.step()
    torch_step(reference, optimizer, reference(x1, y1), reference(x2, y2))
    assert_as_in_torch(engine, reference)
    twice = engine(x1, y1)
    engine.backward(twice, retain_graph=True)
    engine.backward(twice)  # its gradient counted twice, as torch counts it
    engine.step()
    loss = reference(x1, y1)
    loss.backward(retain_graph=True)
    torch_step(reference, optimizer, loss)
    assert_as_in_torch(engine, reference)
    late = engine(x1, y1)
    engine.backward(engine(x2, y2))
    engine.step()
    with pytest.raises(RuntimeError, match="the parameters changed since that forward"):
        engine.backward(late)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_gradient_counted_before_its_backward_is_as_deepspeeds_commit(stage):
    """Later in an accumulation window a training forward adds its gradient to the accumulated
    ones as it runs (no second copy of the gradients waits for the backward): trained as torch
    commits at the backward. A forward no backward followed adds nothing (taken out again, with
    a note, at the step); two forwards then their backwards in either order sum both; a backward
    that scales otherwise than the forward assumed takes the gradient again."""
    model, reference = WithLoss(tiny_mlp(seed=0)), WithLoss(tiny_mlp(seed=0))
    engine, *_ = spmdzero.initialize(model=model, config=plain_config(2, zero_optimization={"stage": stage}))
    optimizer = torch_optimizer(reference)
    (x1, y1), (x2, y2), (x3, y3) = batches(3, 16)
    engine.backward(engine(x1, y1))
    engine.step()
    engine(x3, y3)  # never backwarded, in training mode with grad enabled
    engine.backward(engine(x2, y2))
    with pytest.warns(UserWarning, match="was not passed to engine.backward"):
        engine.step()
    assert engine.runs["retract"] == 1
    torch_step(reference, optimizer, reference(x1, y1) / 2, reference(x2, y2) / 2)
    assert_as_in_torch(engine, reference)
    engine.backward(engine(x1, y1))
    engine.step()
    second, third = engine(x2, y2), engine(x3, y3)
    engine.backward(third)
    engine.backward(second)
    engine.step()
    torch_step(reference, optimizer, *(reference(x, y) / 2 for x, y in ((x1, y1), (x2, y2), (x3, y3))))
    assert_as_in_torch(engine, reference)
    engine.backward(engine(x1, y1))
    engine.step()
    engine.backward(engine(x2, y2), scale_wrt_gas=False)  # the forward divided by 2
    engine.step()
    torch_step(reference, optimizer, reference(x1, y1) / 2, reference(x2, y2))
    assert_as_in_torch(engine, reference)
    assert engine.runs["retract"] == 2


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_between_forward_and_backward_drops_only_what_deepspeed_drops(stage):
    """The backward after a zero_grad still makes its gradients, and the step applies them (it
    used to say there was no backward); ZeRO-2 keeps the window's earlier micro-batches,
    ZeRO-1 drops them before the boundary's backward (engine_base.zero_grad_keeps_gradients)."""
    model, reference = WithLoss(tiny_mlp(seed=0)), WithLoss(tiny_mlp(seed=0))
    engine, *_ = spmdzero.initialize(model=model, config=plain_config(2, zero_optimization={"stage": stage}))
    optimizer = torch_optimizer(reference)
    (x1, y1), (x2, y2) = batches(2, 16)
    for zero_grad in (engine.zero_grad, engine.optimizer.zero_grad):
        loss = engine(x1 if zero_grad == engine.zero_grad else x2, y1 if zero_grad == engine.zero_grad else y2)
        zero_grad()
        engine.backward(loss)
        engine.step()
    assert engine.global_steps == 1
    kept = [reference(x1, y1) / 2] if stage == 2 else []
    torch_step(reference, optimizer, *kept, reference(x2, y2) / 2)
    assert_as_in_torch(engine, reference)


class DictLoss(WithLoss):
    def forward(self, x, y):
        logits = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(logits, y), "logits": logits}


def test_a_dict_output_with_a_loss_key_trains_as_in_torch():
    model, reference = DictLoss(tiny_mlp(seed=0)), DictLoss(tiny_mlp(seed=0))
    engine, *_ = spmdzero.initialize(model=model, config=plain_config())
    optimizer = torch_optimizer(reference)
    for x, y in batches(2, 16):
        out = engine(x, y)
        assert sorted(out) == ["logits", "loss"] and tuple(out["logits"].shape) == (16, 8)
        engine.backward(out["loss"])
        engine.step()
        torch_step(reference, optimizer, reference(x, y)["loss"])
    assert out["loss"].item() == pytest.approx(engine.last_loss())
    assert_as_in_torch(engine, reference)


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_an_input_that_requires_grad_gets_torchs_gradient(where):
    """``x.grad`` as torch gives it, accumulated over two backwards (it used to stay None, with a
    warning), for the module's own loss and for one computed outside it."""
    make = (lambda: WithLoss(tiny_mlp(seed=0))) if where == "inside" else (lambda: tiny_mlp(seed=0))
    model, reference = make(), make()
    engine, *_ = spmdzero.initialize(model=model, config=plain_config())
    (x, y), = batches(1, 16)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = (lambda m, x: m(x, y)) if where == "inside" else (lambda m, x: torch.nn.functional.mse_loss(m(x), y))
    for _ in range(2):
        engine.backward(loss(engine, ours))
        loss(reference, theirs).backward()
    assert ours.grad is not None and ours.grad.device.type == "cpu"
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=1e-5)
    engine.step()
    torch_optimizer(reference).step()
    assert_as_in_torch(engine, reference)


def test_backward_without_scaling_by_accumulation_trains_as_torch_on_the_summed_losses():
    """``backward(loss, scale_wrt_gas=False)``, as the Hugging Face Trainer calls it at every step
    (it divides the loss itself): the module's loss and one computed outside are both taken
    unscaled (it used to be refused), without a new program after the first step."""
    model, reference = MaybeLoss(tiny_mlp(seed=0)), MaybeLoss(tiny_mlp(seed=0))
    engine, *_ = spmdzero.initialize(model=model, config=plain_config(2))
    optimizer = torch_optimizer(reference)
    for step, ((x1, y1), (x2, y2)) in enumerate(zip(*[iter(batches(6, 16))] * 2)):
        for x, y in ((x1, y1), (x2, y2)):
            engine.backward(engine(x, y)["loss"], scale_wrt_gas=False)
            engine.step()
        torch_step(reference, optimizer, reference(x1, y1)["loss"], reference(x2, y2)["loss"])
        assert_as_in_torch(engine, reference)
        traces = dict(engine.traces) if step == 0 else traces
    assert dict(engine.traces) == traces
    x, y = batches(1, 16)[0]
    for _ in range(2):
        engine.backward(torch.nn.functional.mse_loss(engine(x)["logits"], y), scale_wrt_gas=False)
        engine.step()
    loss = torch.nn.functional.mse_loss(reference(x)["logits"], y)
    torch_step(reference, optimizer, loss, torch.nn.functional.mse_loss(reference(x)["logits"], y))
    assert_as_in_torch(engine, reference)


def test_int64_labels_mixed_with_outputs_print_no_jax_dtype_warning():
    """cifar's accuracy count (``(predicted == labels).sum()``, labels int64) printed JAX's "int64
    ... is not available" at every eval batch."""
    import warnings

    engine, *_ = spmdzero.initialize(model=tiny_mlp(seed=0), config=plain_config())
    x, _ = batches(1, 16)[0]
    with torch.no_grad():
        logits = engine(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        labels = torch.arange(16) % 8
        correct = (logits.argmax(-1) == labels).sum().item() + logits.long().sum().item() * 0
    assert 0 <= correct <= 16
    assert not [w for w in caught if "int64" in str(w.message)], [str(w.message) for w in caught]


def test_the_sharding_report_reads_as_the_torch_xla_engines(trained):
    """``engine.sharding_report()`` and ``model_state_bytes`` on the torchax backend (they were
    torch_xla only): the same layouts and per-device bytes, read from the JAX arrays."""
    from spmdzero.observe.reports import model_state_bytes

    _, (ref, *_), (engine, *_) = trained
    ours, theirs = engine.sharding_report(), ref.sharding_report()
    assert ours.totals() == theirs.totals()
    assert sorted((e.parameter, e.role, e.layout, e.device_bytes) for e in ours.entries) == sorted(
        (e.parameter, e.role, e.layout, e.device_bytes) for e in theirs.entries)
    assert model_state_bytes(engine) == model_state_bytes(ref)
    assert "ZeRO stage 2 on 8 devices" in str(ours)


COMPILE_CACHE = """
    import collections, json, os, sys
    sys.path[:0] = ["tests", "tests/backends/torchax"]  # conftest, and this folder's test modules
    import jax
    events = collections.Counter()
    jax.monitoring.register_event_listener(lambda name, **kwargs: events.update([name]))
    import spmdzero
    from test_torchax_backend import WithLoss, config
    from test_torchax_optimizers import train
    from conftest import batches, tiny_mlp
    cfg = config("torchax", 2)
    cfg["spmd"]["compile_cache_dir"] = {path!r}
    engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=cfg)
    losses = train(engine, batches(4, 16))
    print(json.dumps({{"hits": events["/jax/compilation_cache/cache_hits"], "losses": losses,
                      "files": len(os.listdir({path!r}))}}))
"""


@pytest.mark.slow
def test_the_compile_cache_dir_serves_a_second_process_the_steps_programs(tmp_path):
    """``spmd.compile_cache_dir`` on the torchax backend (it was refused): JAX's persistent
    cache, every program in it however small; a second process loads the training and update
    programs from it instead of compiling them, and trains the same."""
    import json

    from conftest import run_python

    first, second = (json.loads(run_python(COMPILE_CACHE.format(path=str(tmp_path / "cache"))).strip().splitlines()[-1])
                     for _ in range(2))
    assert first["hits"] == 0 and first["files"] >= 3  # the two training programs and the update, at least
    assert second["hits"] >= 3 and second["files"] == first["files"]
    assert second["losses"] == first["losses"]


def test_a_dcn_mesh_puts_data_across_slices_and_trains_as_the_torch_xla_engine():
    """``spmd.dcn_mesh`` on the torchax backend (it was refused): ``data`` across slices, the
    rest within one, each slice a contiguous block of devices (``backends/torchax/engine/mesh.py``);
    the same losses and parameters as the torch_xla engine on that mesh shape (its HybridMesh
    refuses one slice: "Invalid dcn_mesh_shape for single slice mesh")."""
    runs = {}
    for backend in ("torch_xla", "torchax"):
        cfg = config(backend, 2)
        cfg["spmd"].update({"dcn_mesh": {"data": 2}} if backend == "torchax" else {"mesh": {"data": 2, "fsdp": -1}})
        engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0)), config=cfg)
        losses = []
        for x, y in batches(2 * STEPS, 16):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[backend] = engine, losses
    (ref, ref_losses), (engine, losses) = runs["torch_xla"], runs["torchax"]
    assert dict(engine.plan.mesh_shape) == dict(ref.plan.mesh_shape) == {"data": 2, "fsdp": 4}
    assert [[d.id for d in row] for row in engine.mesh.devices] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for (name, p), (_, q) in zip(engine.module.named_parameters(), ref.module.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach().cpu(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("read", ["bool", "tolist"])
def test_a_forward_that_reads_a_value_on_the_host_trains_eagerly_as_on_torch_xla(read):
    """JAX traces the forward once and cannot stop for a value: the torchax backend runs that
    forward eagerly (host_reads, tests/backends/torchax/test_torchax_host_reads.py) and trains what the torch_xla
    backend trains, which cuts the step in two there (observe/test_monitor.py)."""
    losses, engines = {}, {}
    for backend in ("torchax", "torch_xla"):
        engine, *_ = spmdzero.initialize(model=ReadsBack(read), config={
            "train_batch_size": 16, "optimizer": {"type": "Adam"}, "spmd": {"backend": backend}})
        engines[backend], losses[backend] = engine, []
        for x, y in batches(3, 16):
            loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses[backend].append(loss.item())
    assert engines["torchax"].host_reads.noted
    assert losses["torchax"] == pytest.approx(losses["torch_xla"], abs=1e-5)


WITHOUT_TORCH_XLA = """
    import sys

    class NotInstalled:  # as an install without the torch_xla extra: `import torch_xla` fails
        def find_spec(self, name, path=None, target=None):
            if name == "torch_xla" or name.startswith("torch_xla."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    import importlib.util
    importlib.util.find_spec = (lambda real: lambda name, *a, **k: None if name.split(".")[0] == "torch_xla"
                                else real(name, *a, **k))(importlib.util.find_spec)
    import json, tempfile, torch
    import spmdzero

    def tiny_mlp():  # conftest's, which would start torch_xla's runtime
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))

    def batches(n, rows):
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(rows, 16, generator=g), torch.randn(rows, 8, generator=g)) for _ in range(n)]

    cfg = {"train_batch_size": 16, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=cfg)
    losses = []
    for x, y in batches(4, 8):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    path = tempfile.mkdtemp()
    engine.save_checkpoint(path)
    engine.load_checkpoint(path)
    spmdzero.alias_deepspeed()
    import deepspeed
    deepspeed.init_distributed()
    torch.distributed.barrier()
    out = {"engine": type(engine).__name__, "losses": losses, "steps": engine.global_steps,
           "torch_xla": sorted(m for m in sys.modules if m.startswith("torch_xla"))}
    try:
        spmdzero.initialize(model=tiny_mlp(), config={**cfg, "spmd": {"backend": "torch_xla"}})
    except spmdzero.ConfigError as err:
        out["torch_xla_config"] = str(err)
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_without_torch_xla_installed_the_default_backend_trains_and_the_extra_is_named():
    """``pip install spmdzero`` has no torch_xla: import, training, checkpoints, the DeepSpeed
    layer and its barrier import none of it; a config naming torch_xla says how to install it."""
    import json

    from conftest import run_python

    out = json.loads(run_python(WITHOUT_TORCH_XLA, env={"SPMDZERO_BACKEND": ""}).strip().splitlines()[-1])
    assert out["engine"] == "TorchaxEngine" and out["steps"] == 2 and len(out["losses"]) == 4
    assert out["torch_xla"] == []
    assert out["torch_xla_config"] == ("spmd.backend='torch_xla' needs torch_xla, which is not installed: pip "
                                       "install 'spmdzero[torch_xla]' (torch_xla==2.9.0, which runs on torch 2.9 "
                                       f"only; this is torch {torch.__version__}), or use spmd.backend='torchax' "
                                       "(the default)")


def _clipped_ratio(module, x, y):
    ratio = torch.exp(module(x)["logits"] - y)
    return -torch.min(ratio, torch.clamp(ratio, 0.8, 1.2)).mean()


def _odds_ratio_on_the_host(module, x, y):
    """TRL's ORPO loss, in small: ``log1mexp`` is a ``torch.where`` with a number, and the loss
    goes back ``.to(args.device)``, which is the host here."""
    logps = -torch.nn.functional.softplus(module(x)["logits"] - y).mean(-1)
    chosen, rejected = logps[: len(logps) // 2], logps[len(logps) // 2:]

    def log1mexp(v):
        return torch.where(v < -0.6931471805599453, torch.log1p(-torch.exp(v)), torch.log(-torch.expm1(v)))
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    loss = -chosen.mean() - 0.1 * torch.nn.functional.logsigmoid(log_odds).mean()
    return torch.where(loss > 100, 100.0, loss).to("cpu")


def _logps_along_ids(module, x, y):
    """TRL's online DPO takes its log-probs with ``torch.take_along_dim`` and host ids."""
    logps = module(x)["logits"].log_softmax(-1)
    ids = (y.abs() * 10).long() % logps.shape[-1]
    return -torch.take_along_dim(logps, ids, dim=-1).mean()


def _ops_torchax_cannot_lower(module, x, y):
    """Ops whose backward (or forward: ``det``) torchax 0.0.13 has no lowering of, in a loss
    outside the module: each runs on the host (``host_fallback``)."""
    out = module(x)["logits"]
    ids = (y.abs() * 10).long() % out.shape[-1]
    terms = [torch.cdist(out, out.flip(0)).mean(),
             torch.zeros_like(out).masked_scatter(y > 0, out).square().mean(),
             torch.nn.functional.conv1d(out[None], torch.ones(2, out.shape[0], 2)).mean(),
             torch.nn.functional.avg_pool1d(out[None], 2).square().mean(),
             torch.nn.functional.interpolate(out[None], scale_factor=2, mode="linear").square().mean(),
             torch.linalg.det(out[:2, :2]),
             torch.nn.functional.multi_margin_loss(out, ids[:, 0]),
             torch.nn.functional.embedding_bag(ids[:, :2], out.T, mode="mean").square().mean()]
    return sum(terms)


@pytest.mark.parametrize("loss", [_clipped_ratio, _odds_ratio_on_the_host, _logps_along_ids, _ops_torchax_cannot_lower],
                         ids=["clamp", "moved_to_the_host", "take_along_dim", "ops_torchax_cannot_lower"])
def test_a_loss_outside_the_module_whose_backward_makes_tensors_trains_as_torch(loss):
    """``clamp``'s gradient is ``where(in_range, grad, zeros({}, grad.options()))``: made from the
    outputs' options, that zero was a meta tensor ("Cannot copy out of meta tensor; no data!",
    TRL's GRPO loss, which clamps its probability ratio). So was the gradient of a loss moved to
    the host (TRL's ORPO: ``loss.to(args.device)``), which the move's backward copies to the
    outputs' ``meta`` device, and a number in ``torch.where`` on the outputs, which torch makes
    a tensor there. Each is made in JAX (``autograd_factories``, ``output_functions``), and the
    gradients are torch's; so are ``take_along_dim``'s with host ids, which torch refused, and
    those of ops torchax cannot lower, which run on the host (``host_fallback``)."""
    model, reference = MaybeLoss(tiny_mlp(seed=0)), MaybeLoss(tiny_mlp(seed=0))
    engine, *_ = spmdzero.initialize(model=model, config=plain_config())
    optimizer = torch_optimizer(reference)
    for x, y in batches(2, 16):
        value = loss(engine, x, y)
        engine.backward(value)
        engine.step()
        expected = loss(reference, x, y)
        torch_step(reference, optimizer, expected)
        assert value.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-6)
        assert_as_in_torch(engine, reference)


class Critic(torch.nn.Module):
    """DeepSpeed-Chat's critic, in small: a value head, and ``forward_value``, which the PPO step
    calls through the engine (``critic_engine.forward_value(seq, mask)``) and trains from with
    ``critic_engine.backward``; its end scores read where each row's padding starts
    (``.nonzero()``, ``.item()``)."""

    def __init__(self):
        super().__init__()
        self.net = tiny_mlp(seed=0, d_out=1)
        self.checkpointing = False

    def forward(self, x):
        return self.net(x).squeeze(-1)

    def forward_value(self, x, ids=None, return_value_only=False):
        values = self(x)
        if return_value_only:
            return values
        ends = [(row == 0).nonzero()[0].item() if (row == 0).any() else len(row) for row in ids]
        return {"values": values, "end_scores": torch.stack([values[i] * e for i, e in enumerate(ends)])}

    def gradient_checkpointing_enable(self):
        self.checkpointing = True
        return "configured"

    def set_bias(self, value):
        with torch.no_grad():
            self.net[-1].bias.copy_(value)


def test_a_method_of_the_models_class_called_through_the_engine_trains_as_torch():
    """``engine.forward_value(...)`` runs in a program of its own and its loss trains through
    ``engine.backward`` (it ran on the host module, and backward refused the loss); with host
    reads it runs eagerly; a method called without a tensor configures the host module."""
    model, reference = Critic(), Critic()
    engine, *_ = spmdzero.initialize(model=model, config=plain_config())
    optimizer = torch_optimizer(reference)
    assert engine.gradient_checkpointing_enable() == "configured" and model.checkpointing

    def value_loss(critic, x, y):
        values = critic.forward_value(x, return_value_only=True)
        return ((values - y[:, 0]) ** 2).mean()

    for step, (x, y) in enumerate(batches(3, 16)):
        engine.backward(value_loss(engine, x, y))
        engine.step()
        torch_step(reference, optimizer, value_loss(reference, x, y))
        assert_as_in_torch(engine, reference)
        if step == 0:
            traces = dict(engine.traces)
    assert dict(engine.traces) == traces  # compiled once
    with warnings.catch_warnings():  # its argument, taken for a batch of 1 row the first time
        warnings.simplefilter("ignore")
        engine.set_bias(torch.full((1,), 0.25))  # kept: it ran on the host
    reference.set_bias(torch.full((1,), 0.25))
    assert_as_in_torch(engine, reference)
    ids = torch.tensor([[3, 0, 0, 0], [5, 6, 7, 0], [1, 2, 3, 4]] * 4 + [[2, 0, 0, 0]] * 4)
    engine.eval(), reference.eval()
    with torch.no_grad():
        got, want = engine.forward_value(batches(1, 16)[0][0], ids=ids), reference.forward_value(batches(1, 16)[0][0], ids=ids)
    torch.testing.assert_close(torch.as_tensor(np.asarray(got["end_scores"])), want["end_scores"], atol=1e-6, rtol=0)


class _Student(torch.nn.Module):
    """A student whose loss reads a teacher: it calls the teacher (an engine, or the module in
    plain torch) and projects through the teacher's last weight itself, as TRL's
    DistillationTrainer does with the teacher's ``lm_head``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x, teacher, teacher_module):
        with torch.no_grad():
            target = teacher(x)
        # [8, 64]: read here, not in the teacher's own forward; detached, as the teacher is not
        # trained by this loss (the torchax backend gives another engine's parameters no gradient)
        weight = teacher_module.net[2].weight.detach()
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.body(x))), target @ weight @ weight.t())


def _redirected(wrapper, module, method, *args):
    """TRL's forward redirection: ``wrapper`` (an engine, or the module itself) is called, and
    ``module.forward`` is swapped for ``method`` for that call, a swap that undoes itself."""
    original = module.forward

    def swapped(*a, **k):
        module.forward = original
        return method(*a, **k)

    module.forward = swapped
    return wrapper(*args)


@pytest.mark.parametrize("backend,stages", [("torchax", (2, 0)), ("torchax", (3, 3)), ("torch_xla", (2, 0))],
                         ids=["zero2-teacher0", "zero3-teacher3", "torch_xla"])
def test_an_engine_called_inside_anothers_forward_trains_as_in_plain_torch(backend, stages):
    """The teacher engine is called inside the student engine's forward and its module's weight
    read there (``other_engines``). The student's programs take the teacher's parameters as
    inputs, not constants: the teacher is trained too, between the student's steps, and the
    student's losses follow it as in plain torch. The student's training forward is traced
    twice (the first trace met the teacher), and never again. The torch_xla backend runs the
    module on its lazy tensors, which hold the teacher's current values anyway."""
    student_stage, teacher_stage = stages

    def run(engines: bool):
        student, teacher = _Student(), WithLoss(tiny_mlp(seed=0))
        s_opt, t_opt = (torch.optim.SGD(m.parameters(), lr=0.2) for m in (student, teacher))
        s_call, t_call = student, teacher.net
        if engines:
            s_call, *_ = spmdzero.initialize(model=student, optimizer=s_opt, config={
                "train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": student_stage},
                "spmd": {"backend": backend}})
            t_engine, *_ = spmdzero.initialize(model=teacher, optimizer=t_opt, config={
                "train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": teacher_stage},
                "spmd": {"backend": backend}})
            t_call = lambda x: _redirected(t_engine, teacher, lambda v: teacher.net(v), x)  # noqa: E731
        losses = []
        for x, y in batches(STEPS, 16):
            loss = _redirected(s_call, student, student.forward, x, t_call, teacher)
            if engines:
                s_call.backward(loss)
                s_call.step()
                t_engine.backward(t_engine(x, y))
                t_engine.step()
            else:
                loss.backward()
                s_opt.step()
                s_opt.zero_grad()
                teacher(x, y).backward()
                t_opt.step()
                t_opt.zero_grad()
            losses.append(float(loss.detach().cpu()))
        # each swap undone, the first trace's included (it stopped after the student's swap undid itself)
        assert student.forward.__func__ is _Student.forward and teacher.forward.__func__ is WithLoss.forward
        params = {n: p.detach().cpu().clone() for n, p in student.named_parameters()}
        return losses, params, (s_call if engines else None)

    reference, reference_params, _ = run(engines=False)
    losses, params, engine = run(engines=True)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert len(set(np.round(losses, 6))) == STEPS  # the teacher moved: the losses are not one value
    for name, value in reference_params.items():
        torch.testing.assert_close(params[name], value, atol=1e-6, rtol=1e-5)
    if backend == "torchax":
        assert engine.traces["train_forward"] == 2, engine.traces


def _gan(seed: int = 0):
    """A generator (with batch norm) and a discriminator, as DeepSpeedExamples' GAN has them."""
    torch.manual_seed(seed)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh())
    discriminator = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LeakyReLU(0.2), torch.nn.Linear(8, 1),
                                        torch.nn.Sigmoid(), torch.nn.Flatten(0))
    return generator, discriminator


def test_a_script_that_calls_its_own_modules_trains_them_through_their_engines():
    """DeepSpeedExamples' GAN loop (``training/gan/gan_deepspeed_train.py``) calls the modules it
    gave ``initialize`` (``netD(real)``, ``netG(noise)``, ``netD.zero_grad()``) and backs the
    losses through the engines (``model_engineD.backward(err)``). The generator's loss goes back
    through the discriminator's engine too, and ``netD.zero_grad()`` drops those gradients before
    the discriminator's next step, as in plain torch at stage 0 (``module_calls``). Without
    the routing the backward refused the host forward's loss; without ``zero_grad`` routed, the
    discriminator's second step took the generator's gradients too. Calls in eval mode or
    without grad stay on the host, and a copy of a module is a module of its own."""
    import copy

    criterion = torch.nn.BCELoss()
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(STEPS)]

    def run(engines: bool):
        netG, netD = _gan()
        optG, optD = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in (netG, netD))
        backward = {netD: lambda loss: loss.backward(), netG: lambda loss: loss.backward()}
        step = {netD: optD.step, netG: optG.step}
        if engines:
            cfg = {"train_batch_size": 16, "zero_optimization": {"stage": 0}}
            engine_d, *_ = spmdzero.initialize(model=netD, optimizer=optD, config=cfg)
            engine_g, *_ = spmdzero.initialize(model=netG, optimizer=optG, config=cfg)
            backward, step = {netD: engine_d.backward, netG: engine_g.backward}, {netD: engine_d.step, netG: engine_g.step}
        losses = []
        for real, noise in data:
            netD.zero_grad()
            err_real = criterion(netD(real), torch.ones(16))
            backward[netD](err_real)
            fake = netG(noise)
            err_fake = criterion(netD(fake.detach()), torch.zeros(16))
            backward[netD](err_fake)
            step[netD]()
            netG.zero_grad()
            err_g = criterion(netD(fake), torch.ones(16))
            backward[netG](err_g)
            step[netG]()
            losses.append([float(e.detach().cpu()) for e in (err_real, err_fake, err_g)])
        state = {n: t.detach().cpu().clone() for m in (netG, netD) for n, t in m.state_dict().items()}
        return losses, state, (netD, engine_d) if engines else None

    reference, reference_state, _ = run(engines=False)
    losses, state, (netD, engine_d) = run(engines=True)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    for name, value in reference_state.items():  # the generator's batch-norm statistics included
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=1e-5)
    assert engine_d.traces["train_forward"] <= 2 and engine_d.traces["forward"] <= 2, engine_d.traces
    netD.eval()
    assert type(netD(data[0][0])) is torch.Tensor  # on the host
    netD.train()
    with torch.no_grad():
        assert type(netD(data[0][0])) is torch.Tensor
    assert type(copy.deepcopy(netD)(data[0][0])) is torch.Tensor
    assert type(netD(data[0][0])) is not torch.Tensor  # the engine's output
    assert type(copy.deepcopy(netD)) is torch.nn.Sequential


class _MseNet(torch.nn.Module):
    """tiny_mlp returning its mean-squared loss (the module's loss, which backward knows)."""

    def __init__(self):
        super().__init__()
        self.body = tiny_mlp()

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.body(x), y)


def test_a_module_loss_written_in_place_trains_as_written():
    """``loss *= k`` or ``loss /= gas`` on the loss the module returned, then ``engine.backward``:
    the backward took the module's own loss, as if unwritten (the gradient k times too small; the
    HF Trainer scales its loss so in place). DeepSpeed's autograd sees the write."""
    (x, y), = batches(1, 16)
    norms = {}
    for how in ("as returned", "loss *= 2", "loss * 2", "loss /= 4"):
        engine, *_ = spmdzero.initialize(model=_MseNet(), config={
            "train_batch_size": 16, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "spmd": {"backend": "torchax"}})
        loss = engine(x, y)
        if how == "loss *= 2":
            loss *= 2
        elif how == "loss * 2":
            loss = loss * 2
        elif how == "loss /= 4":
            loss /= 4
        engine.backward(loss)
        engine.step()
        norms[how] = engine.get_global_grad_norm()
    assert norms["loss *= 2"] == pytest.approx(2 * norms["as returned"], rel=1e-5)
    assert norms["loss *= 2"] == pytest.approx(norms["loss * 2"], rel=1e-6)
    assert norms["loss /= 4"] == pytest.approx(norms["as returned"] / 4, rel=1e-5)
