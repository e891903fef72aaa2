# Copyright 2026 The dflash-hf authors. Apache-2.0.
"""DFlash block-diffusion drafter: configuration and model in one file.

This file is also what `save_pretrained` copies next to the weights for `trust_remote_code=True`
loading, so it imports only torch and transformers.

Semantics (arXiv 2602.06036, z-lab/dflash): a few Qwen3-style decoder layers whose queries come from
the drafted block `[anchor, mask x (block_size - 1)]` (embedded with the *target's* input embeddings)
and whose keys/values come from `[context ; block]`, where the context is the target's hidden states
after `target_layer_ids`, concatenated, projected by `fc` and normalised by `hidden_norm`. Attention
inside the block is bidirectional on full-attention layers. The target's lm_head turns the drafter's
normalised output at block slots 1..block_size-1 into draft logits.
"""

from collections.abc import Callable

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GenerationConfig, PreTrainedModel, Qwen3Config
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

# Written as `model_type` so that vLLM, SGLang and z-lab's loader read what we save unchanged.
CHECKPOINT_MODEL_TYPE = "qwen3"

# Where transformers 4.x's Qwen3Config (z-lab's code pins 4.57.1; vLLM and SGLang pin their own) reads the RoPE
# that transformers 5 keeps only in `rope_parameters`.
LEGACY_ROPE_FIELDS = ("rope_theta", "rope_scaling")


