"""A model with an M:mimo layer on a real dataset: it trains and checkpoints, and the serving
engine's greedy completions (prefill + recurrent decode through the state pool) are the
tokens a full forward over prompt + completion picks."""

from __future__ import annotations

import copy
import io
import math

import torch
from rich.console import Console

from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.sampling import SamplingParams
from megacpp.model.mamba3_mimo import Mamba3MimoMixer
from megacpp.pretrained import load_pretrained
from megacpp.train.config import load_run_config
from megacpp.train.trainer import train
from tests.train.helpers import TINY_MODEL, run_config, train_losses, write_config


def test_a_mimo_model_trains_checkpoints_and_serves_its_full_forwards_tokens(tmp_path,
                                                                            cpp_dataset):
    config = run_config(cpp_dataset, tmp_path / "run", train={"steps": 4, "eval_every": 2})
    mamba = {**copy.deepcopy(TINY_MODEL["mamba"]), "mimo_rank": 2, "mimo_chunk_size": 8}
    config["model"].update(pattern="AM:mimoE", mamba=mamba)
    cfg = load_run_config(write_config(tmp_path / "run.toml", config), [])
    result = train(cfg, console=Console(file=io.StringIO()))
    losses = train_losses(result.run_dir)
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)

    lm = load_pretrained(result.run_dir)  # the newest checkpoint (step 4)
    mixer = lm.model.blocks[1].mixer
    assert isinstance(mixer, Mamba3MimoMixer) and mixer.mimo_rank == 2
    assert not torch.equal(mixer.mimo_x, torch.full_like(mixer.mimo_x, 0.5))  # it trained

    model = lm.model.double().eval()
    engine = Engine(model, lm.tokenizer, EngineConfig(max_num_seqs=4, block_size=4,
                                                      max_model_len=64, prefill_chunk=8))
    g = torch.Generator().manual_seed(0)
    prompts = {str(n): [lm.tokenizer.bos_id, *torch.randint(3, 400, (n,), generator=g).tolist()]
               for n in (4, 11, 19)}
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    completions = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            completions[out.request_id] += out.new_token_ids
    assert len({t for c in completions.values() for t in c}) > 3  # the tokens really vary
    for rid, prompt in prompts.items():
        tokens = completions[rid]
        assert len(tokens) == 10
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0]
        picked = logits[len(prompt) - 1: -1].argmax(-1).tolist()
        assert picked == tokens, rid
