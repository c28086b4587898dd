"""A short LoRA fine-tune of a real megatron-core GPT, measured (shared by tests, demo, bench).

:func:`train_lora` runs on every rank of an initialised gloo/NCCL default group
and returns, per rank: the loss of each step, the LoRA gradients of the last
step, each adapter's decision, the bytes autograd retained at the end of the
first forward (total and the LoRA-A input part), the collective bytes of one
step by kind, and the step times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from regather.core.accounting import ADAPTER_INPUT, CollectiveBytes, SavedBytes
from regather.megatron.dense.model import adapters
from regather.megatron.lora import LoRA
from regather.megatron.reasons import ALL_TARGETS
from regather.tools.cpu.models import TinyGPT, batch_from_tokens, build_gpt, gpt_batch, gpt_loss


@dataclass
class RunConfig:
    strategy: str = "gather"
    tp: int = 2
    sequence_parallel: bool = True
    shape: TinyGPT = field(default_factory=TinyGPT)
    micro_batch: int = 2
    steps: int = 3
    lr: float = 1e-2
    dtype: str = "float32"
    lora_dim: int = 8
    lora_alpha: int = 16
    targets: tuple = ALL_TARGETS
    lora_B_init_method: str = "zero"
    seed: int = 1234
    warmup: int = 1  # steps excluded from the step-time median
    # the decoder's input requires grad although the embeddings are frozen (Megatron Bridge's
    # maybe_enable_recompute_inputs_grad, HF's enable_input_require_grads): layer 0's norm then
    # keeps its input, so layer 0's linear_qkv may recompute its adapter input too
    input_requires_grad: bool = False
    # a gated SwiGLU MLP (megatron's gated_linear_unit=True, silu), as Llama/Qwen have
    swiglu: bool = False
    # regather.CanonicalLoRA (one adapter per q, k, v, gate, up) instead of LoRA; needs swiglu
    canonical: bool = False
    # LoRA(lean_transients=...): None, each strategy's default (lean but for the classic gather path)
    lean_transients: bool | None = None
    # "dora": regather.DoRA instead of LoRA (recompute_dora_output: its pre-magnitude output rebuilt in backward)
    peft: str = "lora"
    recompute_dora_output: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# Variants a benchmark can put side by side: name -> (strategy, LoRA field overrides).
# The "-recompute" ones rebuild adapter inputs from what their producer keeps
# (regather.megatron.dense.producers): qkv/fc1 under regather and lowrank, fc2 under every strategy, so
# on gather only fc2 recomputes.
VARIANTS = {
    "regather-plain": ("regather", {"early_regather": False}),
    # regather with the classic output path (LoRA's full-width output, scale and sum, docs/design.md §3.7):
    # what lean_transients changed, timed in the same run
    "regather-classic": ("regather", {"lean_transients": False}),
    "gather-lean": ("gather", {"lean_transients": True}),
    "regather-recompute": ("regather", {"recompute_adapter_inputs": True}),
    "lowrank-recompute": ("lowrank", {"recompute_adapter_inputs": True}),
    "gather-recompute": ("gather", {"recompute_adapter_inputs": True}),
}


def lean_output(name: str) -> bool:
    """Whether variant ``name`` runs the lean output path (``lean_transients``: as the variant sets it, else
    ``LoRA``'s default, lean for every strategy but gather; docs/design.md §3.7)."""
    strategy, overrides = VARIANTS.get(name, (name, {}))
    return overrides.get("lean_transients", strategy != "gather")


def base_strategy(name: str) -> str:
    """The strategy a variant runs (``regather-recompute`` -> ``regather``); a strategy itself."""
    return VARIANTS.get(name, (name, {}))[0]


def _lora_fields() -> set:
    import dataclasses

    return {f.name for f in dataclasses.fields(LoRA)}


def lora_for(cfg: RunConfig) -> LoRA:
    from regather.core.strategies import Strategy

    name, overrides = VARIANTS.get(cfg.strategy, (cfg.strategy, {}))
    strategy = Strategy.parse(name)
    lean = {} if cfg.lean_transients is None else {"lean_transients": cfg.lean_transients}
    if lean and "lean_transients" in overrides and overrides["lean_transients"] != cfg.lean_transients:
        raise ValueError(f"RunConfig(strategy={cfg.strategy!r}, lean_transients={cfg.lean_transients!r}): the variant "
                         f"sets lean_transients={overrides['lean_transients']!r}")
    kwargs = dict(
        target_modules=list(cfg.targets),
        dim=cfg.lora_dim,
        alpha=cfg.lora_alpha,
        lora_B_init_method=cfg.lora_B_init_method,
        **{**lean, **overrides},
    )
    cls = LoRA
    if cfg.canonical:
        from regather.megatron.canonical import CanonicalLoRA as cls
    if cfg.peft == "dora":
        from regather.megatron.dora import DoRA as cls

        kwargs["recompute_dora_output"] = cfg.recompute_dora_output
    if strategy in (Strategy.GATHER, Strategy.REGATHER):
        return cls(sequence_parallel_input_regather=strategy == Strategy.REGATHER, **kwargs)
    return lora_asking(strategy, kwargs, cls)


_STRATEGY_FIELDS = ("strategy", "sequence_parallel_input_strategy", "input_strategy")


def _strategy_field() -> str | None:
    fields = _lora_fields()
    return next((name for name in _STRATEGY_FIELDS if name in fields), None)


def requestable_strategies(variants: bool = True) -> list[str]:
    """Strategies a ``LoRA`` config of this build can ask for (gather first), and with
    ``variants`` the :data:`VARIANTS` whose options it has (e.g. ``regather-plain``)."""
    from regather.core.strategies import Strategy

    names = ["gather", "regather"]
    if _strategy_field() is not None:
        names += [s.value for s in Strategy if s.value not in names]
    if variants:
        fields = _lora_fields()
        names += [v for v, (base, opts) in VARIANTS.items() if base in names and set(opts) <= fields]
    return names


def lora_asking(strategy, kwargs, cls=LoRA) -> LoRA:
    """A LoRA config asking for ``strategy`` through the field this build has for it: one other than
    gather/regather (e.g. lowrank), which ``sequence_parallel_input_regather`` cannot ask for."""
    name = _strategy_field()
    if name is None:
        raise ValueError(f"LoRA has no field to ask for strategy {strategy.value!r}")
    return cls(**{name: strategy.value}, **kwargs)


def model_overrides(cfg: RunConfig) -> dict:
    """The ``TransformerConfig`` fields :func:`build_lora_gpt` sets beyond the shape."""
    if not cfg.swiglu:
        return {}
    import torch.nn.functional as F

    return {"gated_linear_unit": True, "activation_func": F.silu}


def build_lora_gpt(cfg: RunConfig, device: torch.device | None = None):
    model = build_gpt(cfg.shape, cfg.tp, cfg.sequence_parallel, cfg.torch_dtype, seed=cfg.seed,
                      **model_overrides(cfg))
    if device is not None and torch.device(device).type != "cpu":
        model = model.to(device)
    torch.manual_seed(cfg.seed + 1)  # adapter init: same on every rank and every TP size
    model = lora_for(cfg)(model, training=True)
    if cfg.input_requires_grad:
        require_decoder_input_grad(model)
    return model


def require_decoder_input_grad(model: torch.nn.Module) -> None:
    """Make the decoder's ``hidden_states`` require grad, as Megatron Bridge's
    ``maybe_enable_recompute_inputs_grad`` does (``detach().requires_grad_(True)`` before
    ``TransformerBlock.forward``; Bridge applies it only when activation recompute is on)."""

    def hook(module, args, kwargs):
        if args:
            h = args[0]
            if torch.is_tensor(h) and not h.requires_grad and h.is_floating_point():
                return (h.detach().requires_grad_(True),) + tuple(args[1:]), kwargs
            return None
        h = kwargs.get("hidden_states")
        if torch.is_tensor(h) and not h.requires_grad and h.is_floating_point():
            return args, {**kwargs, "hidden_states": h.detach().requires_grad_(True)}
        return None

    model.decoder.register_forward_pre_hook(hook, with_kwargs=True)


def token_batches(cfg: RunConfig, tokens: torch.Tensor | None = None):
    """Step ``i``'s batch: consecutive windows of ``tokens`` (or random tokens)."""
    s, b = cfg.shape.seq, cfg.micro_batch
    for step in range(cfg.steps):
        if tokens is None:
            yield gpt_batch(cfg.shape, b, seed=step)
            continue
        starts = [((step * b + j) * s) % (len(tokens) - s - 1) for j in range(b)]
        yield batch_from_tokens(torch.stack([tokens[i : i + s + 1] for i in starts]).long())


def train_lora(rank: int, world_size: int, cfg: RunConfig, tokens: torch.Tensor | None = None,
               collect_grads: bool = True) -> dict:
    model = build_lora_gpt(cfg)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.Adam(named.values(), lr=cfg.lr)
    out = {"loss": [], "step_time": [], "rank": rank}
    for step, batch in enumerate(token_batches(cfg, tokens)):
        opt.zero_grad(set_to_none=True)
        measure = step == 0
        t0 = time.perf_counter()
        if measure:
            with CollectiveBytes() as comm, SavedBytes.for_model(model) as saved:
                loss = gpt_loss(model, batch)
                comm_fwd = comm.snapshot()
                loss.backward()
            out["saved_bytes"] = saved.total
            out["saved_adapter_input_bytes"] = saved.of(ADAPTER_INPUT)
            out["comm_bytes"] = comm.snapshot()
            out["comm_bytes_forward"] = comm_fwd
        else:
            loss = gpt_loss(model, batch)
            loss.backward()
        opt.step()
        out["step_time"].append(time.perf_counter() - t0)
        out["loss"].append(loss.item())
        if collect_grads and step == cfg.steps - 1:
            out["grads"] = {n: p.grad.detach().clone() for n, p in named.items()}
    out["decisions"] = {path: str(a.last_decision) for path, a in adapters(model).items()}
    times = out["step_time"][cfg.warmup:] or out["step_time"]
    out["median_step_time"] = statistics.median(times)
    out["config"] = asdict(cfg)
    return out


class AdapterSavedBytes(SavedBytes):
    """:class:`~regather.core.accounting.SavedBytes` of a model that also attributes the LoRA-A input
    bytes (label ``adapter_input:*``) to the adapter saving them, by path: a new storage
    counted while an adapter's forward runs belongs to that adapter. A recomputing adapter
    saves a storage its producer saved first, so it is counted 0."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(exclude=list(model.parameters()) + list(model.buffers()))
        self._current: str | None = None
        self.by_adapter: dict[str, int] = {}
        self._handles = []
        for path, adapter in adapters(model).items():
            self.by_adapter[path] = 0
            self._handles.append(adapter.register_forward_pre_hook(lambda m, a, _p=path: self._enter(_p)))
            self._handles.append(adapter.register_forward_hook(lambda m, a, o: self._enter(None)))

    def _enter(self, path: str | None) -> None:
        self._current = path

    def counted(self, name: str, nbytes: int) -> None:
        if self._current is not None and name.startswith(ADAPTER_INPUT):
            self.by_adapter[self._current] += nbytes

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _time_recomputes(model: torch.nn.Module) -> list | None:
    """Wrap each adapter producer's ``recompute`` (the op rerun in backward, and once in the
    first forward to verify it) with a clock; returns the one-element accumulator, or None
    when no adapter has a producer. The wrapper only adds ``perf_counter`` calls."""
    clock = [0.0]
    found = False
    for adapter in adapters(model).values():
        producer = getattr(adapter, "producer", None)
        if producer is None:
            continue
        found = True
        inner = producer.recompute

        def timed(*args, _inner=inner):
            t0 = time.perf_counter()
            try:
                return _inner(*args)
            finally:
                clock[0] += time.perf_counter() - t0

        producer.recompute = timed
    return clock if found else None


def recompute_clock(runs: list[dict], steps: int, warmup: int) -> dict:
    """Seconds per step spent in the producers' recomputes (``runs``: one strategy's result on every
    rank; slowest rank per step) and their median share of the step, for a run whose adapters have
    producers (empty otherwise)."""
    if not all("recompute_time" in r for r in runs):
        return {}
    spent = [max(r["recompute_time"][i] for r in runs) for i in range(steps)]
    step = [max(r["step_time"][i] for r in runs) for i in range(steps)]
    timed = list(zip(spent, step))[warmup:] or list(zip(spent, step))
    return {"recompute_times": spent,
            "median_recompute_time": statistics.median(a for a, _ in timed),
            "recompute_share_of_step": statistics.median(a / b for a, b in timed)}


# -- several strategies in one process group ---------------------------------------


def _to(batch, device):
    if device is None or torch.device(device).type == "cpu":
        return batch
    return tuple(t.to(device) for t in batch)


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


#: Steps measured for the allocator's bytes after training (the smallest count is reported: a stray
#: allocation under load can only add).
PEAK_STEPS = 2


def frozen_gpt(cfg: RunConfig, device: torch.device | None = None):
    """The same GPT with every weight frozen and no LoRA; its decoder input requires grad so that its
    backward runs through every layer, as a LoRA model's does (the baseline of "over the frozen model")."""
    model = build_gpt(cfg.shape, cfg.tp, cfg.sequence_parallel, cfg.torch_dtype, seed=cfg.seed,
                      init_parallel=False, **model_overrides(cfg))
    if device is not None and torch.device(device).type != "cpu":
        model = model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    require_decoder_input_grad(model)
    return model


