"""Model configuration: one dataclass per block family, loaded from TOML and validated.

Every field is checked on load; an error names the field (``moe.top_k``) and the allowed
values. Unknown keys are rejected (a typo never silently falls back to a default).

A preset is a TOML file shipped in ``megacpp/configs/models/`` (``tiny``, ``nam56r-small``,
...) or any TOML file with a
``[model]`` table and one table per family::

    [model]        pattern, vocab_size, d_model, norm_eps, tie_embeddings, init_std
    [attention]    n_heads, n_kv_heads, head_dim, rope_base, qk_norm
    [mamba]        d_state, headdim, expand, ngroups, chunk_size, rope_fraction, outproj_norm,
                   mimo_rank, mimo_chunk_size                 (the last two: M:mimo only)
    [rnn]          n_heads, head_k_dim, head_v_dim, conv_size, chunk_size
    [moe]          n_experts, top_k, n_shared_experts, expert_ffn, bias_update_rate,
                   seq_aux_loss_coef, routed_scaling
    [mlp]          ffn
    [mla]          n_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                   v_head_dim, rope_base                      (A:mla, and A:dsa's attention)
    [dsa]          index_n_heads, index_head_dim, top_k, mode, indexer_loss_coef, query_chunk,
                   index_from                                 (the index cache)
    [mtp]          depth, loss_weight, pattern                (multi-token prediction)
    [structure]    embedding                                  (structure-id embedding)
    [ngram]        orders, table_size, hash_seed              (hashed n-gram embedding)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from megacpp import configs
from megacpp._config import build_section, check, parse_toml, read_toml
from megacpp.errors import ConfigError
from megacpp.pattern import PatternError, load, require_buildable


@dataclass(frozen=True)
class AttentionConfig:
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 64
    rope_base: float = 10000.0
    qk_norm: bool = True


@dataclass(frozen=True)
class MambaConfig:
    d_state: int = 128
    headdim: int = 64
    expand: int = 2
    ngroups: int = 1
    chunk_size: int = 64
    rope_fraction: float = 0.5
    # per-head RMSNorm of the scan output before the silu(z) gate (mamba_ssm's
    # is_outproj_norm); without it the output is unbounded and training diverges (docs/mamba3.md)
    outproj_norm: bool = True
    # rank R of each token's state update in M:mimo layers (R B/C vectors and R copies of x
    # per head), and their chunk length: a chunk's score tile is (chunk * R)^2, so mamba_ssm
    # recommends 64 / R. M:siso layers ignore both (they use chunk_size)
    mimo_rank: int = 4
    mimo_chunk_size: int = 16


@dataclass(frozen=True)
class RnnConfig:
    n_heads: int = 4
    head_k_dim: int = 64
    head_v_dim: int = 64
    conv_size: int = 4
    chunk_size: int = 64


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int = 16
    top_k: int = 2
    n_shared_experts: int = 1
    expert_ffn: int = 512
    bias_update_rate: float = 1e-3
    seq_aux_loss_coef: float = 0.0
    routed_scaling: float = 1.0


@dataclass(frozen=True)
class MlpConfig:
    ffn: int = 1408


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3); ``q_lora_rank = 0`` means a full-rank
    query projection."""

    n_heads: int = 8
    q_lora_rank: int = 0
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    rope_base: float = 10000.0


DSA_MODES = ("dense_warmup", "sparse")


@dataclass(frozen=True)
class DsaConfig:
    """DeepSeek sparse attention (V3.2): a lightning indexer picks ``top_k`` keys per query.

    ``mode``: ``dense_warmup`` attends densely and trains the indexer toward the dense
    attention distribution; ``sparse`` attends over the indexer's top-k keys only.

    ``index_from`` (the index cache): one entry per A:dsa layer of the main stack, in pattern
    order -- ``-1`` for a layer with its own indexer, or the 0-based layer index of an earlier
    A:dsa layer (with its own indexer, in the same pipeline stage) whose top-k selection the
    layer reuses instead; such a layer has no indexer. Empty (the default): every A:dsa layer
    has its own. A config list rather than a pattern variant: the pattern says what each layer
    is, while this links two layers, which a letter's own variant cannot name."""

    index_n_heads: int = 4
    index_head_dim: int = 64
    top_k: int = 2048
    mode: str = "sparse"
    indexer_loss_coef: float = 1.0
    query_chunk: int = 128
    index_from: tuple[int, ...] = ()