def legacy_rope_fields(rope_parameters) -> dict:
    """`rope_parameters` spelt the transformers 4.x way: `rope_theta`, and `rope_scaling` (the same dict
    without the theta) for a rope type other than default. Without them a 4.x reader silently runs RoPE
    with its defaults, theta 10,000 and no scaling. Empty for per-layer-type RoPE, which 4.x Qwen3 lacks."""
    if not isinstance(rope_parameters, dict) or "rope_theta" not in rope_parameters:
        return {}
    fields = {"rope_theta": rope_parameters["rope_theta"]}
    if rope_parameters.get("rope_type", "default") != "default":
        fields["rope_scaling"] = {key: value for key, value in rope_parameters.items() if key != "rope_theta"}
    return fields


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default `target_layer_ids` of z-lab checkpoints that omit them: the middle layer for a
    one-layer drafter, otherwise `num_draft_layers` ids spread evenly over [1, num_target_layers - 3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def design_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """`target_layer_ids` for a new drafter: the reference spread where its taps are distinct, else
    distinct layers spread over [1, num_target_layers - 2] (the last layer is never a tap: its hidden
    state is the final, normed one). On a shallow target that can be fewer taps than drafter layers."""
    if num_target_layers <= 2:
        return [0]
    reference = build_target_layer_ids(num_target_layers, num_draft_layers)
    if reference == sorted(set(reference)) and reference[0] >= 1 and reference[-1] < num_target_layers - 1:
        return reference
    candidates = list(range(1, num_target_layers - 1))
    if len(candidates) <= num_draft_layers:
        return candidates
    step = (len(candidates) - 1) / (num_draft_layers - 1)
    return sorted({candidates[int(round(i * step))] for i in range(num_draft_layers)})


# Special tokens that a tokenizer may have and its model never produces, tried in order for the mask.
MASK_TOKEN_CANDIDATES = ("<empty_output>", "<mask>", "<|mask|>", "<unk>", "<|fim_pad|>", "<pad>")


def find_mask_token_id(tokenizer, vocab_size: int | None = None) -> int:
    """An existing token id to use as the drafter's mask (the vocabulary is never resized): an unused
    special token when the tokenizer has one (SmolLM2: `<empty_output>`), else its pad/unk token, else the
    last id."""
    vocab = tokenizer.get_vocab()
    limit = vocab_size if vocab_size is not None else len(tokenizer)
    for token in MASK_TOKEN_CANDIDATES:
        index = vocab.get(token)
        if index is not None and index < limit:
            return index
    for index in (tokenizer.pad_token_id, tokenizer.unk_token_id):
        if index is not None and index < limit:
            return index
    return limit - 1


@strict
class DFlashConfig(Qwen3Config):
    r"""
    Configuration of a DFlash drafter: a [`Qwen3Config`] for the drafter's own layers plus

    Args:
        block_size (`int`, defaults to 16):
            Tokens per drafted block, anchor included; fixed when the drafter was trained.
        num_target_layers (`int`, *optional*):
            Decoder layers of the target the drafter was trained against.
        dflash_config (`dict`, *optional*):
            `{"mask_token_id": int, "target_layer_ids": list[int]}` as the z-lab checkpoints store it.
            `target_layer_ids` is derived the reference way when absent. Two optional keys (vLLM, SGLang
            and z-lab's code read only the keys they know) record the chat mode the drafter was trained
            in: `chat_template_kwargs` (e.g. `{"enable_thinking": false}`, what the training prompts were
            rendered with) and `think_token_ids` (`[<think> id, </think> id]` of the target's tokenizer),
            with which a DFlash `generate` warns once when a prompt was rendered in the other mode. A third,
            `draft_vocab` (ascending ids of the target's vocabulary: the tokens of the drafter's training
            labels), makes the drafts come from those tokens only, through those rows of the lm_head, a
            fraction of the full lm_head's cost (verification keeps decoding lossless whatever is drafted).
    """

    model_type = "dflash"

    block_size: int = 16
    num_target_layers: int | None = None
    dflash_config: dict | None = None

    def __post_init__(self, **kwargs):
        sliding_window = self.sliding_window
        super().__post_init__(**kwargs)
        # Qwen3Config drops `sliding_window` unless `use_sliding_window`; DFlash checkpoints mark their
        # sliding layers through `layer_types` alone, so keep the window whenever a layer uses it.
        if "sliding_attention" in self.layer_types:
            if sliding_window is None:
                raise ValueError("`layer_types` has sliding_attention layers but `sliding_window` is not set.")
            self.sliding_window = sliding_window
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"`block_size` must be an int >= 2 (the anchor plus at least one draft), got {self.block_size}.")
        _check_dflash_config(self.dflash_config)
        self.dflash_config = dict(self.dflash_config or {})
        if "target_layer_ids" not in self.dflash_config and self.num_target_layers is not None:
            self.dflash_config["target_layer_ids"] = build_target_layer_ids(
                self.num_target_layers, self.num_hidden_layers
            )

    @classmethod
    def from_target(
        cls,
        target,
        block_size: int = 16,
        num_draft_layers: int = 5,
        mask_token_id: int | None = None,
        tokenizer=None,
        target_layer_ids: list[int] | None = None,
        chat_template_kwargs: dict | None = None,
        **overrides,
    ) -> "DFlashConfig":
        """A config for a new drafter of `target` (a model or its config): the target's layer shape
        (hidden, heads, MLP, RoPE, vocabulary, special tokens) with `num_draft_layers` layers.

        Args:
            mask_token_id (`int`, *optional*): an existing id of the target's vocabulary; found in
                `tokenizer` by `find_mask_token_id` when not given.
            target_layer_ids (`list[int]`, *optional*): default `design_target_layer_ids` (distinct taps).
            chat_template_kwargs (`dict`, *optional*): what the training prompts are rendered with (e.g.
                `{"enable_thinking": False}`), recorded with `set_chat_mode` (`tokenizer` finds the think ids).
            overrides: any other config field (e.g. `layer_types`, `sliding_window`).
        """
        config = getattr(target, "config", target)
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        if mask_token_id is None:
            if tokenizer is None:
                raise ValueError("Pass mask_token_id (an existing id of the target's vocabulary) or the tokenizer to find one.")
            mask_token_id = find_mask_token_id(tokenizer, cfg.vocab_size)
        if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < cfg.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id!r} is outside the target's vocabulary (0..{cfg.vocab_size - 1}).")
        num_target_layers = cfg.num_hidden_layers
        if target_layer_ids:
            layer_ids = [int(i) for i in target_layer_ids]
            if len(set(layer_ids)) != len(layer_ids) or not all(0 <= i < num_target_layers for i in layer_ids):
                raise ValueError(
                    f"target_layer_ids {layer_ids} must be distinct layers of the target (0..{num_target_layers - 1})."
                )
        else:
            layer_ids = design_target_layer_ids(num_target_layers, num_draft_layers)
        heads = cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None)
        if not (isinstance(rope, dict) and "rope_type" in rope):
            rope = {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", None) or 10000.0}
        act = getattr(cfg, "hidden_act", "silu")
        kwargs = dict(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=num_draft_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=dict(rope),
            hidden_act=act if act in ("silu", "gelu") else "silu",
            tie_word_embeddings=False,
            block_size=block_size,
            num_target_layers=num_target_layers,
            dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": layer_ids},
            # the target's special tokens: pipelines compare them to decide whether the tokenizers match
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_id=getattr(cfg, "eos_token_id", None),
            pad_token_id=getattr(cfg, "pad_token_id", None),
        )
        kwargs.update(overrides)
        config = cls(**kwargs)
        if chat_template_kwargs is not None:
            config.set_chat_mode(chat_template_kwargs, tokenizer)
        return config

    @property
    def mask_token_id(self) -> int | None:
        return self.dflash_config.get("mask_token_id")

    @property
    def chat_template_kwargs(self) -> dict:
        """What the training prompts were rendered with (`{}`: unknown)."""
        return dict(self.dflash_config.get("chat_template_kwargs") or {})

    @property
    def think_token_ids(self) -> list[int] | None:
        """`[<think> id, </think> id]` of the target's tokenizer, when recorded."""
        ids = self.dflash_config.get("think_token_ids")
        return list(ids) if ids else None

    def set_chat_mode(self, chat_template_kwargs: dict | None, tokenizer=None, think_token_ids=None) -> None:
        """Records the chat mode the drafter was trained in (`chat_template_kwargs`, e.g.
        `{"enable_thinking": False}`; None forgets it) and the ids of `<think>`/`</think>` (given, or looked up
        in `tokenizer`; left out when it has no such tokens), which the prompt check of `generate` needs."""
        update = {}
        if chat_template_kwargs is not None:
            if think_token_ids is None and tokenizer is not None:
                vocab = tokenizer.get_vocab()
                think_token_ids = [vocab.get("<think>"), vocab.get("</think>")]
                think_token_ids = None if None in think_token_ids else think_token_ids
            update["chat_template_kwargs"] = dict(chat_template_kwargs)
            if think_token_ids is not None:
                update["think_token_ids"] = list(think_token_ids)
            _check_dflash_config(update)
        for key in ("chat_template_kwargs", "think_token_ids"):
            self.dflash_config.pop(key, None)
        self.dflash_config.update(update)

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config.get("target_layer_ids") or [])

    @property
    def draft_vocab(self) -> list[int] | None:
        """The target's token ids the drafts are proposed from (None: the whole vocabulary)."""
        ids = self.dflash_config.get("draft_vocab")
        return list(ids) if ids else None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs) -> "DFlashConfig":
        # Same as PreTrainedConfig.from_pretrained minus its warning about `model_type: qwen3`, which is
        # what every DFlash checkpoint says; `from_dict` checks that it really is a DFlash config.
        config_dict, kwargs = cls.get_config_dict(pretrained_model_name_or_path, **kwargs)
        return cls.from_dict(config_dict, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        missing = [key for key in ("block_size", "dflash_config") if key not in config_dict]
        if missing:
            raise ValueError(
                f"This is not a DFlash drafter config (model_type={config_dict.get('model_type')!r}, missing "
                f"{missing}). A DFlash checkpoint's config.json has `block_size` and `dflash_config: "
                "{mask_token_id, target_layer_ids}`; load targets with AutoModelForCausalLM instead."
            )
        _check_dflash_config(config_dict["dflash_config"])
        # `rope_parameters` is the RoPE; the `rope_theta`/`rope_scaling` beside it are only its transformers 4
        # spelling (see `to_dict`), dropped so that transformers 5 never reads them (or warns) on top of it.
        legacy = LEGACY_ROPE_FIELDS if config_dict.get("rope_parameters") is not None else ()
        config_dict = {key: value for key, value in config_dict.items() if key != "model_type" and key not in legacy}
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self) -> dict:
        output = super().to_dict()
        output["model_type"] = CHECKPOINT_MODEL_TYPE
        output.update(legacy_rope_fields(output.get("rope_parameters")))
        return output


