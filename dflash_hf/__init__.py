"""DFlash block-diffusion speculative decoding for Hugging Face transformers.

    import dflash_hf
    drafter = dflash_hf.DFlashDraftModel.from_pretrained("z-lab/Qwen3-8B-DFlash-b16")
    dflash_hf.enable(target)                                  # or: dflash_hf.generate(target, **inputs, ...)
    target.generate(**inputs, assistant_model=drafter)
    dflash_hf.pack_linears(target)                            # on a CPU: the packed fast path, plain and DFlash
"""

from transformers import AutoConfig, AutoModel

from .generation import (
    DFlashCandidateGenerator,
    DFlashGenerateOutput,
    DFlashStats,
    dflash_decode,
    enable,
    generate,
    is_enabled,
)
from .modeling_dflash import DFlashConfig, DFlashDraftModel
from .packed import pack_linears, unpack_linears
from .targets import check_compatible, compatibility_problems

__version__ = "0.1.0"

# New entries only: `dflash` was no model type before, so no existing mapping changes.
AutoConfig.register(DFlashConfig.model_type, DFlashConfig, exist_ok=True)
AutoModel.register(DFlashConfig, DFlashDraftModel, exist_ok=True)
# save_pretrained then writes auto_map and copies modeling_dflash.py for trust_remote_code loading.
DFlashConfig.register_for_auto_class("AutoConfig")
DFlashDraftModel.register_for_auto_class("AutoModel")

__all__ = [
    "DFlashCandidateGenerator",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashGenerateOutput",
    "DFlashStats",
    "check_compatible",
    "compatibility_problems",
    "dflash_decode",
    "enable",
    "generate",
    "is_enabled",
    "pack_linears",
    "unpack_linears",
]
