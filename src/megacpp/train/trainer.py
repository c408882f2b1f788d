"""The training loop: ``train(run_config) -> RunResult``.

One call runs (or resumes) a whole run: preflight, data, model, parallelism, AdamW + Muon,
the schedule, gradient accumulation and clipping, the guards, validation, checkpoints,
metrics, and the receipt -- written whether the run completes or fails.

The loss of a step is the token-mean cross-entropy over the *global* batch (every
micro-batch of every rank) plus the MoE auxiliary loss: each micro-batch's summed
cross-entropy is divided by the global count of target tokens, so one process and N
processes with the same global batch optimize the same objective.

How the step runs -- kernels, compile, CUDA graphs, DDP's gradient sync -- is decided once
(:mod:`megacpp.train.modes`: the fast path on CUDA by default) and logged with the reason.
With CUDA graphs the step's two device-only halves (forward + backward of the micro-batches
and the gradient reduction; clipping + optimizer + MoE bias update) are captured once and
replayed around the same eager guard (:mod:`megacpp.train.graphs`), in one process, under
DDP (a flat gradient buffer, its all-reduces captured) and under FSDP2.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch.distributed.tensor import DTensor

from megacpp._io import atomic_write_text
from megacpp.contract import (
    capture_fingerprint,
    require_preflight,
    run_preflight,
    with_numerics,
)
from megacpp.contract.devices import device_profile, profile_for_fingerprint
from megacpp.contract.preflight import PreflightError, PreflightReport, record_cache_routings
from megacpp.data.loader import IGNORE_INDEX, PackedLoader
from megacpp.data.shards import TOKENIZER_FILE, ShardedDataset
from megacpp.errors import ConfigError, MegaCppError, describe_error
from megacpp.kernels.runtime import chosen_kernels, kernel_mode_override
from megacpp.kernels.timing import GraphCaptureError
from megacpp.model.config import ModelConfig
from megacpp.model.counting import count_model
from megacpp.model.model import HybridLM
from megacpp.receipts import write_receipt
from megacpp.train.checkpoint import (
    MARKER,
    CheckpointManager,
    capture_rng_state,
    inference_files,
    restore_rng_state,
)
from megacpp.train.config import RunConfig, to_toml
from megacpp.train.finetune import FineTuning
from megacpp.train.float8 import Float8Report
from megacpp.train.graphs import WARMUP_STEPS, StepGraphs
from megacpp.train.guards import SpikeDetector, StepWatchdog, check_finite
from megacpp.train.loggers import ExperimentLoggers
from megacpp.train.metrics import (
    METRICS_FILE,
    MetricsLog,
    MfuMeter,
    PeakFlops,
    RunClock,
    TrainProgress,
    bf16_matmul_peak,
    bits_per_byte,
    peak_memory_bytes,
    target_bytes,
)
from megacpp.train.modes import ExecutionPlan, plan_execution
from megacpp.train.optim import Optimizers
from megacpp.train.parallelize import (
    DistEnv,
    FlatGradReducer,
    all_reduce_,
    base_model,
    broadcast_object,
    clean_name,
    gradient_sync,
    init_distributed,
    parallelize,
    shutdown_distributed,
)
from megacpp.train.schedule import lr_factor, lr_factor_by_progress

CONFIG_FILE = "config.toml"
RECEIPT_FILE = "receipt.json"
HISTORY_DIR = "history"

Record = dict[str, Any]


@dataclass
class PendingStep:
    """A step whose update is queued on the GPU: the figures read at its guard, and the
    device tensor (MoE balance) that its record still needs."""

    step: int
    loss: float
    aux_loss: float
    mtp_loss: float | None
    grad_norm: float
    lr: float
    balance: torch.Tensor | float | None  # a float once read
    started: float


@dataclass
class RunResult:
    """What a completed run produced."""

    run_dir: Path
    steps: int
    final_loss: float
    final_val_loss: float | None
    tokens: int
    tokens_per_s: float
    mfu: float | None
    checkpoint: Path
    receipt: Path
    resumed_from: Path | None
    final_val_bpb: float | None = None
    clock_s: float = 0.0  # the run's clock at the end (see metrics.RunClock)


class TrainingFailed(MegaCppError):
    """The run stopped; its receipt (``receipt``) records why."""

    def __init__(self, message: str, receipt: Path | None, exit_code: int | None = None) -> None:
        super().__init__(message + (f" (receipt: {receipt})" if receipt else ""),
                         exit_code=exit_code)
        self.receipt = receipt


def train(
    cfg: RunConfig,
    *,
    resume: str | None = None,
    fallback_to_previous: bool = False,
    skip_preflight: tuple[str, ...] | list[str] = (),
    on_record: Callable[[Record], None] | None = None,
    console: Console | None = None,
    show_progress: bool = True,
    clock_from_process_start: bool = False,
) -> RunResult:
    """Run (or, with ``resume="auto"`` or a checkpoint path, continue) a training run.

    ``on_record`` receives every metrics record (train steps and validations) on rank 0.
    ``clock_from_process_start``: the run's clock (time budgets, ``clock_s``) counts from the
    process's start, as ``megacpp train`` does, instead of from this call.
    Raises :class:`TrainingFailed` (or another :class:`MegaCppError`) when the run cannot
    start or stops; the run's receipt is written either way once the run directory is ours.
    A global batch the launched processes cannot split is refused before anything starts.
    """
    cfg.train.accumulation(int(os.environ.get("WORLD_SIZE", "1")))  # before any work
    owns_group = not torch.distributed.is_initialized()
    env = init_distributed(cfg.parallel, cfg.run.device)
    if cfg.run.cpu_threads:
        torch.set_num_threads(cfg.run.cpu_threads)
    failed, session = False, None
    try:
        session = _Session(cfg, env, console or Console(stderr=True), on_record, show_progress,
                           clock_from_process_start)
        with _sigterm_as_interrupt():
            return session.run(resume, fallback_to_previous, tuple(skip_preflight))
    except BaseException:
        failed = True
        raise
    finally:
        if session is not None and not failed:
            session.release_graphs()  # before the communicators go (StepGraphs.release)
        if owns_group and not (failed and env.distributed):
            # the session's model (DDP's reducer, FSDP2's state) and its pending collective
            # work are freed now, while the group and the interpreter are alive: a cycle left
            # for the interpreter's exit could free gloo work there, which aborts the process
            # ("terminate called without an active exception")
            session = None
            gc.collect()
            shutdown_distributed()  # (after a failure a peer may be gone: the process exits)


def on_main(env: DistEnv, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 and hand its result (or its MegaCppError) to every rank."""
    outcome: Any = None
    if env.is_main:
        try:
            outcome = fn()
        except MegaCppError as exc:
            outcome = exc
    outcome = broadcast_object(outcome)
    if isinstance(outcome, MegaCppError):
        raise outcome
    return outcome


