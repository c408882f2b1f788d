"""The run config: one TOML file naming the model, the data, the optimizer, the schedule and
the parallelism of a training run (a TOML file, or a name shipped in ``megacpp/configs/runs/``).

Tables and their keys (defaults in the dataclasses below; unknown keys are errors)::

    [run]         name, out_dir, seed, device, check_site_integrity, plots, cpu_threads,
                  loggers (["jsonl"] + "tensorboard" / "wandb": megacpp.train.loggers)
    [model]       preset = "tiny" plus any model-config key to override
                  (d_model = 64, [model.attention] n_heads = 2, vocab_size = "dataset")
    [data]        dir, num_workers, val_batches, shuffle
    [train]       steps, micro_batch_size, grad_accum_steps, global_batch_size, max_grad_norm,
                  eval_every, dtype, init_from, freeze, time_budget_s, eval_every_s
    [optim]       lr, weight_decay, beta1, beta2, eps, muon, muon_momentum, muon_nesterov,
                  muon_ns_steps
    [schedule]    kind, warmup_steps, min_lr_ratio, decay_fraction
    [parallel]    strategy, backend, activation_checkpointing, compile, cuda_graph, kernels,
                  grad_sync, reduce_dtype, bucket_mb, reshard_after_forward, timeout_s,
                  float8, float8_min_dim, float8_fsdp_all_gather
    [checkpoint]  every, keep_last, final
    [guards]      spike_zscore, spike_warmup_steps, spike_ema
    [debug]       nan_step, nan_target, checkpoint_stall_step
    [lora]        r, alpha, dropout, targets          (LoRA adapters through peft; r = 0: off)
    [contract], [preflight]   read by megacpp.contract (package list, rules to skip)

``--set key=value`` overrides (``train.steps=10``, ``model.attention.n_heads=2``) are applied
to the parsed TOML before validation; the value is read as a TOML literal, else as a string.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megacpp import configs
from megacpp._config import build_section, check, choice, parse_toml
from megacpp._io import CONFIG_LIMIT, read_text_bounded
from megacpp.contract.config import ContractConfig, config_from_dict
from megacpp.errors import ConfigError
from megacpp.model.config import ModelConfig, load_config
from megacpp.train.loggers import check_loggers

VOCAB_FROM_DATASET = "dataset"


@dataclass(frozen=True)
class RunSection:
    name: str = ""  # default: the config file's stem
    out_dir: str = ""  # default: runs/<name>; relative paths are relative to the CWD
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    check_site_integrity: bool = True  # preflight hashes the contract packages' files
    plots: bool = True  # write loss/throughput PNGs when the run ends
    cpu_threads: int = 0  # torch intra-op threads; 0 = torch's default (one per core)
    loggers: tuple[str, ...] = ("jsonl",)  # + "tensorboard", "wandb" (optional extras)

    def validate(self) -> None:
        choice("run.device", self.device, ("auto", "cpu", "cuda"))
        check_loggers(self.loggers)
        check(self.seed >= 0, "run.seed", self.seed, "an integer >= 0")
        check(self.cpu_threads >= 0, "run.cpu_threads", self.cpu_threads, "an integer >= 0")


@dataclass(frozen=True)
class DataSection:
    dir: str = ""  # a `megacpp data build` output directory
    num_workers: int = 0
    val_batches: int = 8  # validation batches per evaluation (0 = the whole split)
    shuffle: bool = True

    def validate(self) -> None:
        check(bool(self.dir), "data.dir", self.dir, "the directory of a `megacpp data build`")
        check(self.num_workers >= 0, "data.num_workers", self.num_workers, "an integer >= 0")
        check(self.val_batches >= 0, "data.val_batches", self.val_batches, "an integer >= 0")


@dataclass(frozen=True)
class TrainSection:
    steps: int = 0  # optimizer steps
    micro_batch_size: int = 8  # rows per rank per micro-step
    grad_accum_steps: int = 1
    # rows per optimizer step over all ranks; 0 = micro_batch_size x grad_accum_steps x ranks.
    # Set, it fixes the step whatever the number of ranks: grad_accum_steps is then derived
    # (global / (micro_batch_size x ranks)), so a run resumes on another world size unchanged
    global_batch_size: int = 0
    max_grad_norm: float = 1.0  # 0 = no clipping (the norm is still measured)
    eval_every: int = 100  # 0 = only at the end
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU | fp32 | bf16
    # a run dir, checkpoint dir or `megacpp export hf` dir whose weights start this run (not its
    # optimizer or data position)
    init_from: str = ""
    freeze: tuple[str, ...] = ()  # parameter name prefixes or globs ("embed", "blocks.0.*")
    # > 0: the run ends when its clock (seconds since the process started, less validation
    # and checkpoint time) reaches this; ``steps`` is then a cap and the schedule follows the
    # clock (trainer.RunClock, schedule.lr_factor_by_progress)
    time_budget_s: float = 0.0
    eval_every_s: float = 0.0  # > 0: also validate each time the clock passes a multiple

    def validate(self) -> None:
        check(self.steps >= 1, "train.steps", self.steps, "an integer >= 1")
        check(self.micro_batch_size >= 1, "train.micro_batch_size", self.micro_batch_size,
               "an integer >= 1")
        check(self.grad_accum_steps >= 1, "train.grad_accum_steps", self.grad_accum_steps,
               "an integer >= 1")
        check(self.global_batch_size >= 0, "train.global_batch_size", self.global_batch_size,
              "an integer >= 0 (0 = micro_batch_size x grad_accum_steps x ranks)")
        check(not (self.global_batch_size and self.grad_accum_steps != 1),
              "train.grad_accum_steps", self.grad_accum_steps,
              "1 (the default) when train.global_batch_size is set: it is derived from it")
        check(self.max_grad_norm >= 0, "train.max_grad_norm", self.max_grad_norm, ">= 0")
        check(self.eval_every >= 0, "train.eval_every", self.eval_every, "an integer >= 0")
        choice("train.dtype", self.dtype, ("auto", "fp32", "bf16"))
        check(all(self.freeze), "train.freeze", list(self.freeze),
              "non-empty parameter name prefixes or globs")
        check(self.time_budget_s >= 0, "train.time_budget_s", self.time_budget_s,
              "seconds >= 0 (0 = no time budget)")
        check(self.eval_every_s >= 0, "train.eval_every_s", self.eval_every_s,
              "seconds >= 0 (0 = off)")

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per rank per step on ``world_size`` ranks: ``grad_accum_steps``, or
        what ``global_batch_size`` implies (a ConfigError when it does not divide)."""
        total, micro = self.global_batch_size, self.micro_batch_size
        if not total:
            return self.grad_accum_steps
        if total % world_size:
            lower = total - total % world_size
            raise ConfigError(
                f"train.global_batch_size = {total} rows does not divide over the {world_size} "
                f"processes of this run; use a multiple of {world_size} (e.g. "
                f"{lower or world_size}) or launch a number of processes that divides {total}")
        per_rank = total // world_size
        if per_rank % micro:
            raise ConfigError(
                f"train.global_batch_size = {total} gives {per_rank} rows per process on "
                f"{world_size}, not a multiple of train.micro_batch_size = {micro}; set "
                f"micro_batch_size to a divisor of {per_rank}")
        return per_rank // micro