class DFlashAttention(nn.Module):
    """Block queries attend to `[cached context ; new context ; block]` keys/values."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False  # read by transformers' attention functions
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        # hidden_states: [b, Lq, hidden] (block), context: [b, Lc, hidden], cos/sin: [b, Lc + Lq, D]
        bsz, q_len = hidden_states.shape[:2]
        kv_input = torch.cat([context, hidden_states], dim=1)
        query = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_input).view(bsz, kv_input.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(bsz, kv_input.shape[1], -1, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query, _ = apply_rotary_pos_emb(query, query, cos[:, -q_len:], sin[:, -q_len:])
        key, _ = apply_rotary_pos_emb(key, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        if attention_mask is not None and attention_mask.shape[-1] > key.shape[-2]:
            # A sliding-window cache layer (transformers' DFlashCache built from this config) returns only
            # its most recent keys; the ones it dropped are the oldest, outside the window anyway.
            attention_mask = attention_mask[..., -key.shape[-2] :]

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            # Sliding layers are trained causal inside the block (SpecForge); full layers are not.
            is_causal=self.sliding_window is not None,
            **kwargs,
        )
        return self.o_proj(attn_output.reshape(bsz, q_len, -1))


class DFlashDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, position_embeddings, attention_mask, cache=None, **kwargs):
        # The context is already normalised by `hidden_norm`; only the block goes through the layer norms.
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, cache, **kwargs
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True


class DFlashDraftModel(DFlashPreTrainedModel):
    """The DFlash drafter. It has no embeddings and no lm_head: it borrows the target's."""

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        if not config.target_layer_ids:
            raise ValueError(
                "The drafter config has no `dflash_config.target_layer_ids` and no `num_target_layers` to derive them from."
            )
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        # Read by transformers' assisted generation before it would call `generate`, which explains the fix.
        self.generation_config = GenerationConfig()
        self.last_stats = None
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int | None:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> "DFlashDraftModel":
        """Loads a DFlash checkpoint (Hub id or local folder; safetensors only), checking that every
        drafter weight is present with the right shape: `transformers` would only warn and leave
        random weights behind, which drafts garbage silently."""
        want_info = kwargs.pop("output_loading_info", False)
        kwargs["use_safetensors"] = True
        kwargs["ignore_mismatched_sizes"] = True  # reported below, with every other problem, then raised
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        except Exception as error:
            # Only missing, truncated or corrupt files are rephrased; anything else (a bad kwarg, a
            # missing attention package, no CUDA) propagates as raised.
            if not _is_weights_file_error(error):
                raise
            raise ValueError(
                f"Could not load DFlash drafter weights from {pretrained_model_name_or_path!r}: {error}. "
                "A DFlash checkpoint folder holds config.json and model.safetensors (or sharded safetensors "
                "with an index); re-download or re-export it."
            ) from error
        problems = []
        if info["missing_keys"]:
            problems.append(f"missing weights {sorted(info['missing_keys'])}")
        if info["mismatched_keys"]:
            problems.append(f"weights with wrong shapes {[key for key, *_ in info['mismatched_keys']]}")
        if problems:
            raise ValueError(
                f"{pretrained_model_name_or_path!r} is not a complete DFlash drafter: {'; '.join(problems)}. "
                "Expected layers.N.self_attn.{q,k,v,o}_proj, q_norm, k_norm, mlp.*, input_layernorm, "
                "post_attention_layernorm, fc, hidden_norm and norm, shaped as config.json says."
            )
        return (model, info) if want_info else model

    def _supports_logits_to_keep(self) -> bool:
        return False  # the drafter has no lm_head; asked by transformers' assisted generation

    def generate(self, *args, **kwargs):
        raise ValueError(
            "A DFlash drafter does not generate on its own: pass it to the target, "
            "`target.generate(..., assistant_model=drafter, speculation_type=\"dflash\")` with stock transformers, "
            "or `dflash_hf.enable(target)` once, then `target.generate(..., assistant_model=drafter)`."
        )

    def _attention_masks(self, attention_mask, q_len, kv_len, device, dtype) -> dict[str, torch.Tensor | None]:
        """Additive [b, 1, Lq, Lk] masks per layer type, or None where every key is visible.

        Key j and query i sit at sequence indices j and kv_len - q_len + i. Full layers see every
        (non-padding) key; sliding layers see keys with 0 <= query - key < sliding_window.
        """
        flash = self.config._attn_implementation.startswith(("flash", "paged"))
        # flash and the diffusion_block kernel (dflash_hf.kernels) apply the window and in-block causality themselves
        applies_window = flash or self.config._attn_implementation == "diffusion_block"
        masks: dict[str, torch.Tensor | None] = {}
        padding = None
        if attention_mask is not None and not bool(attention_mask.all()):
            if flash:
                raise ValueError("Padded inputs need attn_implementation='sdpa' or 'eager' in the drafter.")
            padding = attention_mask[:, None, None, :kv_len].bool()
        masks["full_attention"] = None if padding is None else _to_additive(padding, dtype)
        if "sliding_attention" in self.config.layer_types:
            if applies_window and padding is None:
                masks["sliding_attention"] = None
            else:
                query_index = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
                key_index = torch.arange(kv_len, device=device)[None, :]
                distance = query_index - key_index
                allowed = ((distance >= 0) & (distance < self.config.sliding_window))[None, None]
                masks["sliding_attention"] = _to_additive(allowed if padding is None else allowed & padding, dtype)
        return masks

    def _prepared_masks(self, attention_mask, dtype) -> dict[str, torch.Tensor]:
        """Per layer type additive 4-D masks from the caller's 4-D mask (or dict of them)."""
        if self.config._attn_implementation not in ("sdpa", "eager"):
            raise ValueError("4-D attention masks need attn_implementation='sdpa' or 'eager' in the drafter.")
        if not isinstance(attention_mask, dict):
            attention_mask = dict.fromkeys(self.config.layer_types, attention_mask)
        missing = set(self.config.layer_types) - set(attention_mask)
        if missing:
            raise ValueError(f"attention_mask has no mask for the {sorted(missing)} layers of this drafter.")
        return {kind: _to_additive(mask, dtype) if mask.dtype == torch.bool else mask.to(dtype)
                for kind, mask in attention_mask.items()}

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        r"""
        Called the way transformers' `DFlashTokenCandidateGenerator` calls a drafter (keyword names
        included), so stock `generate(..., speculation_type="dflash")` runs this model too.

        Args:
            noise_embeds (`torch.Tensor` of shape `(batch, block_size, hidden)`):
                The target's input embeddings of the block `[anchor, mask, ..., mask]`.
            context_hidden_states (`torch.Tensor` of shape `(batch, ctx_len, len(target_layer_ids) * hidden)`):
                The target's hidden states after `target_layer_ids` (`hidden_states[i + 1]`), concatenated,
                for the committed tokens not yet in `cache` (`ctx_len` may be 0).
            position_ids (`torch.LongTensor` of shape `(batch, ctx_len + block_size)`):
                Absolute positions of those context tokens followed by the block's.
            attention_mask (`torch.Tensor` of shape `(batch, cached_len + ctx_len + block_size)`, *optional*):
                1 for real tokens, 0 for padding, over every key the block attends to. Or prepared
                `(batch, 1, q_len, kv_len)` masks (boolean: may attend; or additive), one tensor or a dict
                per layer type (`"full_attention"`, `"sliding_attention"`): training runs many blocks
                in one forward this way, each under its own block mask.
            cache (`Cache`, *optional*):
                The drafter's cache of committed context. The block's keys/values are appended too;
                crop them off (`crop(-block_size)`) before the next step.
        Returns:
            [`BaseModelOutputWithPast`] whose `last_hidden_state` (`(batch, block_size, hidden)`) goes
            through the target's lm_head; slot k predicts the token k positions after the anchor.
        """
        q_len = noise_embeds.shape[1]
        context = self.hidden_norm(self.fc(context_hidden_states.to(self.fc.weight.dtype)))
        hidden_states = noise_embeds.to(context.dtype)
        cached_len = cache.get_seq_length() if cache is not None else 0
        kv_len = cached_len + context.shape[1] + q_len
        if isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.ndim == 4):
            masks = self._prepared_masks(attention_mask, hidden_states.dtype)
        else:
            masks = self._attention_masks(attention_mask, q_len, kv_len, hidden_states.device, hidden_states.dtype)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, context, position_embeddings, masks[layer.attention_type], cache, **kwargs
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


