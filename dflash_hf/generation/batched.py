"""DFlash on a batch of prompts: one drafter forward and one target forward per step for every row, each row
accepting its own number of drafts.

Ragged acceptance leaves holes in the caches instead of re-aligning them. The rows share the caches' slots: a
step writes every row's `[anchor, drafts]` at the same `k + 1` slots, then keeps the first `max_r(a_r + 1)` of
them (`a_r`: the drafts row r accepted), the ones past row r's own `a_r + 1` masked out in the attention mask,
as left padding already is. Positions are per row (the row's committed tokens so far), so a row's queries see
exactly its own committed tokens at their own positions, as they would alone: its output is its own greedy
output (or its own sampling distribution). Nothing is copied; re-alignment moves the caches every step (arXiv
2510.22876 measured it at up to 40 % of compute). The holes cost attention over at most `k` dead slots a row
per step, and a row that finishes (EOS, `max_length`) leaves the batch: its rows of both caches are dropped.

Sliding-window layers (Gemma-4's) count their window in slots, which holes would shrink: in a batch their
cache keeps every slot, as a full-attention layer's does, and their mask is built here from each row's positions
(a query sees the row's tokens less than `sliding_window` positions back), so a row sees the window it sees
alone; the price is that these layers attend over (and store) the whole context instead of the window.

Every row verifies the same number of drafts, so that one target forward covers them: a fixed `verify_length`
(or the whole block), or by default the adaptive length (`policy.AdaptiveVerifyLength`) of the batch: one length,
the one with the most expected tokens per second for the batch, from the rows' acceptance pooled into one set of
statistics and the batch's own step costs (a batch's forward grows with rows x tokens: on a CPU, where a verified
draft costs B tokens, it falls back to plain steps as the batch grows; repriced as rows leave). Like batch 1's, it is chosen before the
drafter runs, from host statistics only, which keeps sampling exact; the per-slot confidence cut and copies from
the context are per sequence and off in batches. What holes cannot serve is refused up front (`check_batch`): linear-attention
layers (a recurrent state counts slots, not the row's tokens) and flash attention with a sliding window (it
applies the window by slots itself), logits processors that read the ids (they would read the holes),
streamers, stop strings and custom stopping criteria.
"""

import time

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.generation.logits_process import (
    EpsilonLogitsWarper, EtaLogitsWarper, MinPLogitsWarper, TemperatureLogitsWarper, TopHLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper,
)

from .candidate_generator import DFlashCandidateGenerator
from .decoding import extend_kwargs, record, target_step
from .stats import DFlashGenerateOutput, DFlashStats

# Processors that read only the scores, never the ids: the holes of a batch do not change what they do.
SCORE_ONLY_PROCESSORS = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
    EpsilonLogitsWarper, EtaLogitsWarper, TopHLogitsWarper,
)


def check_batch(model: PreTrainedModel, logits_processor, per_token_criteria, streamer, generation_config, cache) -> None:
    """Raises a `ValueError` naming the fix for what a batch cannot do (see the module docstring)."""
    def refuse(what: str, fix: str):
        raise ValueError(f"DFlash with a batch of prompts does not support {what}; {fix}, or generate one prompt at a "
                         "time.")

    layer_types = _layer_types(model)
    if other := sorted(layer_types - {"full_attention", "sliding_attention"}):
        refuse(f"{type(model).__name__}'s {other} layers (their states count cache slots, which a batch leaves holes "
               "in)", "use a target with full or sliding-window attention")
    implementation = model.config.get_text_config()._attn_implementation or ""
    if "sliding_attention" in layer_types and "flash" in implementation:
        refuse(f"{implementation} on a sliding-window target (it counts the window in cache slots, which a batch "
               "leaves holes in)", 'load the target with attn_implementation="sdpa"')
    if streamer is not None:
        refuse("streamers (as plain generate)", "drop the streamer")
    if per_token_criteria:
        names = sorted({type(c).__name__ for c in per_token_criteria})
        refuse(f"stop strings or custom stopping criteria ({', '.join(names)})", "drop them")
    for processor in logits_processor:
        if not isinstance(processor, SCORE_ONLY_PROCESSORS):
            refuse(f"the logits processor {type(processor).__name__} (it reads the ids, which hold a batch's holes)",
                   "drop the option that adds it")
    if any(getattr(generation_config, name, None) for name in ("output_scores", "output_logits", "output_hidden_states")):
        refuse("output_scores, output_logits or output_hidden_states", "drop them")
    if type(cache).__name__ != "DynamicCache":
        refuse(f"a {type(cache).__name__}", "use the default cache")