@dataclass(frozen=True)
class OptimSection:
    lr: float = 3e-3  # peak learning rate, shared by AdamW and (RMS-matched) Muon
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    muon: bool = True  # False: AdamW for every parameter
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5

    def validate(self) -> None:
        check(self.lr > 0, "optim.lr", self.lr, "a number > 0")
        check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, ">= 0")
        for name in ("beta1", "beta2", "muon_momentum"):
            value = getattr(self, name)
            check(0 <= value < 1, f"optim.{name}", value, "a number in [0, 1)")
        check(self.eps > 0, "optim.eps", self.eps, "a number > 0")
        check(self.muon_ns_steps >= 1, "optim.muon_ns_steps", self.muon_ns_steps,
               "an integer >= 1")


@dataclass(frozen=True)
class ScheduleSection:
    kind: str = "cosine"  # cosine | wsd | constant (each after a linear warmup)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # the final lr as a fraction of optim.lr (cosine, wsd)
    decay_fraction: float = 0.2  # wsd: the share of steps spent decaying at the end

    def validate(self) -> None:
        choice("schedule.kind", self.kind, ("cosine", "wsd", "constant"))
        check(self.warmup_steps >= 0, "schedule.warmup_steps", self.warmup_steps, ">= 0")
        check(0 <= self.min_lr_ratio <= 1, "schedule.min_lr_ratio", self.min_lr_ratio,
               "a number in [0, 1]")
        check(0 < self.decay_fraction <= 1, "schedule.decay_fraction", self.decay_fraction,
               "a number in (0, 1]")


