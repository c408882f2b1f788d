"""megacpp.posttrain: post-training with the verifier.

- :mod:`~megacpp.posttrain.tasks` -- a generated, verifiable C++ task set (train / held-out);
- :mod:`~megacpp.posttrain.sft` -- supervised fine-tuning on prompt/completion pairs,
  completion-only loss, LoRA or full;
- :mod:`~megacpp.posttrain.grpo` -- group-relative policy optimization with the sandboxed
  verifier as the reward.
"""