class _Session:
    """The state of one invocation of :func:`train`."""

    def __init__(self, cfg: RunConfig, env: DistEnv, console: Console,
                 on_record: Callable[[Record], None] | None, show_progress: bool,
                 clock_from_process_start: bool = False) -> None:
        self.cfg, self.env, self.console = cfg, env, console
        self.on_record = on_record
        self.show_progress = show_progress
        self.run_dir = cfg.out_dir
        self.metrics = MetricsLog(self.run_dir / METRICS_FILE, enabled=env.is_main)
        self.loggers = ExperimentLoggers([])  # TensorBoard / W&B on rank 0, opened in _setup
        self.fingerprint: dict[str, Any] | None = None
        self.preflight: PreflightReport | None = None
        self.skip_preflight: tuple[str, ...] = ()
        self.step = 0
        self.tokens = 0
        self.step_times: list[float] = []
        self.last_loss = math.nan
        self.last_val_loss: float | None = None
        self.last_val_bpb: float | None = None
        self.validated_step = -1
        self.last_checkpoint: Path | None = None
        self.checkpoint_step = -1
        self.resumed_from: Path | None = None
        self.peak_mem = 0
        self.mfu_meter: MfuMeter | None = None
        self.mfu_values: list[float] = []
        self.spikes = SpikeDetector.from_config(cfg.guards)
        self.finetuning = FineTuning(cfg)  # init_from, freeze, LoRA (no-ops for a plain run)
        self.model_cfg: ModelConfig | None = None
        self.cost = None  # the model's analytic ModelCost, once built
        self.seq_len = 0
        self.plan: ExecutionPlan | None = None  # the run's modes (kernels, compile, graphs)
        self.float8: Float8Report | None = None  # what parallel.float8 converted
        self.accum = cfg.train.grad_accum_steps  # micro-batches per rank per step
        self.peak: PeakFlops | None = None  # what MFU divides by
        self.reducer: FlatGradReducer | None = None  # DDP with grad_sync = "flat"
        self.graphed = False
        self.graphs: StepGraphs | None = None  # captured after WARMUP_STEPS eager steps
        self.side_stream: torch.cuda.Stream | None = None  # warm-up and capture run on it
        self.eager_steps = 0  # in this process
        self.loss_poison: torch.Tensor | None = None  # debug.nan_target = "loss"
        self.pending: PendingStep | None = None  # launched, its record not yet emitted
        self.watchdog: StepWatchdog | None = None  # replayed steps of a multi-GPU run
        self.started = time.perf_counter()
        self.clock = RunClock(clock_from_process_start)  # time budgets, eval_every_s
        self.next_eval_s = cfg.train.eval_every_s

    # -- the whole run -------------------------------------------------------------------------
    def run(self, resume: str | None, fallback: bool, skip: tuple[str, ...]) -> RunResult:
        on_main(self.env, lambda: self._claim_run_dir(resume))
        self.skip_preflight = skip
        with contextlib.ExitStack() as scope:
            try:
                self._setup(resume, fallback, scope)
                self._loop()
                self._finish_training()
            except BaseException as exc:  # every run ends with a receipt, also on Ctrl-C and bugs
                self.loggers.close()
                failure = self._collective_failure(exc)
                receipt = self._write_receipt(error=failure or exc)
                if failure is not None:
                    raise TrainingFailed(str(failure), receipt, failure.exit_code) from None
                if isinstance(exc, MegaCppError):
                    raise TrainingFailed(str(exc), receipt, exc.exit_code) from None
                raise
            self.loggers.close()
            receipt = self._write_receipt(error=None)
        return self._result(receipt)

    def release_graphs(self) -> None:
        """Drop the captured step (before the process group goes: see StepGraphs.release)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def _collective_failure(self, exc: BaseException) -> MegaCppError | None:
        """A failed collective (a peer died, hung past parallel.timeout_s, or its connection
        broke) as one clear error; None for anything else."""
        if not self.env.distributed or not _is_collective_error(exc):
            return None
        last = self.last_checkpoint or "none yet"
        return MegaCppError(
            f"rank {self.env.rank}: a collective failed at step {self.step + 1} "
            f"({describe_error(exc)}); another rank stopped or did not answer within "
            f"parallel.timeout_s = {self.cfg.parallel.timeout_s} s (see its log). Nothing after "
            f"the newest complete checkpoint ({last}) is kept: restart with --resume auto",
            exit_code=1)

    def _claim_run_dir(self, resume: str | None) -> None:
        """Refuse to start over an existing run unless resuming (nothing is ever deleted)."""
        existing = [p for p in (self.run_dir / "checkpoints", self.run_dir / METRICS_FILE)
                    if p.exists()]
        if existing and resume is None:
            raise MegaCppError(
                f"{self.run_dir} already holds a run ({', '.join(p.name for p in existing)}); "
                "continue it with --resume auto, or choose another run.out_dir "
                "(--set run.out_dir=DIR)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        receipt = self.run_dir / RECEIPT_FILE
        if receipt.exists():  # an earlier segment of this run: keep it
            history = self.run_dir / HISTORY_DIR
            history.mkdir(exist_ok=True)
            shutil.move(receipt, history / f"receipt-{len(list(history.iterdir())):03d}.json")

    # -- setup -------------------------------------------------------------------------------------
    def _setup(self, resume: str | None, fallback: bool, scope: contextlib.ExitStack) -> None:
        cfg, env = self.cfg, self.env
        self.plan = plan_execution(cfg.parallel, env.device, env.strategy, env.world_size)
        scope.enter_context(kernel_mode_override(self.plan.kernels))
        self.graphed = self.plan.cuda_graph
        self.accum = cfg.train.accumulation(env.world_size)
        self.preflight = on_main(env, self._run_preflight)
        dataset = self._open_dataset()
        self.model_cfg = self._model_config(dataset)
        self.inference_files = inference_files(self.model_cfg, dataset.root / TOKENIZER_FILE)
        self.checkpoints = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last, env,
                                             stall_step=cfg.debug.checkpoint_stall_step,
                                             warn=self._warn)
        on_main(env, self._note_partial_checkpoints)
        path = self.checkpoints.resolve(resume, fallback) if resume else None
        torch.manual_seed(cfg.run.seed)
        model = HybridLM(self.model_cfg)
        self.finetuning.prepare(model, restoring=path is not None, log=self._print)
        self.model = parallelize(model.to(env.device), cfg.parallel, env,
                                 compile=self.plan.compile, grad_sync=self.plan.grad_sync,
                                 on_float8=self._float8_converted)
        self.base = base_model(self.model)
        self.named_params = [(clean_name(n), p) for n, p in self.model.named_parameters()]
        if self.plan.grad_sync == "flat":
            self.reducer = FlatGradReducer([p for _, p in self.named_params], env.world_size,
                                           cfg.parallel.reduce_dtype,
                                           int(cfg.parallel.bucket_mb * (1 << 20)))
        self.optimizers = Optimizers(self.base, cfg.optim, env.device, capturable=self.graphed)
        if cfg.debug.nan_target == "loss":
            self.loss_poison = torch.ones((), device=env.device)
        self._setup_data(dataset)
        self._setup_metrics(dataset.seq_len)
        if path is not None:
            self._restore(path)
        else:
            on_main(env, self.metrics.reset)
        on_main(env, self._write_config)
        on_main(env, self._open_loggers)
        if self.graphed and env.distributed:
            self.watchdog = StepWatchdog(cfg.parallel.timeout_s, self._step_hung)
            scope.callback(self.watchdog.close)
        self._emit({"type": "setup", "step": self.step, "world_size": env.world_size,
                    "strategy": env.strategy, "modes": self.plan.to_dict(),
                    "global_batch": self._global_batch(),
                    "mfu_peak_tflops": self.peak.tflops, "mfu_peak_source": self.peak.source})
        self._print(self._describe_setup())

    def _float8_converted(self, report: Float8Report) -> None:
        self.float8 = report
        self._print("\n".join(report.lines()))

    def _open_loggers(self) -> None:
        self.loggers = ExperimentLoggers.open(self.cfg.run.loggers, self.run_dir,
                                              self.cfg.run.name, self.cfg.to_dict(self.model_cfg),
                                              start_step=self.step)

    def _step_hung(self, seconds: float) -> None:
        """The watchdog's last act (from its thread; the process exits after it): the error
        line and, on rank 0, the receipt."""
        error = MegaCppError(
            f"rank {self.env.rank}: step {self.step + 1} did not finish in {seconds:.0f} s "
            f"(parallel.timeout_s = {self.cfg.parallel.timeout_s}): a collective inside the "
            "replayed CUDA graph is waiting for a rank that stopped (see its log). Nothing "
            f"after the newest complete checkpoint ({self.last_checkpoint or 'none yet'}) is "
            "kept: restart with --resume auto", exit_code=1)
        receipt = self._write_receipt(error=error)
        suffix = f" (receipt: {receipt})" if receipt else ""
        os.write(2, f"error: {error}{suffix}\n".encode())

    def _global_batch(self) -> int:
        """Rows per optimizer step over all ranks."""
        return self.cfg.train.micro_batch_size * self.accum * self.env.world_size

    def _describe_setup(self) -> str:
        groups = self.optimizers.summary()
        env = self.env
        sync = f", grad_sync {self.plan.grad_sync}" if self.plan.grad_sync else ""
        return (f"{self.model_cfg.pattern}: {self.cost.params:,} parameters "
                f"({self.cost.active_params:,} active); Muon {groups['muon_params']:,}, AdamW "
                f"{groups['adamw_decay_params'] + groups['adamw_no_decay_params']:,}; "
                f"{env.world_size} x {env.device.type} ({env.strategy}{sync}); global batch "
                f"{self._global_batch()} x {self.seq_len} tokens "
                f"({self.cfg.train.micro_batch_size} x {self.accum} per rank); "
                f"MFU {self.mfu_meter.note}\n" + "\n".join(self.plan.lines()))

    def _run_preflight(self) -> PreflightReport:
        contract = self.cfg.contract
        self.fingerprint = capture_fingerprint(packages=contract.packages)
        if self.cfg.run.check_site_integrity:
            return require_preflight(self.fingerprint, contract, self.skip_preflight)
        report = run_preflight(self.fingerprint, contract, self.skip_preflight,
                               check_integrity=False)
        if not report.ok:
            rules = " ".join(f"--skip-preflight {f.rule}" for f in report.errors)
            raise PreflightError("preflight failed: " + "; ".join(
                f"[{f.rule}] {f.message}" for f in report.errors) + f"; to run anyway: {rules}")
        record_cache_routings(self.fingerprint)
        return report

    def _open_dataset(self) -> ShardedDataset:
        path = self.cfg.data_dir
        on_main(self.env, lambda: _verify_dataset(path))
        return ShardedDataset.open(path, verify=False)  # rank 0 verified every file above

    def _model_config(self, dataset: ShardedDataset) -> ModelConfig:
        vocab = int(dataset.manifest["tokenizer"]["vocab_size"])
        model_cfg = self.cfg.model_config(vocab_size=vocab)
        if model_cfg.vocab_size < vocab:
            raise ConfigError(f"model.vocab_size = {model_cfg.vocab_size} is smaller than the "
                              f"dataset's tokenizer ({vocab} tokens, {self.cfg.data_dir}); set "
                              f"model.vocab_size >= {vocab} or \"dataset\"")
        _require_structure_ids(model_cfg, dataset)
        return model_cfg

    def _setup_data(self, dataset: ShardedDataset) -> None:
        cfg, env = self.cfg, self.env
        micro = cfg.train.micro_batch_size
        rows, step_rows = dataset.num_rows("train"), self._global_batch()
        if rows < step_rows:
            raise ConfigError(f"a step needs at least {step_rows} train rows (micro_batch_size "
                              f"{micro} x {self.accum} micro-batches x {env.world_size} rank(s)); "
                              f"{cfg.data_dir} has {rows}")
        common = {"batch_size": micro, "rank": env.rank, "world_size": env.world_size}
        self.train_loader = PackedLoader(dataset, "train", seed=cfg.run.seed,
                                         shuffle=cfg.data.shuffle, num_workers=cfg.data.num_workers,
                                         pin_memory=env.device.type == "cuda",
                                         step_samples=step_rows, **common)
        self.batches = _full_batches(self.train_loader, micro)
        self.val_loader = PackedLoader(dataset, "validation", shuffle=False, **common)
        self.token_nbytes = torch.from_numpy(dataset.tokenizer().token_nbytes.astype("int64"))
        self.val_start = self.val_loader.state_dict()
        n_val = all_reduce_(torch.tensor([len(self.val_loader)], device=env.device), "min")
        limit = cfg.data.val_batches or int(n_val.item())
        self.val_batches = min(int(n_val.item()), limit)
        self.seq_len = dataset.seq_len

    def _setup_metrics(self, seq_len: int) -> None:
        cost = count_model(self.model_cfg, seq_len=seq_len)
        self.cost = cost
        self.autocast_bf16 = self._use_bf16()
        env = self.env
        if env.device.type == "cuda":
            profile = profile_for_fingerprint(self.fingerprint or capture_fingerprint(),
                                              env.local_rank)
        else:
            profile = device_profile(None)
        self.peak = (self._measure_peak(profile) if self.autocast_bf16
                     else PeakFlops(None, "an fp32 run: MFU is quoted against bf16 peaks"))
        self.mfu_meter = MfuMeter(cost.train_flops_per_token, profile,
                                  "bf16" if self.autocast_bf16 else "fp32", self.peak)

    def _measure_peak(self, profile) -> PeakFlops:
        """The bf16 matmul peak MFU divides by: measured once per run on every rank's GPU (the
        mean over the ranks), the datasheet's where it cannot be measured."""
        peak = bf16_matmul_peak(self.env.device, profile)
        if not self.env.distributed:
            return peak
        measured = float(peak.measured)  # every rank joins the sum, measured or not
        total, count = all_reduce_(torch.tensor([measured and peak.tflops, measured],
                                                dtype=torch.float64, device=self.env.device)
                                   ).tolist()
        if count < self.env.world_size:  # a rank could not measure: this rank's own figure
            return peak
        return PeakFlops(total / count, f"{peak.source}, mean over {int(count)} ranks", True)

    def _use_bf16(self) -> bool:
        dtype, cuda = self.cfg.train.dtype, self.env.device.type == "cuda"
        if dtype == "bf16" and not cuda:
            raise ConfigError("train.dtype = \"bf16\" is for CUDA runs; CPU runs train in fp32 "
                              "(use \"auto\" or \"fp32\")")
        return dtype == "bf16" or (dtype == "auto" and cuda)

    def _note_partial_checkpoints(self) -> None:
        for path in self.checkpoints.remove_partial():
            self._warn(f"removed {path}: a checkpoint whose write was interrupted (never published)")

    def _restore(self, path: Path) -> None:
        trainer_state, rank_state = self.checkpoints.load(path, self.model, list(self.optimizers),
                                                          self.model_cfg)
        saved_world = int(trainer_state.get("world_size", self.env.world_size))
        saved_batch = trainer_state.get("global_batch")
        if saved_world != self.env.world_size:
            self._print(f"resuming a checkpoint of {saved_world} rank(s) on "
                        f"{self.env.world_size}: the data continues at its global sample "
                        f"{rank_state['data'].get('sample_in_epoch')}")
        if saved_batch is not None and int(saved_batch) != self._global_batch():
            self._warn(f"the global batch changes from {saved_batch} rows (checkpoint) to "
                       f"{self._global_batch()}; set train.global_batch_size = {saved_batch} "
                       "to keep it")
        self.train_loader.load_state_dict(rank_state["data"])
        restore_rng_state(rank_state["rng"], self.env.device)
        self.step = int(trainer_state["step"])
        self.tokens = int(trainer_state["tokens"])
        self.last_loss = float(trainer_state["last_loss"])
        self.spikes.load_state_dict(trainer_state["spikes"])
        self.clock.base = float(trainer_state.get("clock_s", 0.0))
        every = self.cfg.train.eval_every_s
        if every:
            self.next_eval_s = (math.floor(self.clock() / every) + 1) * every
        self.resumed_from = self.last_checkpoint = path
        self.checkpoint_step = self.step
        on_main(self.env, lambda: self.metrics.truncate_after(self.step))
        self._print(f"resumed from {path} (step {self.step})")

    def _write_config(self) -> None:
        header = "resolved run config written by `megacpp train`"
        if self.cfg.overrides:
            header += "\noverrides: " + " ".join(self.cfg.overrides)
        atomic_write_text(self.run_dir / "config.toml",
                          to_toml(self.cfg.to_dict(self.model_cfg), header=header))

    # -- the loop ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        cfg = self.cfg.train
        with TrainProgress(self.console, cfg.steps, self.step, self.env.is_main,
                           self.show_progress) as self.progress:
            try:
                while self.step < cfg.steps and not self._out_of_time():
                    self.pending = self._train_step(self.step + 1)
                    self.step += 1
                    validate = (bool(cfg.eval_every) and self.step % cfg.eval_every == 0
                                or self._eval_due())
                    every = self.cfg.checkpoint.every
                    save = bool(every) and self.step % every == 0 and self.step < cfg.steps
                    if validate or save:
                        self._settle()
                    if validate:
                        self._validate()
                    if save:
                        self._save_checkpoint()
                self._settle()
            except BaseException:
                with contextlib.suppress(Exception):  # keep the steps that finished, then raise
                    self._settle()
                raise

    def _out_of_time(self) -> bool:
        budget = self.cfg.train.time_budget_s
        return bool(budget) and self.clock() >= budget

    def _eval_due(self) -> bool:
        """train.eval_every_s: the clock passed the next multiple (then the one after it)."""
        every = self.cfg.train.eval_every_s
        if not every or self.clock() < self.next_eval_s:
            return False
        self.next_eval_s = (math.floor(self.clock() / every) + 1) * every
        return True

    def _lr_factor(self, step: int) -> float:
        """The schedule at ``step``: by steps, or with a time budget by the clock's share."""
        budget, schedule = self.cfg.train.time_budget_s, self.cfg.schedule
        if budget:
            return lr_factor_by_progress(step, self.clock() / budget, schedule)
        return lr_factor(step, self.cfg.train.steps, schedule)

    def _train_step(self, step: int) -> PendingStep:
        """Run step ``step`` up to the launch of its update: the guard has passed and the update
        is queued on the GPU, but not waited for. The next step reads its balance after its
        own sync (the GPU is past this update by then) and emits its record after launching
        its own update, so the host work between two steps -- the record, the batch, the
        copies, the replay -- overlaps an update on the GPU instead of leaving the GPU idle."""
        env = self.env
        started = time.perf_counter()
        lr = self.cfg.optim.lr * self._lr_factor(step)
        self.optimizers.set_lr(lr)
        micro = [next(self.batches) for _ in range(self.accum)]
        if self._inject_nan(step, "loss"):
            self.loss_poison.fill_(math.nan)
        if self.graphed and self.graphs is None and self.eager_steps >= WARMUP_STEPS:
            self._capture(micro)
        if self.watchdog is not None and self.graphs is not None:
            self.watchdog.arm()  # (eager collectives have the process group's timeout)
        with self._warmup_stream():
            if self.graphs is not None:
                figures = self.graphs.accumulate(micro)
            else:
                figures = self._accumulate_figures(
                    [{k: v.to(env.device, non_blocking=True) for k, v in b.items()} for b in micro])
            if self._inject_grad_nan(step):  # written after the reduction: its norm again
                figures = torch.cat([figures[:4], self._grad_norm().double()[None]])
            values = figures.tolist()  # the step's one host sync
            self._read_pending_balance()  # the previous update ran before these figures
            ce, aux, mtp, n_targets, grad_norm_value = values
            loss = ce / max(n_targets, 1)
            per_micro = len(micro) * env.world_size  # aux and MTP: micro-batch means
            aux_loss, mtp_loss = aux / per_micro, mtp / per_micro
            check_finite(step, loss + aux_loss + mtp_loss, grad_norm_value, self.named_params)
            if self.graphs is not None:
                balance = self.graphs.update(figures[4])
            else:
                balance = self._update(figures[4].float())  # the float32 norm, exactly
                if self.reducer is None:  # (the flat buffer stays: zeroed at the next step)
                    self.optimizers.zero_grad()
                self.eager_steps += 1
        self._settle(started)  # the previous step's record, while this update runs
        if self.watchdog is not None:
            self.watchdog.disarm()
        return PendingStep(step, loss, aux_loss, mtp_loss if self.base.mtp is not None else None,
                           grad_norm_value, lr, balance, started)

    def _capture(self, micro: list[dict[str, torch.Tensor]]) -> None:
        """Capture the step as CUDA graphs, on every rank or on none: a failure anywhere stops
        a run that asked for graphs (``cuda_graph = true``) and leaves an ``auto`` run eager,
        with the reason in its log and receipt."""
        env = self.env
        graphs, error = None, None
        try:
            graphs = StepGraphs(self._accumulate_figures, self._update, self.optimizers, micro,
                                env.device, self.side_stream,
                                capture_error_mode="thread_local" if env.distributed else "global")
        except GraphCaptureError as exc:
            error = exc
        failed = all_reduce_(torch.tensor([float(error is not None)], device=env.device), "max")
        if not failed.item():
            self.graphs = graphs
            return
        del graphs
        reason = str(error) if error is not None else "the capture failed on another rank"
        if self.plan.graph_required:
            raise error or GraphCaptureError(f"parallel.cuda_graph: {reason}")
        self.plan.graph_failed(reason)
        self.graphed = False
        self.optimizers.zero_grad()  # what the failed capture bound is never read
        self._warn(f"cuda_graph: off ({reason})")

    def _read_pending_balance(self) -> None:
        """The pending step's MoE balance as a float: the one figure of its record that comes
        from its update. Read before the next update is launched (a graphed run's next replay
        overwrites the tensor) and after the next step's sync (so it waits for nothing)."""
        pending = self.pending
        if pending is not None and isinstance(pending.balance, torch.Tensor):
            pending.balance = pending.balance.item()

    def _settle(self, now: float | None = None) -> None:
        """Finish the pending step's record and emit it (its balance read, waiting for its
        update if the next step has not). ``now``: when the next step started (start to start
        is the step's period: in a steady run each start follows the previous step's sync);
        None: now, after the wait."""
        self._read_pending_balance()
        pending, self.pending = self.pending, None
        if pending is None:
            return
        ended = time.perf_counter() if now is None else now
        self._emit(self._step_record(pending.step, pending.loss, pending.aux_loss,
                                     pending.mtp_loss, pending.grad_norm, pending.lr,
                                     pending.balance,
                                     ended - pending.started))

    def _accumulate(self, micro: list[dict[str, torch.Tensor]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one step's micro-batches (device tensors): this rank's
        summed [cross-entropy, aux losses, MTP losses] and the global count of targets.

        The cross-entropy is a mean over the global batch's targets; the aux and MTP losses
        (each a mean within its micro-batch) are averaged over micro-batches. No host syncs:
        a CUDA graph captures this function as it is (:mod:`megacpp.train.graphs`)."""
        env = self.env
        if self.reducer is not None:
            self.reducer.zero()
        counts = [(batch["labels"] != IGNORE_INDEX).sum() for batch in micro]
        n_targets = all_reduce_(torch.stack(counts).sum())
        sums = torch.zeros(3, device=env.device)
        mtp_weight = self.base.mtp.loss_weight if self.base.mtp is not None else 0.0
        # DDP and FSDP2 average the ranks' gradients, the flat buffer sums them: the objective
        # is scaled so that either gives the global batch's mean (aux, MTP: of micro-batches)
        summed = self.reducer is not None
        ce_scale = 1 if summed else env.world_size
        aux_scale = len(micro) * (env.world_size if summed else 1)
        for i, (batch, count) in enumerate(zip(micro, counts, strict=True)):
            last = i == len(micro) - 1
            if summed and last:
                self.reducer.arm()  # its buckets start as their gradients come in
            with gradient_sync(self.model, last):
                ce_sum, aux, mtp = self._forward(batch, count)
                if self.loss_poison is not None:
                    ce_sum = ce_sum * self.loss_poison
                objective = (ce_sum * ce_scale / n_targets.clamp_min(1)
                             + (aux + mtp_weight * mtp) / aux_scale)
                objective.backward()
            sums += torch.stack([ce_sum.detach(), aux.detach(), mtp.detach()])
        return sums, n_targets

    def _accumulate_figures(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """:meth:`_accumulate`, the flat buffer's all-reduce (DDP with grad_sync "flat"), then
        the step's figures in one float64 tensor: [ce, aux, MTP summed over the ranks,
        targets, the global gradient norm after the reduction] -- what a graphed step's first
        graph returns, so the guard reads them in one copy. No host syncs."""
        sums, targets = self._accumulate(micro)
        if self.reducer is not None:
            self.reducer.reduce()
        all_reduce_(sums)
        return torch.cat([sums.double(), targets.double()[None], self._grad_norm().double()[None]])

    def _update(self, grad_norm: torch.Tensor) -> torch.Tensor | None:
        """Clip by ``grad_norm``, step the optimizers, update the MoE biases; the worst MoE
        layer's max/mean expert load (a device tensor) or None. No host syncs (a CUDA graph
        captures it)."""
        self.optimizers.step(muon_grad_scale=self._clip_gradients(grad_norm))
        return self._update_moe_biases()

    def _warmup_stream(self) -> contextlib.AbstractContextManager:
        """Eager steps of a graphed run (before capture, and after a failed capture, so the
        gradient accumulators keep one stream) go to the side stream the capture uses, as
        PyTorch's CUDA-graph notes ask of warm-up iterations; everything else to the current
        stream."""
        if self.graphs is not None or (not self.graphed and self.side_stream is None):
            return contextlib.nullcontext()
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(self.env.device)
        return _on_stream(self.side_stream)

    def _forward(
        self, batch: dict[str, torch.Tensor], n_targets: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The model's losses on one micro-batch of ``n_targets`` targets, through its own loss
        path (the catalog's fused linear cross-entropy when chosen: no logits): (the
        next-token cross-entropy summed over the targets, the auxiliary losses -- MoE balance,
        DSA indexer KL -- and the MTP loss; 0 where the model has none)."""
        device = self.env.device
        input_ids = batch["input_ids"].to(device, non_blocking=True)  # [B, L]
        labels = batch["labels"].to(device, non_blocking=True)  # [B, L]
        doc_ids = batch["doc_ids"].to(device, non_blocking=True)  # [B, L]
        structure_ids = None  # [B, L], read only by a model with a structure-id embedding
        if self.model_cfg.structure.embedding:
            structure_ids = batch["structure_ids"].to(device, non_blocking=True)
        with self._autocast():
            out = self.model(input_ids, doc_ids=doc_ids, labels=labels,
                             structure_ids=structure_ids)
        ce_sum = out.lm_loss.float() * n_targets  # the mean over targets (0 without any)
        zero = ce_sum.new_zeros(())
        aux = out.aux_loss.float() if out.aux_loss is not None else zero
        mtp = out.mtp_loss.float() if out.mtp_loss is not None else zero
        return ce_sum, aux, mtp

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_bf16:  # a graph cannot replay autocast's per-forward cast cache
            return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not self.graphed)
        return contextlib.nullcontext()

    def _grad_norm(self) -> torch.Tensor:
        """The global L2 norm of all gradients, a plain tensor (under FSDP2 the shards' norms
        are all-reduced), grads untouched -- so the guard can still find the first
        non-finite one."""
        grads = [p.grad for _, p in self.named_params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def _clip_gradients(self, grad_norm: torch.Tensor) -> torch.Tensor | None:
        """Clip to ``train.max_grad_norm`` by ``grad_norm`` (torch's
        ``clip_grads_with_norm_``: every gradient times min(1, max / (norm + 1e-6))). Muon's
        momentum pass takes that coefficient itself where it can (``muon_grad_scale``): its
        gradients, 93% of nam56r-350m's, are then not rewritten first (~1 ms of an H100
        step). Returns the coefficient for Muon, else None."""
        max_norm = self.cfg.train.max_grad_norm
        if not max_norm:
            return None
        if any(isinstance(p, DTensor) for _, p in self.named_params):
            # FSDP2: the same coefficient times every local shard (no DTensor dispatch)
            coef = torch.clamp(max_norm / (grad_norm + 1e-6), max=1.0)
            grads = [p.grad.to_local() for _, p in self.named_params if p.grad is not None]
            torch._foreach_mul_(grads, coef.to(grads[0].device))
            return None
        if not self.optimizers.muon_takes_grad_scale:
            torch.nn.utils.clip_grads_with_norm_([p for _, p in self.named_params], max_norm,
                                                 grad_norm)
            return None
        groups = self.optimizers.groups
        torch.nn.utils.clip_grads_with_norm_(
            [p for _, p in groups.adamw_decay + groups.adamw_no_decay], max_norm, grad_norm)
        # the coefficient as clip_grads_with_norm_ forms it, in the gradients' float32
        return torch.clamp(max_norm / (grad_norm + 1e-6), max=1.0).to(torch.float32)

    def _update_moe_biases(self) -> torch.Tensor | None:
        """All-reduce each MoE layer's token counts, update the biases; the worst max/mean
        (a device tensor)."""
        mixers = [b.mixer for b in self.base.moe_blocks()]
        if not mixers:
            return None
        counts = all_reduce_(torch.stack([m.routed_tokens for m in mixers]))  # [layers, E]
        for mixer, layer_counts in zip(mixers, counts, strict=True):
            mixer.routed_tokens.copy_(layer_counts)
        balance = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)).max()
        self.base.update_moe_biases()
        return balance

    def _inject_nan(self, step: int, target: str) -> bool:
        debug = self.cfg.debug
        return debug.nan_step == step and debug.nan_target == target

    def _inject_grad_nan(self, step: int) -> bool:
        """debug.nan_target = a parameter: NaN its gradient at debug.nan_step (True if done)."""
        debug = self.cfg.debug
        if debug.nan_step != step or debug.nan_target == "loss":
            return False
        params = dict(self.named_params)
        if debug.nan_target not in params:
            raise ConfigError(f"debug.nan_target = {debug.nan_target!r} is not a parameter; "
                              f"e.g. {', '.join(list(params)[:4])} (or \"loss\")")
        grad = params[debug.nan_target].grad
        (grad.to_local() if isinstance(grad, DTensor) else grad).fill_(math.nan)
        return True

    def _step_record(self, step: int, loss: float, aux_loss: float, mtp_loss: float | None,
                     grad_norm: float, lr: float, balance: float | None, elapsed: float) -> Record:
        step_tokens = self._global_batch() * self.seq_len
        self.tokens += step_tokens
        self.step_times.append(elapsed)
        tokens_per_s = step_tokens / elapsed
        mfu = self.mfu_meter(tokens_per_s / self.env.world_size)
        if mfu is not None:
            self.mfu_values.append(mfu)
        self.peak_mem = peak_memory_bytes(self.env.device)
        self.last_loss = loss
        spike = self.spikes.observe(loss)
        if spike:
            self._warn(f"loss spike at step {step}: {loss:.4f} (recent mean "
                       f"{self.spikes.mean:.4f})")
        return {"type": "train", "step": step, "loss": loss, "aux_loss": aux_loss,
                "mtp_loss": mtp_loss,
                "grad_norm": grad_norm, "lr": lr, "tokens": self.tokens,
                "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_mem_bytes": self.peak_mem,
                "moe_balance": balance, "spike": spike, "time_s": elapsed,
                "clock_s": self.clock()}

    def _emit(self, record: Record) -> None:
        """Rank 0 logs ``record``; train and val records also go to the progress bar and
        ``on_record`` (a run's setup record only to metrics.jsonl)."""
        if not self.env.is_main:
            return
        self.metrics.write(record)
        if record["type"] == "setup":
            return
        self.loggers.log(record)
        if record["type"] == "train":
            self.progress.update(record)
        if self.on_record is not None:
            self.on_record(record)

    # -- validation and checkpoints ------------------------------------------------------------
    def _validate(self) -> None:
        with self.clock.paused():  # measurement, not training: off the run's clock
            self._validate_now()

    @torch.no_grad()
    def _validate_now(self) -> None:
        self.validated_step = self.step
        if self.val_batches == 0:
            return
        clock_s = self.clock()
        self.model.eval()
        self.val_loader.load_state_dict(self.val_start)
        # [ce, targets, bytes] (float64 holds the byte counts exactly)
        sums = torch.zeros(3, dtype=torch.float64, device=self.env.device)
        for i, batch in enumerate(self.val_loader):
            if i >= self.val_batches:
                break
            targets = _count_targets(batch)
            n_bytes = target_bytes(batch["labels"], self.token_nbytes, IGNORE_INDEX)
            ce_sum, _aux, _mtp = self._forward(batch, targets)
            sums += torch.stack([ce_sum.double(), sums.new_tensor(targets),
                                 sums.new_tensor(n_bytes)])
        self.model.train()
        all_reduce_(sums)
        ce, targets, n_bytes = sums.tolist()
        self.last_val_loss = ce / targets if targets else None
        self.last_val_bpb = bits_per_byte(ce, int(n_bytes))
        record = {"type": "val", "step": self.step, "val_loss": self.last_val_loss,
                  "val_tokens": int(targets), "val_bytes": int(n_bytes),
                  "val_bpb": self.last_val_bpb, "tokens": self.tokens, "clock_s": clock_s}
        self._emit(record)
        if self.last_val_loss is not None:
            self._print(f"step {self.step}: validation loss {self.last_val_loss:.4f}, "
                        f"{self.last_val_bpb:.4f} bits/byte (clock {clock_s:.1f} s)")

    def _save_checkpoint(self) -> None:
        with self.clock.paused():
            self._save_checkpoint_now()

    def _save_checkpoint_now(self) -> None:
        trainer_state = {
            "step": self.step, "tokens": self.tokens, "last_loss": self.last_loss,
            "clock_s": self.clock(),
            "spikes": self.spikes.state_dict(), "model_config": self.model_cfg.to_dict(),
            "world_size": self.env.world_size, "global_batch": self._global_batch(),
            **self.finetuning.checkpoint_state(),
        }
        rank_state = {"data": self.train_loader.state_dict(),
                      "rng": capture_rng_state(self.env.device)}
        self.last_checkpoint = self.checkpoints.save(
            self.step, self.model, list(self.optimizers), trainer_state, rank_state,
            files=self.inference_files)
        self.checkpoint_step = self.step
        self.finetuning.after_checkpoint(self.base, self.run_dir, self.last_checkpoint,
                                         self.env.is_main)

    def _finish_training(self) -> None:
        if self.validated_step != self.step:
            self._validate()
        if self.checkpoint_step != self.step and self.cfg.checkpoint.final:
            self._save_checkpoint()
        # the receipt's peak memory: the largest of any rank's
        self.peak_mem = int(all_reduce_(torch.tensor([self.peak_mem], device=self.env.device),
                                        "max").item())
        if self.env.is_main and self.cfg.run.plots:
            from megacpp.train.plot import plot_run

            plot_run(self.run_dir)

    # -- the receipt ---------------------------------------------------------------------------------
    def _write_receipt(self, error: BaseException | None) -> Path | None:
        """Rank 0 writes RUN_DIR/receipt.json; returns its path (None on other ranks)."""
        if not self.env.is_main:
            return None
        status = "completed" if error is None else "failed"
        config = {
            "run": self.cfg.to_dict(self.model_cfg),
            "overrides": list(self.cfg.overrides),
            "invocation": {"world_size": self.env.world_size, "strategy": self.env.strategy,
                           "device": str(self.env.device),
                           "modes": self.plan.to_dict() if self.plan else None,
                           "float8": self.float8.to_dict() if self.float8 else None,
                           "global_batch": self._global_batch(),
                           "resumed_from": str(self.resumed_from) if self.resumed_from else None,
                           "skip_preflight": list(self.skip_preflight)},
            "outcome": {"status": status, "error": _describe(error),
                        "mfu": self.mfu_meter.note if self.mfu_meter else None},
        }
        artifacts = [p for p in (self.run_dir / "config.toml", self.run_dir / METRICS_FILE)
                     if p.is_file()]
        if self.last_checkpoint is not None and (self.last_checkpoint / MARKER).is_file():
            artifacts.append(self.last_checkpoint / MARKER)
        path = self.run_dir / RECEIPT_FILE
        try:
            recipe = self.cfg.parallel.float8
            kernels = chosen_kernels()
            if recipe != "off":
                kernels["float8_linear"] = f"torchao_{recipe}"
            fingerprint = with_numerics(
                self.fingerprint or capture_fingerprint(packages=self.cfg.contract.packages),
                float8=recipe)
            write_receipt(path, "train", config, self._receipt_metrics(status), artifacts,
                          kernels=kernels, preflight=self.preflight, fingerprint=fingerprint)
        except MegaCppError as exc:  # never mask the run's own outcome
            self._warn(f"could not write the receipt {path}: {exc}")
            return None
        return path

    def _receipt_metrics(self, status: str) -> dict[str, float]:
        steady = self.step_times[1:] or self.step_times  # the first step includes warm-up
        step_tokens = self._global_batch() * self.seq_len
        metrics: dict[str, float] = {
            "completed": float(status == "completed"), "steps": self.step,
            "tokens": self.tokens, "world_size": self.env.world_size,
            "wall_s": time.perf_counter() - self.started, "loss_spikes": self.spikes.spikes,
            "peak_mem_bytes": self.peak_mem,
        }
        if steady:
            metrics["tokens_per_s"] = step_tokens * len(steady) / sum(steady)
        if math.isfinite(self.last_loss):
            metrics["final_loss"] = self.last_loss
        if self.last_val_loss is not None:
            metrics["final_val_loss"] = self.last_val_loss
        if self.peak is not None and self.peak.tflops is not None:
            metrics["mfu_peak_tflops"] = self.peak.tflops
        if self.last_val_bpb is not None:
            metrics["final_val_bpb"] = self.last_val_bpb
        metrics["clock_s"] = self.clock()
        metrics["startup_s"] = self.clock.startup_s
        if self.mfu_values:
            metrics["mfu"] = sum(self.mfu_values[1:] or self.mfu_values) / len(
                self.mfu_values[1:] or self.mfu_values)
        if self.cost is not None:
            metrics.update(params=self.cost.params, active_params=self.cost.active_params,
                           train_flops_per_token=self.cost.train_flops_per_token,
                           **self.optimizers.summary())
        return metrics

    def _result(self, receipt: Path | None) -> RunResult:
        metrics = self._receipt_metrics("completed")
        return RunResult(
            run_dir=self.run_dir, steps=self.step, final_loss=self.last_loss,
            final_val_loss=self.last_val_loss, tokens=self.tokens,
            tokens_per_s=metrics.get("tokens_per_s", 0.0), mfu=metrics.get("mfu"),
            checkpoint=self.last_checkpoint, receipt=receipt or self.run_dir / RECEIPT_FILE,
            resumed_from=self.resumed_from, final_val_bpb=self.last_val_bpb,
            clock_s=self.clock(),
        )

    # -- output -----------------------------------------------------------------------------------------
    def _print(self, message: str) -> None:
        if self.env.is_main:
            progress = getattr(self, "progress", None)
            if progress is not None:
                progress.print(message)
            else:
                self.console.print(message, highlight=False)

    def _warn(self, message: str) -> None:
        self._print(f"[yellow]warning:[/] {message}")


