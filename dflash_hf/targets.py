"""What differs per target family, and whether a target/drafter pair fits together.

The drafter borrows the target's input embeddings (Gemma's carry the sqrt(hidden) scale inside the
embedding module, so it is applied to every block position, masks included) and its lm_head (draft
logits get the target's `final_logit_softcapping`, as Gemma's target logits do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import PreTrainedModel

if TYPE_CHECKING:  # only for annotations: `dflash-hf export` copies this file into a standalone generate.py
    from .modeling_dflash import DFlashDraftModel


def text_config(target: PreTrainedModel):
    return target.config.get_text_config()


def logit_softcap(target: PreTrainedModel) -> float | None:
    """The target's final logit soft-capping (Gemma), applied to draft logits too."""
    return getattr(text_config(target), "final_logit_softcapping", None)


def is_dflash_drafter(model) -> bool:
    """A DFlash drafter: ours, the same class loaded as remote code (a config with `dflash_config`, even
    an incomplete one, so that `check_compatible` can say what is missing), or any model whose config
    says `block_size`, `mask_token_id` and `target_layer_ids` (transformers' own DFlash drafters)."""
    config = getattr(model, "config", None)
    if getattr(config, "block_size", None) is not None and getattr(config, "dflash_config", None) is not None:
        return True
    return all(getattr(config, name, None) is not None for name in ("block_size", "mask_token_id", "target_layer_ids"))


def compatibility_problems(target: PreTrainedModel, drafter: DFlashDraftModel) -> list[str]:
    """Every reason the pair cannot run together, each naming the fix; empty when it can."""
    if not is_dflash_drafter(drafter):
        return [f"expected a DFlash drafter (dflash_hf.DFlashDraftModel), got {type(drafter).__name__}"]
    if target.get_input_embeddings() is None or target.get_output_embeddings() is None:
        return [
            f"{type(target).__name__} has no input embeddings or no lm_head; load the target with "
            "AutoModelForCausalLM"
        ]
    return config_problems(target.config, drafter.config, target.get_input_embeddings().num_embeddings)


def config_problems(target_config, draft_cfg, embedding_rows: int | None = None) -> list[str]:
    """`compatibility_problems` from the two configs alone (no weights loaded)."""
    target_cfg = target_config.get_text_config()
    problems = []
    if target_cfg.hidden_size != draft_cfg.hidden_size:
        problems.append(
            f"hidden size differs: target {target_cfg.hidden_size}, drafter {draft_cfg.hidden_size}; "
            "use the drafter trained for this target"
        )
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        problems.append(
            f"vocab size differs: target {target_cfg.vocab_size}, drafter {draft_cfg.vocab_size}; "
            "use the drafter trained for this target"
        )
    num_layers = target_cfg.num_hidden_layers
    bad_ids = [i for i in draft_cfg.target_layer_ids if not 0 <= i < num_layers]
    if bad_ids:
        problems.append(
            f"target_layer_ids {bad_ids} are out of range for a target with {num_layers} layers "
            f"(valid: 0..{num_layers - 1}); the drafter was trained for another target"
        )
    if draft_cfg.num_target_layers is not None and draft_cfg.num_target_layers != num_layers:
        problems.append(
            f"the drafter was trained for a {draft_cfg.num_target_layers}-layer target, this one has "
            f"{num_layers} layers; use the drafter trained for this target"
        )
    mask = draft_cfg.mask_token_id
    rows = embedding_rows if embedding_rows is not None else target_cfg.vocab_size
    if mask is None:
        problems.append("the drafter config has no dflash_config.mask_token_id; set it to the id it was trained with")
    elif not 0 <= mask < rows:
        problems.append(f"mask_token_id {mask} is not in the target's vocabulary (0..{rows - 1})")
    return problems


def describe_pair(target_config, draft_cfg) -> list[str]:
    """What DFlash will do with this pair: block, layers read, RoPE, how the target's cache is rolled back."""
    target_cfg = target_config.get_text_config()
    layer_types = list(getattr(target_cfg, "layer_types", None) or [])
    hybrid = any("linear" in kind for kind in layer_types)
    sliding = [i for i, kind in enumerate(draft_cfg.layer_types) if kind == "sliding_attention"]
    lines = [
        f"target: {target_cfg.model_type}, {target_cfg.num_hidden_layers} layers, hidden {target_cfg.hidden_size}, "
        f"vocab {target_cfg.vocab_size}",
        f"drafter: {draft_cfg.num_hidden_layers} layers, block_size {draft_cfg.block_size}, reads target layers "
        f"{draft_cfg.target_layer_ids}, mask token {draft_cfg.mask_token_id}",
        f"drafter RoPE: {(draft_cfg.rope_parameters or {}).get('rope_type', 'default')} "
        f"(theta {(draft_cfg.rope_parameters or {}).get('rope_theta')}); target RoPE: "
        f"{_rope_summary(target_cfg)}",
        "drafter sliding-window layers: " + (f"{sliding} (window {draft_cfg.sliding_window})" if sliding else "none"),
        "target cache: " + (
            "hybrid linear attention, rolled back to the recorded state of the last accepted token" if hybrid
            else "attention only, cropped after rejected drafts"
        ),
    ]
    softcap = getattr(target_cfg, "final_logit_softcapping", None)
    if softcap is not None:
        lines.append(f"draft logits soft-capped at {softcap} like the target's")
    return lines


def _rope_summary(config) -> str:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(value, dict) for value in rope.values()):  # per layer type (Gemma)
        return ", ".join(f"{kind}: {params.get('rope_type', 'default')}" for kind, params in rope.items())
    return f"{rope.get('rope_type', 'default')} (theta {rope.get('rope_theta')})"


def check_compatible(target: PreTrainedModel, drafter: DFlashDraftModel) -> None:
    """Raises a `ValueError` listing every incompatibility of the pair."""
    problems = compatibility_problems(target, drafter)
    if problems:
        raise ValueError("This target and DFlash drafter do not fit together:\n- " + "\n- ".join(problems))
