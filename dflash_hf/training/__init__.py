"""Distilling a DFlash drafter for a Hugging Face causal LM target (`dflash-hf train`).

- `data`: offline prompts, target-regenerated responses, cached target features;
- `objective`: anchors, the block attention mask, the decayed block cross-entropy;
- `trainer`: the accelerate loop (resume, progress bar) and `distill`, the whole recipe.
"""

from .objective import block_attention_allowed, dflash_loss, slot_weights
from .trainer import TrainConfig, distill, save_drafter, train_drafter

__all__ = [
    "TrainConfig",
    "block_attention_allowed",
    "dflash_loss",
    "distill",
    "save_drafter",
    "slot_weights",
    "train_drafter",
]