AUTO = "auto"
KERNEL_CHOICES = ("default", "reference", "auto", "fast")


@dataclass(frozen=True)
class ParallelSection:
    """How the step runs. ``compile`` and ``cuda_graph`` take true, false or "auto" (on where
    valid: on CUDA; off on CPU); ``kernels`` = "default" is the catalog's chosen backends on
    CUDA and the references on CPU (:mod:`megacpp.train.modes` decides and says why)."""

    strategy: str = "auto"  # auto (ddp when launched with >1 process) | single | ddp | fsdp
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU | nccl | gloo
    activation_checkpointing: str = ""  # block letters to recompute in backward, e.g. "ME"
    compile: bool | str = AUTO  # torch.compile each block (regional compilation)
    cuda_graph: bool | str = AUTO  # capture the step as CUDA graphs
    kernels: str = "default"  # default | reference | auto | fast (MEGACPP_KERNELS overrides)
    # DDP's gradient all-reduce: "flat" = a flat gradient buffer summed in buckets during
    # backward (capturable), "ddp" = torch's DistributedDataParallel (bucketed, overlapped);
    # auto: flat when the step is graphed, else ddp
    grad_sync: str = AUTO
    reduce_dtype: str = "fp32"  # the dtype gradients are summed in across ranks: fp32 | bf16
    bucket_mb: float = 25.0  # DDP: MiB of gradients per all-reduce (flat buckets, DDP's cap)
    reshard_after_forward: bool = True  # FSDP2: free each block's gathered weights after forward
    timeout_s: int = 600  # a collective waiting longer than this fails the run
    # FP8 GEMMs for the linear layers (torchao float8 training; CUDA sm_89+, rowwise sm_90+):
    # off | tensorwise | rowwise (megacpp.train.float8 says what converts)
    float8: str = "off"
    float8_min_dim: int = 256  # linear layers with an in or out dim under this stay bf16
    # FSDP2 all-gathers the float8 layers' weights in float8 (tensorwise only; off: bf16/fp32)
    float8_fsdp_all_gather: bool = False

    def validate(self) -> None:
        choice("parallel.strategy", self.strategy, ("auto", "single", "ddp", "fsdp"))
        choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))
        bad = sorted(set(self.activation_checkpointing) - set("AEMRD"))
        check(not bad, "parallel.activation_checkpointing", self.activation_checkpointing,
               "block letters from A E M R D (e.g. \"ME\"), or \"\" for none")
        for name in ("compile", "cuda_graph"):
            value = getattr(self, name)
            check(isinstance(value, bool) or value == AUTO, f"parallel.{name}", value,
                  "true | false | \"auto\"")
        choice("parallel.kernels", self.kernels, KERNEL_CHOICES)
        choice("parallel.grad_sync", self.grad_sync, (AUTO, "flat", "ddp"))
        choice("parallel.reduce_dtype", self.reduce_dtype, ("fp32", "bf16"))
        check(self.timeout_s >= 1, "parallel.timeout_s", self.timeout_s, "an integer >= 1")
        check(self.bucket_mb > 0, "parallel.bucket_mb", self.bucket_mb, "a number > 0")
        choice("parallel.float8", self.float8, ("off", "tensorwise", "rowwise"))
        check(self.float8_min_dim >= 16, "parallel.float8_min_dim", self.float8_min_dim,
              "an integer >= 16")
        check(not self.float8_fsdp_all_gather
              or (self.float8 == "tensorwise" and self.strategy == "fsdp"),
              "parallel.float8_fsdp_all_gather", self.float8_fsdp_all_gather,
              "false unless parallel.float8 = \"tensorwise\" and parallel.strategy = \"fsdp\" "
              "(it changes FSDP2's all-gather; row-wise weight scales span the sharded dim)")


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 100  # steps between checkpoints; 0 = only at the end
    keep_last: int = 3
    final: bool = True  # write one at the end of the run (benchmarks turn it off)

    def validate(self) -> None:
        check(self.every >= 0, "checkpoint.every", self.every, "an integer >= 0")
        check(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "an integer >= 1")