def step_bytes(model: torch.nn.Module, batch, steps: int = PEAK_STEPS) -> dict:
    """The allocator's bytes of one forward + backward (no optimizer step): ``kept`` = allocated in the
    forward and alive at its end, ``peak`` = the most alive at once over the step, both over what was
    alive before it; every collective settled (:class:`regather.core.allocated.AllocatedBytes`), the
    smallest of ``steps`` steps. Gradients are left as they were (``.grad`` of LoRA weights reset)."""
    from regather.core.allocated import AllocatedBytes

    counts = []
    trainable = [p for p in model.parameters() if p.requires_grad]
    for _ in range(steps):
        for p in trainable:
            p.grad = None
        with AllocatedBytes(settle_each_collective=True) as a:
            loss = gpt_loss(model, batch)
            a.mark("forward")
            loss.backward()
            del loss
        counts.append((a.alive_at("forward"), a.peak))
    for p in trainable:
        p.grad = None
    return {"kept": min(c[0] for c in counts), "peak": min(c[1] for c in counts)}


def compare_strategies(
    rank: int,
    world_size: int,
    cfg: RunConfig,
    strategies: Sequence[str],
    tokens: torch.Tensor | None = None,
    device: torch.device | None = None,
    progress: Callable[[str, int, float], None] | None = None,
    peak: bool = False,
) -> dict:
    """Train one model per strategy side by side; return ``{strategy: result}``.

    Every model starts from the same weights (``cfg.seed``) and sees the same
    batches. Step ``i`` runs each strategy once, in an order rotated by ``i``,
    each step starting after a barrier (not counted as communication). Step 0
    is measured: retained bytes at the end of forward and collective bytes of
    forward + backward. Each result has the keys of :func:`train_lora` (times of
    steps ``>= cfg.warmup`` enter the median). ``progress(strategy, step,
    seconds)`` is called after each step (rank 0 passes a printer). With ``peak``, after training each
    model's allocator bytes (:func:`step_bytes`, and ``lora_grad_bytes``: its LoRA weights' gradients, which
    the measured backward makes) under ``"allocated"``, and the frozen model's
    (:func:`frozen_gpt`) under ``out["frozen"]["allocated"]``, measured on the first batch.
    """
    import dataclasses

    import torch.distributed as dist

    models, opts, named = {}, {}, {}
    for name in strategies:
        models[name] = build_lora_gpt(dataclasses.replace(cfg, strategy=name), device)
        named[name] = {n: p for n, p in models[name].named_parameters() if p.requires_grad}
        opts[name] = torch.optim.Adam(named[name].values(), lr=cfg.lr)
    out = {name: {"loss": [], "step_time": [], "rank": rank} for name in strategies}
    clocks = {name: _time_recomputes(models[name]) for name in strategies}
    for step, batch in enumerate(token_batches(cfg, tokens)):
        batch = _to(batch, device)
        k = step % len(strategies)
        for name in list(strategies[k:]) + list(strategies[:k]):
            model, opt, res = models[name], opts[name], out[name]
            opt.zero_grad(set_to_none=True)
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            if step == 0:
                with CollectiveBytes() as comm, AdapterSavedBytes(model) as saved:
                    loss = gpt_loss(model, batch)
                    res["comm_bytes_forward"] = comm.snapshot()
                    loss.backward()
                res["saved_bytes"] = saved.total
                res["saved_adapter_input_bytes"] = saved.of(ADAPTER_INPUT)
                res["saved_bytes_by_label"] = saved.by_label()
                res["saved_adapter_input_bytes_by_adapter"] = dict(saved.by_adapter)
                res["comm_bytes"] = comm.snapshot()
                res["comm_calls"] = dict(comm.calls)
            else:
                loss = gpt_loss(model, batch)
                loss.backward()
            opt.step()
            _sync(device)
            dt = time.perf_counter() - t0
            res["step_time"].append(dt)
            if clocks[name] is not None:  # seconds this step spent rebuilding adapter inputs
                res.setdefault("recompute_time", []).append(clocks[name][0])
                clocks[name][0] = 0.0
            res["loss"].append(loss.item())
            if step == cfg.steps - 1:
                res["grads"] = {n: p.grad.detach().float().cpu().clone() for n, p in named[name].items()}
            if progress is not None:
                progress(name, step, dt)
    if peak:  # the same first batch for every model, after training (a first forward verifies recomputes)
        first = _to(next(iter(token_batches(cfg, tokens))), device)
        for name in strategies:
            out[name]["allocated"] = step_bytes(models[name], first)
            # the LoRA weights' gradients, made in the measured backward (part of its peak)
            out[name]["allocated"]["lora_grad_bytes"] = sum(p.numel() * p.element_size()
                                                            for p in named[name].values())
        out["frozen"] = {"allocated": step_bytes(frozen_gpt(cfg, device), first)}
    for name in strategies:
        res = out[name]
        res["decisions"] = {path: str(a.last_decision) for path, a in adapters(models[name]).items()}
        times = res["step_time"][cfg.warmup:] or res["step_time"]
        res["median_step_time"] = statistics.median(times)
        res["config"] = asdict(dataclasses.replace(cfg, strategy=name))
    return out


def aligned_grad(grad: torch.Tensor, ref: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """``grad`` in ``ref``'s layout: a weight one strategy replicates over TP and the other shards
    (lowrank's LoRA-A) is cut to this TP rank's shard."""
    if grad.shape == ref.shape:
        return grad
    for dim in range(grad.dim()):
        if grad.shape[dim] == ref.shape[dim] * tp:
            shard = grad.chunk(tp, dim=dim)[rank]
            if shard.shape == ref.shape:
                return shard
    raise ValueError(f"gradient shapes {tuple(grad.shape)} and {tuple(ref.shape)} do not correspond")


def grad_gap(grads: dict, ref: dict, rank: int, tp: int) -> tuple[float, float]:
    """Largest ``|grad - ref|`` over every LoRA gradient of this rank (:func:`aligned_grad`), and the
    largest ``|ref|``."""
    worst, scale = 0.0, 0.0
    for name, g in ref.items():
        other = aligned_grad(grads[name], g, rank, tp)
        worst = max(worst, (other.double() - g.double()).abs().max().item())
        scale = max(scale, g.double().abs().max().item())
    return worst, scale
