"""MegaCpp hybrid language model: the transformers configuration (``trust_remote_code``).

Written by ``megacpp export hf``. ``megacpp`` holds megacpp's whole model config
(``ModelConfig.to_dict()``: pattern, widths, one table per block family); the usual names
(``vocab_size``, ``hidden_size``, ``num_hidden_layers``) mirror it for tools that read them.
"""

from transformers import PretrainedConfig


class MegaCppConfig(PretrainedConfig):
    model_type = "megacpp"

    def __init__(self, megacpp=None, pattern="", vocab_size=0, hidden_size=0,
                 num_hidden_layers=0, train_seq_len=None, megacpp_version="", **kwargs):
        self.megacpp = dict(megacpp or {})
        self.pattern = pattern
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.train_seq_len = train_seq_len
        self.megacpp_version = megacpp_version
        kwargs.setdefault("tie_word_embeddings", False)  # HybridLM ties inside itself
        super().__init__(**kwargs)