@dataclass(frozen=True)
class GuardSection:
    spike_zscore: float = 6.0  # warn when loss > ema + zscore * ema_std
    spike_warmup_steps: int = 20  # no spike warnings before this many steps
    spike_ema: float = 0.95  # EMA decay of the loss mean and variance

    def validate(self) -> None:
        check(self.spike_zscore > 0, "guards.spike_zscore", self.spike_zscore, "> 0")
        check(self.spike_warmup_steps >= 0, "guards.spike_warmup_steps",
               self.spike_warmup_steps, ">= 0")
        check(0 < self.spike_ema < 1, "guards.spike_ema", self.spike_ema, "in (0, 1)")


@dataclass(frozen=True)
class DebugSection:
    """Fault injection, so the guards and crash recovery can be exercised for real."""

    nan_step: int = 0  # 0 = off; else poison ``nan_target`` at this step
    nan_target: str = ""  # "loss", or a parameter name whose gradient becomes NaN
    # 0 = off; else the checkpoint of this step stalls (up to 10 minutes) after its files are
    # written and before its marker -- a window to kill the process mid-write
    checkpoint_stall_step: int = 0

    def validate(self) -> None:
        check(self.nan_step >= 0, "debug.nan_step", self.nan_step, "an integer >= 0")
        check(self.nan_step == 0 or bool(self.nan_target), "debug.nan_target",
               self.nan_target, "\"loss\" or a parameter name when debug.nan_step is set")
        check(self.checkpoint_stall_step >= 0, "debug.checkpoint_stall_step",
               self.checkpoint_stall_step, "an integer >= 0")


@dataclass(frozen=True)
class LoraSection:
    """LoRA adapters (through peft) on the model's linear layers; ``r = 0`` turns LoRA off."""

    r: int = 0  # adapter rank
    alpha: float = 16.0  # the adapters' output is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapters' input
    # module name patterns (a name component such as "q_proj", or a dotted name / glob such as
    # "blocks.0.*"); empty: every linear layer LoRA supports
    targets: tuple[str, ...] = ()

    def validate(self) -> None:
        check(self.r >= 0, "lora.r", self.r, "an integer >= 0 (0 turns LoRA off)")
        check(self.alpha > 0, "lora.alpha", self.alpha, "a number > 0")
        check(0 <= self.dropout < 1, "lora.dropout", self.dropout, "a number in [0, 1)")
        check(all(self.targets), "lora.targets", list(self.targets),
              "non-empty module name patterns")


_SECTIONS: dict[str, type] = {
    "run": RunSection, "data": DataSection, "train": TrainSection, "optim": OptimSection,
    "schedule": ScheduleSection, "parallel": ParallelSection, "checkpoint": CheckpointSection,
    "guards": GuardSection, "debug": DebugSection, "lora": LoraSection,
}  # fmt: skip
_CONTRACT_TABLES = ("contract", "preflight")