@torch.no_grad()
def decode_batch(model: PreTrainedModel, generator: DFlashCandidateGenerator, input_ids: torch.LongTensor,
                 logits_processor, generation_config, model_kwargs: dict, eos: tuple[int, ...] = (),
                 stats: DFlashStats | None = None):
    """Decodes every row of `input_ids` (left-padded, `model_kwargs["attention_mask"]`) until its EOS or
    `max_length`; finished rows are padded with the pad token, as plain batched `generate` pads them. Returns
    the sequences, or a `DFlashGenerateOutput` whose `dflash_stats` counts each row's steps, and `.rows` each row's.
    The step is `decoding.decode`'s (`target_step`); what is the batch's own is where its slots go."""
    stats = stats if stats is not None else DFlashStats()
    stats.rows, cache, device = [DFlashStats() for _ in range(input_ids.shape[0])], model_kwargs["cache"], input_ids.device
    budget = generation_config.max_length - input_ids.shape[1]  # new tokens per row, as plain generate counts them
    generated: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    rows = list(range(input_ids.shape[0]))  # the original index of each row still in the batch
    window = _sliding_window(model)
    if window is not None:  # every slot kept, the window applied by positions (module docstring)
        cache = model_kwargs["cache"] = DynamicCache()

    # Slot space: `slot_ids` holds every cache slot's token followed by each row's anchor (its last committed token,
    # not yet in the cache; at the prefill, the prompt's last); `valid` and `positions` cover them.
    slot_ids, mask = input_ids, model_kwargs.get("attention_mask")
    valid = mask.bool() if mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    positions = model_kwargs.get("position_ids")
    if positions is None:
        positions = (valid.long().cumsum(-1) - 1).masked_fill(~valid, 1)
    first = True
    while rows:
        start = time.perf_counter()
        # 1. The verify length, from host statistics, and one drafter forward for every row (none for a plain step).
        length = slot_ids.shape[1]
        slot_kwargs = model_kwargs | {"attention_mask": valid.long(), "position_ids": positions}
        room = budget - min(len(generated[row]) for row in rows) - 1  # tokens the longest-running row can still take
        proposal = generator.propose(slot_ids, slot_kwargs, first, room=room)
        drafted = time.perf_counter()
        # 2. One target forward over every row's [anchor, drafts], at each row's own positions; each row's accepted
        # prefix and the target's own token.
        width = proposal.num_proposed + 1
        forward_kwargs = extend_kwargs(slot_kwargs, width - 1)
        masks = None
        if window is not None:
            masks = _window_masks(model, window, forward_kwargs["attention_mask"].bool(), forward_kwargs["position_ids"],
                                  cache, proposal.ids.shape[1] if first else width)
        rooms = [budget - len(generated[row]) for row in rows]
        step = target_step(model, proposal, length, forward_kwargs, logits_processor, generation_config.do_sample,
                           eos, rooms, first, attention_mask=masks)
        now = time.perf_counter()
        for row, tokens in zip(rows, step.tokens):
            generated[row] += tokens
        record(stats, proposal, step.tokens, drafted - start, now - drafted, [stats.rows[row] for row in rows])
        generator.observe(proposal, step.tokens, now - start)
        # 3. Commit: the caches keep the slots some row still needs (the anchor and drafts up to the longest accepted
        # run; at the prefill, the prompt), the rest of each row's are holes; each row's new anchor follows.
        kept = 1 + max(step.accepted)
        if kept < width:
            cache.crop(kept - width)
        generator.ingest(step.outputs, None if first else kept)
        steps = torch.arange(1, kept, device=device)
        anchor_position = positions[:, -1] + step.num_accepted + 1
        slot_ids = torch.cat([slot_ids, proposal.ids[:, length : length + kept - 1], step.next_token[:, None]], dim=-1)
        valid = torch.cat([valid, steps <= step.num_accepted[:, None], valid.new_ones(valid.shape[0], 1)], dim=-1)
        positions = torch.cat([positions, positions[:, -1:] + steps, anchor_position[:, None]], dim=-1)
        first = False
        # 4. Rows that finished leave the batch: both caches and the slot tensors lose them.
        keep = [i for i, row in enumerate(rows) if len(generated[row]) < budget and generated[row][-1] not in eos]
        if len(keep) < len(rows):
            rows = [rows[i] for i in keep]
            if rows:
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                generator.keep_rows(keep, index)
                slot_ids, valid, positions = (t.index_select(0, index) for t in (slot_ids, valid, positions))

    pad = generation_config._pad_token_tensor
    pad = int(pad) if pad is not None else eos[0] if eos else 0  # plain generate pads with the first EOS id
    longest = max(len(tokens) for tokens in generated)
    tail = torch.tensor([tokens + [pad] * (longest - len(tokens)) for tokens in generated], device=device,
                        dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, tail], dim=-1)
    if not generation_config.return_dict_in_generate:
        return sequences
    return DFlashGenerateOutput(sequences=sequences, cache=cache, dflash_stats=stats)


