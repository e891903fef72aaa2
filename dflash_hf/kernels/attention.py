"""The DFlash block-attention kernel as a transformers attention function (`attn_implementation`).

Nothing is registered at import: `use_dflash_attention(drafter)` registers `diffusion_block` with
transformers' `AttentionInterface` and switches the drafter to it with `set_attn_implementation`
(a name containing "flash" would be taken for a flash-attention package and refused).
"""

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..modeling_dflash import DFlashAttention
from .loader import load_kernels, resolve_backend
from .ops import block_attention

ATTENTION_NAME = "diffusion_block"
# Set on each DFlashAttention by `use_dflash_attention(backend=...)`: a plain attribute, so it is
# neither saved with the weights nor written to config.json.
BACKEND_ATTRIBUTE = "dflash_kernels_backend"


def dflash_block_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: query `[b, H, Lq, D]`, key/value `[b, Hkv, Lk, D]`
    -> (`[b, Lq, H, D]`, None).

    Query i sits at index `Lk - Lq + i` (DFlash's block after its context). Without a mask the
    block kernel runs: non-causal, or windowed with `sliding_window` (causal when `is_causal` alone).
    A mask (padding; the window on non-flash sliding layers) or dropout goes to transformers' sdpa.
    """
    if attention_mask is not None or (dropout and module.training) or kwargs.get("softcap") is not None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask,
            dropout=dropout, scaling=scaling, sliding_window=sliding_window, is_causal=is_causal, **kwargs,
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if sliding_window is None and is_causal:
        sliding_window = key.shape[2]  # bottom-right causal: a window as long as the keys
    backend = getattr(module, BACKEND_ATTRIBUTE, None)
    return block_attention(query, key, value, scaling, sliding_window, backend=backend), None


def register_dflash_attention() -> str:
    """Registers `diffusion_block` with transformers' AttentionInterface (idempotent); returns the name.

    Raises ValueError when the name is already taken by another function: never override one."""
    existing = AttentionInterface._global_mapping.get(ATTENTION_NAME)
    if existing is None:
        AttentionInterface.register(ATTENTION_NAME, dflash_block_attention_forward)
    elif existing is not dflash_block_attention_forward:
        raise ValueError(f"An attention function named {ATTENTION_NAME!r} is already registered: {existing!r}.")
    return ATTENTION_NAME


def use_dflash_attention(drafter: PreTrainedModel, backend: str | None = None) -> PreTrainedModel:
    """Runs `drafter`'s attention through the DFlash block kernel. Returns `drafter`.

    `backend` (`auto`, `triton`, `torch`; default `$DFLASH_KERNELS` at each forward) applies to this
    drafter's attention layers; it is loaded now, so that `triton` fails here rather than in the first
    forward, and the log says which path runs.
    """
    if backend is not None:
        backend = resolve_backend(backend)
    load_kernels(backend=backend)
    name = register_dflash_attention()
    for module in drafter.modules():
        if isinstance(module, DFlashAttention):
            setattr(module, BACKEND_ATTRIBUTE, backend)
    drafter.set_attn_implementation(name)
    return drafter