@dataclass(frozen=True)
class RunConfig:
    """A validated run config. Build with :func:`load_run_config` or :meth:`from_dict`."""

    model_preset: str
    model_overrides: dict[str, Any]
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    guards: GuardSection = field(default_factory=GuardSection)
    debug: DebugSection = field(default_factory=DebugSection)
    lora: LoraSection = field(default_factory=LoraSection)
    contract_tables: dict[str, Any] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()  # the --set arguments, as given

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], *, name: str = "run",
                  overrides: tuple[str, ...] = ()) -> RunConfig:
        """Validate a parsed config (after overrides); every error names the key."""
        allowed = sorted({"model", *_SECTIONS, *_CONTRACT_TABLES})
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown table(s) {unknown} in the run config; allowed: {allowed}")
        model = _table(data, "model")
        if not isinstance(model.get("preset"), str) or not model["preset"]:
            raise ConfigError("model.preset is required: a preset name (tiny, nam56r-small, ...) "
                              "or a path to a model .toml")
        sections = {key: _build_section(cls_, _table(data, key), key)
                    for key, cls_ in _SECTIONS.items()}
        run = sections["run"]
        if not run.name:
            sections["run"] = run = dataclasses.replace(run, name=name)
        if not run.out_dir:
            sections["run"] = dataclasses.replace(run, out_dir=str(Path("runs") / run.name))
        contract = {key: data[key] for key in _CONTRACT_TABLES if key in data}
        config_from_dict(contract, source="the run config")  # validates [contract]/[preflight]
        cfg = cls(model_preset=model["preset"],
                  model_overrides={k: v for k, v in model.items() if k != "preset"},
                  contract_tables=contract, overrides=tuple(overrides), **sections)
        cfg.model_config(vocab_size=1 << 16)  # validates the model overrides now
        return cfg

    # -- derived --------------------------------------------------------------------------------
    @property
    def out_dir(self) -> Path:
        return Path(self.run.out_dir)

    @property
    def data_dir(self) -> Path:
        return Path(self.data.dir)

    @property
    def contract(self) -> ContractConfig:
        return config_from_dict(self.contract_tables, source="the run config")

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The preset with this config's overrides; ``vocab_size`` fills ``"dataset"``."""
        base = load_config(self.model_preset).to_dict()
        overrides = copy.deepcopy(self.model_overrides)
        if overrides.get("vocab_size") == VOCAB_FROM_DATASET:
            if vocab_size is None:
                raise ConfigError("model.vocab_size = \"dataset\" needs the dataset's tokenizer")
            overrides["vocab_size"] = vocab_size
        for key, value in overrides.items():
            if isinstance(value, dict):
                if not isinstance(base.get(key), dict):
                    raise ConfigError(f"[model.{key}] is not a model config table; tables: "
                                      f"{sorted(k for k in base if k != 'model')}")
                base[key].update(value)
            else:
                base["model"][key] = value
        try:
            return ModelConfig.from_dict(base)
        except ConfigError as exc:
            raise ConfigError(f"[model] (preset {self.model_preset!r} + overrides): {exc}") from None

    def to_dict(self, model: ModelConfig | None = None) -> dict[str, Any]:
        """Plain data (TOML/JSON). With ``model``, the [model] table is fully resolved, so the
        config reproduces the run even if the preset file changes later."""
        out: dict[str, Any] = {"model": {"preset": self.model_preset}}
        if model is None:
            out["model"].update(copy.deepcopy(self.model_overrides))
        else:
            resolved = model.to_dict()
            out["model"].update(resolved.pop("model"))
            out["model"].update(resolved)
        for key in _SECTIONS:
            out[key] = dataclasses.asdict(getattr(self, key))
        out.update(copy.deepcopy(self.contract_tables))
        return out


def load_run_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a run config TOML (a path, or a name shipped in ``megacpp/configs/runs/``) and
    apply ``key=value`` overrides."""
    text, source, stem = _read_run_config(path)
    data = parse_toml(text, source)
    for item in overrides:
        apply_override(data, item)
    try:
        return RunConfig.from_dict(data, name=stem, overrides=tuple(overrides))
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``dotted.key=value`` to a parsed config, in place."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: expected TABLE.KEY=VALUE, e.g. train.steps=100")
    table = data
    for part in parts[:-1]:
        child = table.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is a value, not a table")
        table = child
    table[parts[-1]] = parse_value(text.strip())


def parse_value(text: str) -> Any:
    """A TOML literal (``10``, ``3e-4``, ``true``, ``"x"``, ``[1, 2]``), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError, ValueError):
        return text


def to_toml(data: dict[str, Any], header: str = "") -> str:
    """Emit plain config data (tables of scalars, lists and sub-tables) as TOML."""
    lines = [f"# {line}" for line in header.splitlines()]
    _emit_table(data, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _emit_table(table: dict[str, Any], path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    if path and (scalars or not table):
        lines.append("")
        lines.append(f"[{'.'.join(path)}]")
    for key, value in scalars.items():
        lines.append(f"{key} = {_toml_value(value)}")
    for key, value in table.items():
        if isinstance(value, dict):
            _emit_table(value, [*path, key], lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value} to TOML")
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


# -- helpers ------------------------------------------------------------------------------------
def _read_run_config(name_or_path: str | Path) -> tuple[str, str, str]:
    """``(TOML text, where it came from, run name)`` of a path or a shipped run config."""
    if configs.is_path(name_or_path):
        path = Path(name_or_path)
        text = read_text_bounded(path, CONFIG_LIMIT, what="run config", error=ConfigError)
        return text, str(path), path.stem
    text = configs.shipped("run", name_or_path)
    if text is None:
        known = ", ".join(configs.names("run"))
        raise ConfigError(f"run config {str(name_or_path)!r} not found (a .toml path, or one "
                          f"of: {known})")
    return text, f"run config {name_or_path}", str(name_or_path)


def _table(data: dict[str, Any], key: str) -> dict[str, Any]:
    table = data.get(key, {})
    if not isinstance(table, dict):
        raise ConfigError(f"[{key}] must be a table, got {type(table).__name__}")
    return table


def _build_section(cls: type, table: dict[str, Any], name: str) -> Any:
    section = build_section(cls, table, name)
    section.validate()
    return section