@contextlib.contextmanager
def _on_stream(side: torch.cuda.Stream) -> Iterator[None]:
    """Run the block on the CUDA stream ``side``, ordered after and before the current one."""
    current = torch.cuda.current_stream(side.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


_PEER_LOST = ("Connection closed", "Connection reset", "Broken pipe", "timed out", "Timed out",
              "Timeout", "ncclRemoteError", "ncclSystemError", "NCCL communicator was aborted")


def _is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a collective lost its peers: a broken connection, a timeout, an
    aborted NCCL communicator (a collective misused by this program stays a bug)."""
    return isinstance(exc, RuntimeError) and any(mark in str(exc) for mark in _PEER_LOST)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (torchrun stopping the survivors of a failed rank, a scheduler's preemption)
    ends the run like Ctrl-C: the loop stops and the receipt says so."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Real next-token targets of a batch (its labels are on the host: no device sync)."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


def _require_structure_ids(model_cfg: ModelConfig, dataset: ShardedDataset) -> None:
    """A structure-id embedding needs a dataset built with structure ids (a build with
    ``[structure] enabled = false`` stores OTHER for every token)."""
    if not model_cfg.structure.embedding:
        return
    build = dataset.manifest.get("config", {}).get("structure", {})
    if not build.get("enabled", False):
        raise ConfigError(
            f"the model embeds structure ids ([structure] embedding = true) but the dataset "
            f"{dataset.root} has none (built with [structure] enabled = false); rebuild it with "
            "[structure] enabled = true or set [structure] embedding = false")


def _verify_dataset(path: Path) -> None:
    """Check the dataset's marker, manifest and every file's sha256 (raises if any fails)."""
    ShardedDataset.open(path, verify=True)


def _full_batches(loader: PackedLoader, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Endless full micro-batches: epoch after epoch, skipping a rank's last partial batch
    (so every step has the same shape and the same number of rows per rank)."""
    while True:
        for batch in loader:
            if batch["input_ids"].shape[0] == batch_size:
                yield batch


def _describe(error: BaseException | None) -> str | None:
    if error is None:
        return None
    if isinstance(error, MegaCppError):
        return str(error)
    if isinstance(error, KeyboardInterrupt):
        return f"interrupted ({error.args[0] if error.args else 'KeyboardInterrupt'})"
    return "".join(traceback.format_exception_only(type(error), error)).strip()