@dataclass(frozen=True)
class MtpConfig:
    """Multi-token prediction (DeepSeek-V3): ``depth`` extra sequential modules (0: off),
    each one sublayer stack written as a pattern (``pattern``, e.g. ``"A:mla E"``)."""

    depth: int = 0
    loss_weight: float = 0.3
    pattern: str = "AE"


@dataclass(frozen=True)
class StructureConfig:
    """A learned embedding of each token's tree-sitter structure id
    (``megacpp.data.structure.Structure``), added to the token embedding (see
    ``model/features.py``). Off by default."""

    embedding: bool = False


MAX_NGRAM_ORDER = 8
MAX_NGRAM_TABLE = 1 << 24


@dataclass(frozen=True)
class NgramConfig:
    """Hashed n-gram embedding (Engram-style): for each order n in ``orders``, the last n
    tokens are hashed (seeded by ``hash_seed``) into a table of ``table_size`` rows of
    d_model, and the rows are added to the token embedding (see ``model/features.py``).
    ``orders = []`` (the default) turns the branch off."""

    orders: tuple[int, ...] = ()
    table_size: int = 16384
    hash_seed: int = 0


@dataclass(frozen=True)
class ModelConfig:
    pattern: str = "AEMEAEMEAEMR"
    vocab_size: int = 32768
    d_model: int = 512
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mamba: MambaConfig = field(default_factory=MambaConfig)
    rnn: RnnConfig = field(default_factory=RnnConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mlp: MlpConfig = field(default_factory=MlpConfig)
    mla: MlaConfig = field(default_factory=MlaConfig)
    dsa: DsaConfig = field(default_factory=DsaConfig)
    mtp: MtpConfig = field(default_factory=MtpConfig)
    structure: StructureConfig = field(default_factory=StructureConfig)
    ngram: NgramConfig = field(default_factory=NgramConfig)

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_saved(cls, data: dict[str, Any]) -> ModelConfig:
        """:meth:`from_dict` of a config a trained model was saved with (a checkpoint's or an
        export's). A saved config is complete, so a field it lacks was added later, and the
        model was built the way it was before that: a ``mamba`` table without
        ``outproj_norm`` is of Mamba-3 layers without the output norm."""
        if isinstance(data, dict) and isinstance(data.get("mamba"), dict):
            data = {**data, "mamba": {"outproj_norm": False, **data["mamba"]}}
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from ``{"model": {...}, "attention": {...}, ...}``; validates everything."""
        if not isinstance(data, dict):
            raise ConfigError(f"model config must be a table, got {type(data).__name__}")
        sections = {
            name for name, hint in get_type_hints(cls).items() if dataclasses.is_dataclass(hint)
        }
        unknown = sorted(set(data) - sections - {"model"})
        if unknown:
            raise ConfigError(
                f"unknown config table(s) {unknown}; allowed: {sorted(sections | {'model'})}"
            )
        top = build_section(cls, data.get("model", {}), "model", skip=sections)
        subs = {
            name: build_section(get_type_hints(cls)[name], data.get(name, {}), name)
            for name in sorted(sections)
        }
        cfg = dataclasses.replace(top, **subs)
        cfg.validate()
        return cfg

    @classmethod
    def from_toml(cls, path: str | Path) -> ModelConfig:
        """A model config file: it must name its layer pattern (``[model] pattern``), so that
        an empty or unrelated TOML file is an error rather than the default model."""
        path = Path(path)
        data = read_toml(path, "model config")
        return cls._from_data(data, str(path))

    @classmethod
    def from_toml_text(cls, text: str, source: str) -> ModelConfig:
        """Parse and validate TOML text; errors start with ``source`` (a path or a name)."""
        return cls._from_data(parse_toml(text, source), source)

    @classmethod
    def _from_data(cls, data: dict[str, Any], source: str) -> ModelConfig:
        model = data.get("model")
        if not isinstance(model, dict) or "pattern" not in model:
            raise ConfigError(f"model config {source} has no [model] pattern: a model config "
                              "names its layers (see the shipped presets, e.g. tiny)")
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": {}}
        for f in fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                table = dataclasses.asdict(value)
                # lists, as JSON and TOML read them back (a saved config compares equal)
                out[f.name] = {k: list(v) if isinstance(v, tuple) else v for k, v in table.items()}
            else:
                out["model"][f.name] = value
        return out

    # -- validation --------------------------------------------------------------------------
    def validate(self) -> None:
        a, m, r, e = self.attention, self.mamba, self.rnn, self.moe
        _positive(self, "model", ("vocab_size", "d_model"))
        _positive(a, "attention", ("n_heads", "n_kv_heads", "head_dim"))
        _positive(m, "mamba", ("d_state", "headdim", "expand", "ngroups", "chunk_size",
                               "mimo_chunk_size"))
        check(1 <= m.mimo_rank <= MAX_MIMO_RANK, "mamba.mimo_rank", m.mimo_rank,
              f"an integer in [1, {MAX_MIMO_RANK}]")
        _positive(r, "rnn", ("n_heads", "head_k_dim", "head_v_dim", "conv_size", "chunk_size"))
        _positive(e, "moe", ("n_experts", "top_k", "expert_ffn"))
        _positive(self.mlp, "mlp", ("ffn",))
        check(0 < self.norm_eps < 1, "model.norm_eps", self.norm_eps, "a float in (0, 1)")
        check(0 < self.init_std < 1, "model.init_std", self.init_std, "a float in (0, 1)")
        check(a.rope_base > 1, "attention.rope_base", a.rope_base, "a float > 1")
        check(a.head_dim % 2 == 0, "attention.head_dim", a.head_dim, "an even integer (RoPE)")
        check(
            a.n_heads % a.n_kv_heads == 0,
            "attention.n_kv_heads",
            a.n_kv_heads,
            f"a divisor of attention.n_heads={a.n_heads}",
        )
        check(m.d_state % 2 == 0, "mamba.d_state", m.d_state, "an even integer (rotary pairs)")
        d_inner = m.expand * self.d_model
        check(
            d_inner % m.headdim == 0,
            "mamba.headdim",
            m.headdim,
            f"a divisor of mamba.expand * model.d_model = {d_inner}",
        )
        n_mamba_heads = d_inner // m.headdim
        check(
            n_mamba_heads % m.ngroups == 0,
            "mamba.ngroups",
            m.ngroups,
            f"a divisor of the number of Mamba heads ({n_mamba_heads})",
        )
        check(
            0 < m.rope_fraction <= 1 and int(m.d_state * m.rope_fraction) >= 2,
            "mamba.rope_fraction",
            m.rope_fraction,
            "in (0, 1], rotating at least one pair of mamba.d_state",
        )
        check(e.top_k <= e.n_experts, "moe.top_k", e.top_k, f"<= moe.n_experts={e.n_experts}")
        check(e.n_shared_experts >= 0, "moe.n_shared_experts", e.n_shared_experts, ">= 0")
        check(e.bias_update_rate >= 0, "moe.bias_update_rate", e.bias_update_rate, ">= 0")
        check(e.seq_aux_loss_coef >= 0, "moe.seq_aux_loss_coef", e.seq_aux_loss_coef, ">= 0")
        check(e.routed_scaling > 0, "moe.routed_scaling", e.routed_scaling, "> 0")
        self._validate_mla_dsa()
        self._validate_mtp()
        self._validate_ngram()

    def _validate_mla_dsa(self) -> None:
        mla, dsa = self.mla, self.dsa
        _positive(
            mla,
            "mla",
            ("n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
        )
        check(mla.q_lora_rank >= 0, "mla.q_lora_rank", mla.q_lora_rank, ">= 0 (0: full rank)")
        check(mla.rope_base > 1, "mla.rope_base", mla.rope_base, "a float > 1")
        check(
            mla.qk_rope_head_dim % 2 == 0,
            "mla.qk_rope_head_dim",
            mla.qk_rope_head_dim,
            "an even integer (RoPE)",
        )
        _positive(dsa, "dsa", ("index_n_heads", "index_head_dim", "top_k", "query_chunk"))
        check(dsa.mode in DSA_MODES, "dsa.mode", dsa.mode, " or ".join(map(repr, DSA_MODES)))
        check(dsa.indexer_loss_coef >= 0, "dsa.indexer_loss_coef", dsa.indexer_loss_coef, ">= 0")
        check(
            mla.qk_rope_head_dim <= dsa.index_head_dim,
            "dsa.index_head_dim",
            dsa.index_head_dim,
            f">= mla.qk_rope_head_dim={mla.qk_rope_head_dim} (the indexer ropes that many dims)",
        )
        self._validate_index_from()

    def _validate_index_from(self) -> None:
        """``dsa.index_from``: one entry per A:dsa layer, each -1 or an earlier A:dsa layer
        of the same stage that has its own indexer."""
        index_from = self.dsa.index_from
        if not index_from:
            return
        layers = load(self.pattern).layers
        dsa = [s.index for s in layers if (s.family, s.variant) == ("A", "dsa")]
        own = {layer for layer, source in zip(dsa, index_from, strict=False) if source < 0}
        check(len(index_from) == len(dsa), "dsa.index_from", list(index_from),
              f"one entry per A:dsa layer: {len(dsa)} (layers {dsa})")
        for layer, source in zip(dsa, index_from, strict=True):
            if source == -1:
                continue
            check(source in own and source < layer and layers[source].stage == layers[layer].stage,
                  "dsa.index_from", list(index_from),
                  f"-1 or an earlier A:dsa layer of the same stage with its own indexer "
                  f"(-1 entry) for layer {layer}; such layers: {sorted(own)}")

    def _validate_mtp(self) -> None:
        mtp = self.mtp
        check(mtp.depth >= 0, "mtp.depth", mtp.depth, ">= 0 (0 disables multi-token prediction)")
        check(mtp.loss_weight >= 0, "mtp.loss_weight", mtp.loss_weight, ">= 0")
        try:
            plan = load(mtp.pattern)
            require_buildable(plan)
        except PatternError as exc:
            raise ConfigError(f"mtp.pattern = {mtp.pattern!r} is invalid: {exc}") from None
        check(
            len(plan.stage_sizes) == 1,
            "mtp.pattern",
            mtp.pattern,
            "one stage (no '|': an MTP module is not split over pipeline stages)",
        )

    def _validate_ngram(self) -> None:
        ng = self.ngram
        check(
            all(2 <= n <= MAX_NGRAM_ORDER for n in ng.orders)
            and list(ng.orders) == sorted(set(ng.orders)),
            "ngram.orders",
            list(ng.orders),
            f"strictly increasing integers in [2, {MAX_NGRAM_ORDER}] ([] turns the branch off)",
        )
        check(1 <= ng.table_size <= MAX_NGRAM_TABLE, "ngram.table_size", ng.table_size,
              f"an integer in [1, {MAX_NGRAM_TABLE}]")
        check(0 <= ng.hash_seed < 2**63, "ngram.hash_seed", ng.hash_seed, "an integer in [0, 2^63)")

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba.expand * self.d_model


# -- presets ------------------------------------------------------------------------------
def list_presets() -> list[str]:
    """The shipped model presets (``megacpp/configs/models/*.toml``)."""
    return configs.names("model")


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A shipped preset name (``tiny``) or a path to a TOML file."""
    if configs.is_path(name_or_path):
        return ModelConfig.from_toml(name_or_path)
    text = configs.shipped("model", name_or_path)
    if text is None:
        raise ConfigError(
            f"unknown preset {str(name_or_path)!r}; presets: {', '.join(list_presets())} "
            "(or pass a path to a .toml file)"
        )
    return ModelConfig.from_toml_text(text, f"preset {name_or_path}")


def config_from_pattern(pattern: str, preset: str | Path = "tiny", **overrides: Any) -> ModelConfig:
    """A validated model config: ``preset`` (a shipped name or a TOML path) with ``pattern``
    (a pattern string such as ``"AEMR"`` or a named one such as ``"NAM56R"``) and overrides.

    Overrides are ``[model]`` keys (``d_model=256``, ``vocab_size=4096``) or whole tables as
    dicts (``attention={"n_heads": 4}``). Every value is checked; a bad pattern or key raises
    :class:`~megacpp.errors.ConfigError` naming it and what is accepted.
    """
    data = load_config(preset).to_dict()
    data["model"]["pattern"] = pattern
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        elif isinstance(value, dict):
            data[key] = value  # an unknown table: from_dict names it
        else:
            data["model"][key] = value
    cfg = ModelConfig.from_dict(data)
    try:
        require_buildable(load(cfg.pattern))
    except PatternError as exc:
        raise ConfigError(f"pattern {pattern!r} is invalid: {exc}") from None
    return cfg


# -- helpers --------------------------------------------------------------------------------
MAX_DIM = 1 << 20  # any one size of a model (width, heads, experts, vocabulary) at most
# the MIMO chunked scan's score tiles are (chunk * R)^2 per head: past 16 they outgrow memory
MAX_MIMO_RANK = 16


def _positive(obj: Any, section: str, names: tuple[str, ...]) -> None:
    for n in names:
        v = getattr(obj, n)
        check(0 < v <= MAX_DIM, f"{section}.{n}", v, f"a positive integer <= {MAX_DIM}")
