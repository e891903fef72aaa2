"""Rolling back hybrid (linear-attention) targets after a rejected draft.

A Gated-DeltaNet layer's recurrent state after verifying `[anchor, d1..dk]` has absorbed every
draft, rejected ones included, and cannot be cropped like keys/values. Mechanism chosen: snapshot
before verification, restore and replay the committed tokens after a rejection.

- `RollbackCache.snapshot()` (called by the candidate generator just before it hands drafts to the
  target) copies the linear layers' conv and recurrent states: a few MB, no forward.
- When transformers' loop then crops rejected drafts, the cache restores those states, crops the
  attention layers to the snapshot too, and records where the committed tokens start.
- Before the next draft, `replay` runs the target over exactly the committed tokens (the anchor and
  the accepted drafts, never the rejected ones), which recomputes every layer's state exactly and
  yields the hidden states the drafter needs. Steps where every draft is accepted cost nothing extra.

The alternatives keep one state per draft position during verification (vLLM, SGLang), which needs
changes inside the linear-attention kernels; this one needs none and is exact by construction.
"""

import time

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin


def is_linear(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


class RollbackCache(DynamicCache):
    """A `DynamicCache` whose `crop` also rolls back linear-attention layers (see module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._snapshot: tuple[int, list] | None = None
        self.replay_from: int | None = None  # sequence index where un-replayed committed tokens start

    @property
    def is_croppable(self) -> bool:
        return True

    def activate_past_recording(self):
        # Linear layers are rolled back from snapshots; recording their growing conv states is not needed.
        for layer in self.layers:
            if not is_linear(layer) and hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    def snapshot(self) -> None:
        states = []
        for layer in self.layers:
            if is_linear(layer):
                states.append(
                    (
                        {i: s.clone() for i, s in layer.conv_states.items() if layer.is_conv_states_initialized[i]},
                        {i: s.clone() for i, s in layer.recurrent_states.items()
                         if layer.is_recurrent_states_initialized[i]},
                    )
                )
            else:
                states.append(None)
        self._snapshot = (self.get_seq_length(), states)

    def crop(self, tokens_to_remove: int) -> None:
        snapshot, self._snapshot = self._snapshot, None
        if tokens_to_remove == 0 or snapshot is None:
            for layer in self.layers:
                if not is_linear(layer):
                    layer.crop(tokens_to_remove)
            return
        length, states = snapshot
        verified = self.get_seq_length() - length
        for layer, state in zip(self.layers, states):
            if state is None:
                layer.crop(-verified)
                continue
            conv, recurrent = state
            for i, saved in conv.items():
                layer.conv_states[i].copy_(saved)  # in place: keeps static addresses for cudagraphs
            for i, saved in recurrent.items():
                layer.recurrent_states[i].copy_(saved)
        self.replay_from = length


def check_rollback_supported(cache_layers) -> None:
    for layer in cache_layers:
        if is_linear(layer) and type(layer).__name__ != "LinearAttentionLayer":
            raise ValueError(
                f"DFlash cannot roll back {type(layer).__name__} cache layers (linear attention and attention "
                "in one layer) yet; call generate without assistant_model."
            )


@torch.no_grad()
def replay(target, cache: RollbackCache, input_ids: torch.LongTensor, model_kwargs_overrides: dict, stats=None,
           attention_mask: torch.Tensor | None = None, position_ids: torch.LongTensor | None = None):
    """Runs the target over the committed tokens since the last snapshot (`input_ids[replay_from:-1]`,
    the last token being the next anchor) and returns its outputs (hidden states included).

    `attention_mask` covers the whole sequence (padding included); `position_ids` too, when given."""
    start = time.perf_counter()
    # sequence indices; a prompt given as inputs_embeds is in the cache and positions, not in input_ids
    offset = position_ids.shape[-1] - input_ids.shape[1] if position_ids is not None else 0
    end = offset + input_ids.shape[1] - 1
    begin, cache.replay_from = cache.replay_from, None
    if begin < offset:
        raise ValueError("DFlash cannot replay a prompt given as inputs_embeds on a hybrid target; pass input_ids.")
    extra = {}
    if attention_mask is not None:
        extra["attention_mask"] = attention_mask[:, :end]
    if position_ids is not None:
        extra["position_ids"] = position_ids[..., begin:end]
    outputs = target(input_ids=input_ids[:, begin - offset : end - offset], cache=cache, use_cache=True,
                     logits_to_keep=1, **extra, **model_kwargs_overrides)
    if stats is not None:
        stats.replay_forwards += 1
        stats.replay_seconds += time.perf_counter() - start
    return outputs
