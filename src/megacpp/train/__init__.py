"""megacpp.train: the trainer (docs/training.md).

- :mod:`~megacpp.train.config` -- the run config (``load_run_config``, ``RunConfig``);
- :mod:`~megacpp.train.trainer` -- ``train(run_config) -> RunResult``;
- :mod:`~megacpp.train.parallelize` -- DDP / FSDP2 / activation checkpointing / compile;
- :mod:`~megacpp.train.optim` -- AdamW + Muon and the parameter grouping;
- :mod:`~megacpp.train.schedule` -- warmup + cosine / WSD / constant;
- :mod:`~megacpp.train.checkpoint` -- DCP checkpoints, exact resume, ``load_trained_model``;
- :mod:`~megacpp.train.guards` -- non-finite loss/gradient stop, loss-spike warnings;
- :mod:`~megacpp.train.metrics` / :mod:`~megacpp.train.plot` -- metrics.jsonl and PNG plots.

Submodules are imported on use (torch.distributed is heavy).
"""