def _check_dflash_config(dflash_config) -> None:
    """The z-lab `dflash_config` entry, checked before anything reads it."""
    if dflash_config is None:
        return
    expected = '`dflash_config: {"mask_token_id": int, "target_layer_ids": [int, ...]}`'
    if not isinstance(dflash_config, dict):
        raise ValueError(f"A DFlash config needs {expected}, got {type(dflash_config).__name__}: {dflash_config!r}.")
    mask = dflash_config.get("mask_token_id")
    if mask is not None and (isinstance(mask, bool) or not isinstance(mask, int)):
        raise ValueError(f"dflash_config.mask_token_id must be an int token id, got {mask!r}; expected {expected}.")
    ids = dflash_config.get("target_layer_ids")
    if ids is not None and (
        not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ValueError(f"dflash_config.target_layer_ids must be a list of ints, got {ids!r}; expected {expected}.")
    kwargs = dflash_config.get("chat_template_kwargs")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise ValueError(f"dflash_config.chat_template_kwargs must be a dict of chat template arguments (e.g. "
                         f'{{"enable_thinking": false}}), got {kwargs!r}.')
    think = dflash_config.get("think_token_ids")
    if think is not None and not (
        isinstance(think, (list, tuple)) and len(think) == 2
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in think)
    ):
        raise ValueError(f"dflash_config.think_token_ids must be [<think> id, </think> id], got {think!r}.")
    vocab = dflash_config.get("draft_vocab")
    if vocab is not None and not (
        isinstance(vocab, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in vocab)
        and all(a < b for a, b in zip([-1, *vocab], vocab))  # ascending, from 0 up
    ):
        raise ValueError("dflash_config.draft_vocab must be ascending distinct token ids of the target's vocabulary "
                         f"(the drafter's training labels), got {str(vocab)[:80]}.")


def _is_weights_file_error(error: Exception) -> bool:
    # safetensors' own error type is matched by name: this file imports only torch and transformers.
    return isinstance(error, (OSError, EOFError)) or type(error).__name__ in ("SafetensorError", "JSONDecodeError") or (
        isinstance(error, RuntimeError) and "safetensors" in str(error).lower()
    )


def _to_additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashPreTrainedModel",
    "build_target_layer_ids",
    "design_target_layer_ids",
    "find_mask_token_id",
]