def _layer_types(model: PreTrainedModel) -> set[str]:
    text_config = model.config.get_text_config()
    layer_types = set(getattr(text_config, "layer_types", None) or ())
    if not layer_types and getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True):
        layer_types = {"sliding_attention"}  # one window over every layer (configs without layer_types)
    return layer_types


def _sliding_window(model: PreTrainedModel) -> int | None:
    """The target's sliding window when it has sliding-window layers, else None."""
    if "sliding_attention" not in _layer_types(model):
        return None
    return model.config.get_text_config().sliding_window


def _window_masks(model: PreTrainedModel, window: int, valid: torch.Tensor, positions: torch.Tensor, cache,
                  query_length: int):
    """The target's masks per layer type for a forward over the last `query_length` of the slots that `valid` and
    `positions` (batch, slots) describe: causal over the row's valid slots, and for sliding layers only the slots
    less than `window` of the row's positions back (transformers' own window counts slots, which holes inflate).
    Built by transformers' `create_causal_mask`, in the format the target's attention takes: a dict by layer type
    (what models with `layer_types` take), or the sliding mask alone for a window over every layer (Mistral's
    4D mask, which its mask functions pass through)."""
    config = model.config.get_text_config()

    def within_window(batch_idx, head_idx, q_idx, kv_idx):  # indices are slots; compare the rows' positions
        return positions[batch_idx, q_idx] - positions[batch_idx, kv_idx] < window

    # create_causal_mask reads only the batch size, query length, dtype and device of its `inputs_embeds`
    queries = torch.empty(valid.shape[0], query_length, 0, dtype=model.dtype, device=valid.device)
    arguments = dict(config=config, inputs_embeds=queries, attention_mask=valid, cache=cache,
                     position_ids=positions[:, -query_length:])
    sliding = create_causal_mask(**arguments, and_mask_function=within_window)
    if "full_attention" not in _layer_types(model):
        return sliding
    return {"full_attention": create_causal_mask(**arguments), "sliding_attention": sliding}


__all__ = ["SCORE_ONLY_PROCESSORS", "check_batch", "decode_batch"]
