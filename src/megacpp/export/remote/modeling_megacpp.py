"""MegaCpp hybrid language model for transformers (``trust_remote_code``).

Written by ``megacpp export hf``. ``MegaCppForCausalLM`` wraps megacpp's own ``HybridLM``, so
``pip install megacpp`` is needed: the logits are the trained model's, computed by the same
code, for every block family (attention, MLA/DSA, MoE, Mamba-3, gated delta, MTP).

``generate()`` decodes through megacpp's paged caches (attention keys/values or latents,
recurrent states) with the rows of the batch in lockstep (``LockstepCache``), made on the
first forward for ``max_length`` tokens per row: the mixer code ``megacpp generate`` and
``megacpp serve`` decode with, driven by transformers' own generation loop. Beam search, padded batches and assisted
decoding are not supported (the recurrent layers' states cannot be reordered or rolled back);
they stop with an error. ``labels`` give the model's training loss (next-token cross-entropy
plus its auxiliary and MTP losses).
"""

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from megacpp.model.cache import LockstepCache
from megacpp.model.config import ModelConfig
from megacpp.model.features import HashedNgramEmbedding
from megacpp.model.model import IGNORE_INDEX, HybridLM
from megacpp.model.moe import MoE

from .configuration_megacpp import MegaCppConfig


class DecodeState:
    """``generate()``'s cache: a megacpp LockstepCache, made on the first forward (for its
    batch size) with room for ``capacity`` tokens per row."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.cache = None


class MegaCppForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MegaCppConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]  # noqa: RUF012 -- transformers reads a list
    _is_stateful = True  # recurrent states: no assisted decoding

    def __init__(self, config):
        super().__init__(config)
        self.model = HybridLM(ModelConfig.from_saved(config.megacpp))
        self.post_init()

    def _init_weights(self, module):
        """HybridLM initialises its own weights; after loading, only the buffers that are not
        saved need values: the MoE's load counters and the n-gram hash multipliers."""
        if isinstance(module, MoE):
            module.routed_tokens.zero_()
            module.last_load.zero_()
        if isinstance(module, HashedNgramEmbedding):
            module.reset_multipliers()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head  # None: the head is the embedding (tied inside HybridLM)

    # -- generation -----------------------------------------------------------------------
    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # megacpp's own cache (DecodeState), not a transformers Cache

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        if generation_config.num_beams > 1:
            raise ValueError("MegaCppForCausalLM does not support beam search (recurrent layer "
                             "states cannot be reordered); use greedy or sampled decoding")
        if generation_config.use_cache is not False:
            model_kwargs["megacpp_state"] = DecodeState(generation_config.max_length)

    def prepare_inputs_for_generation(self, input_ids, megacpp_state=None, attention_mask=None,
                                      **kwargs):
        if megacpp_state is not None and megacpp_state.cache is not None:
            input_ids = input_ids[:, megacpp_state.cache.length:]  # the tokens not yet cached
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "megacpp_state": megacpp_state}

    # -- forward --------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, labels=None, megacpp_state=None,
                inputs_embeds=None, return_dict=None, **kwargs):
        """input_ids [B, L] -> logits [B, L, V]; with ``labels`` [B, L] (unshifted, -100 to
        ignore) also the loss. ``megacpp_state``: continue from / extend generate()'s cache."""
        if inputs_embeds is not None:
            raise ValueError("MegaCppForCausalLM takes input_ids, not inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("MegaCppForCausalLM runs unpadded rows only (an attention_mask "
                             "with zeros): give prompts of one length, or one at a time")
        if labels is not None:
            shifted = torch.full_like(labels, IGNORE_INDEX)  # labels[t] = the token at t + 1
            shifted[:, :-1] = labels[:, 1:]
            out = self.model(input_ids, labels=shifted)
            return CausalLMOutputWithPast(loss=out.loss, logits=out.logits)
        if megacpp_state is None:
            logits = self.model.logits(self.model.hidden_states(input_ids))
        else:
            if megacpp_state.cache is None:
                megacpp_state.cache = LockstepCache(
                    self.model, input_ids.shape[0], megacpp_state.capacity, input_ids.device,
                    self.model.embed.weight.dtype)
            cache = megacpp_state.cache
            batch = cache.advance(input_ids)
            logits = self.model.forward_paged(input_ids, cache.layers, batch, all_positions=True)
        return CausalLMOutputWithPast(logits=logits)
