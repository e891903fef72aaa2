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
draft costs B tokens, it falls back to plain steps as the batch grows). Like batch 1's, it is chosen before the
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
from .policy import StepCosts
from .stats import DFlashGenerateOutput, DFlashStats
from .verify import verify

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
    the sequences, or a `DFlashGenerateOutput` whose `dflash_stats` counts each row's steps, and `.rows` each row's."""
    stats = stats if stats is not None else DFlashStats()
    stats.rows = [DFlashStats() for _ in range(input_ids.shape[0])]
    cache, device = model_kwargs["cache"], input_ids.device
    drafting, policy = generator.max_drafts > 0, generator.policy
    if policy is not None:  # a verified draft adds a token per row to the target's forward
        costs = policy.costs  # priced for one row by the hardware (`cost_prior`)
        policy.costs = StepCosts(policy.max_drafts, draft=costs.draft, per_draft=costs.per_draft * input_ids.shape[0])
    budget = generation_config.max_length - input_ids.shape[1]  # new tokens per row, as plain generate counts them
    generated: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    rows = list(range(input_ids.shape[0]))  # the original index of each row still in the batch

    # Slot space: `slot_ids` holds every cache slot's token followed by each row's anchor (its last committed
    # token, not yet in the cache); `valid` and `positions` cover the cache slots.
    mask = model_kwargs.get("attention_mask")
    valid = mask.bool() if mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    positions = model_kwargs.get("position_ids")
    if positions is None:
        positions = (valid.long().cumsum(-1) - 1).masked_fill(~valid, 1)
    generator.padded = True  # the drafter always takes the mask: its holes are padding to it
    overrides = generator.model_kwargs_overrides
    window = _sliding_window(model)
    if window is not None:  # every slot kept, the window applied by positions (module docstring)
        cache = model_kwargs["cache"] = DynamicCache()

    start = time.perf_counter()
    inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True,
                                                 **(model_kwargs | {"attention_mask": valid.long(), "position_ids": positions}))
    if "logits_to_keep" in inputs:
        inputs["logits_to_keep"] = 1
    if window is not None:
        inputs["attention_mask"] = _window_masks(model, window, valid, positions, cache, input_ids.shape[1])
    outputs = model(**(inputs | overrides))
    scores = logits_processor(input_ids, outputs.logits[:, -1:].float().squeeze(1))[:, None]
    _, anchor = verify(input_ids[:, :0], None, scores, generation_config.do_sample)
    if drafting:  # the prompt's slots: the drafter's first context
        generator.pending_context.append(_context(outputs, generator, input_ids.shape[1]))
    slot_ids = torch.cat([input_ids, anchor[:, None]], dim=-1)
    anchor_position = positions[:, -1] + 1
    for row, token in zip(rows, anchor.tolist()):
        generated[row].append(token)
    rows, keep = _still_running(rows, generated, eos, budget)
    stats.verify_seconds += time.perf_counter() - start

    while rows:
        if keep is not None:  # rows that finished leave the batch: both caches and the slot tensors lose them
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            generator.cache.batch_select_indices(index.to(generator.device))
            slot_ids, valid, positions, anchor_position = (t.index_select(0, index) for t in (slot_ids, valid, positions,
                                                                                               anchor_position))
            generator.pending_context = [c.index_select(0, index.to(c.device)) for c in generator.pending_context]
        start = time.perf_counter()
        # 1. The verify length, from host statistics; the drafter ingests the context of the forwards since its last
        # one and drafts a block for every row (a plain step skips it).
        room = budget - min(len(generated[row]) for row in rows) - 1  # tokens the longest-running row can still take
        num_drafts = min(generator.max_drafts, room)
        if policy is not None and num_drafts > 0:
            num_drafts = policy.choose(num_drafts)
        if num_drafts:
            draft_kwargs = {"attention_mask": torch.cat([valid, valid.new_ones(valid.shape[0], 1)], dim=-1).long(),
                            "position_ids": torch.cat([positions, anchor_position[:, None]], dim=-1)}
            hidden = generator._draft_block(slot_ids, draft_kwargs)[:, 1 : 1 + num_drafts]
            drafts, draft_scores = generator._propose(slot_ids, generator._draft_logits(hidden).to(device))
        else:
            drafts, draft_scores = slot_ids[:, :0], None
        drafted = time.perf_counter()
        # 2. One target forward over every row's [anchor, drafts], at each row's own positions.
        width = num_drafts + 1
        step_positions = anchor_position[:, None] + torch.arange(width, device=device)
        forward_kwargs = model_kwargs | {
            "attention_mask": torch.cat([valid, valid.new_ones(valid.shape[0], width)], dim=-1).long(),
            "position_ids": torch.cat([positions, step_positions], dim=-1),
        }
        inputs = model.prepare_inputs_for_generation(torch.cat([slot_ids, drafts], dim=-1), next_sequence_length=width,
                                                     **forward_kwargs)
        if "logits_to_keep" in inputs:
            inputs["logits_to_keep"] = width
        if window is not None:
            inputs["attention_mask"] = _window_masks(model, window, forward_kwargs["attention_mask"].bool(),
                                                     forward_kwargs["position_ids"], cache, width)
        outputs = model(**(inputs | overrides))
        logits = outputs.logits[:, -width:].float()
        processed = logits.clone()
        for i in range(width):  # score-only processors (check_batch): the ids they are given do not matter
            processed[:, i] = logits_processor(slot_ids, processed[:, i])
        # 3. Each row's accepted prefix and the target's own token: the step's one host read.
        num_accepted, next_token = verify(drafts, draft_scores, processed, generation_config.do_sample)
        read = torch.cat([num_accepted, next_token, drafts.reshape(-1)]).tolist()
        batch = len(rows)
        accepted, nexts, host_drafts = read[:batch], read[batch : 2 * batch], read[2 * batch :]
        for i, row in enumerate(rows):
            tokens = host_drafts[i * num_drafts : i * num_drafts + accepted[i]] + [nexts[i]]
            ends = next((j + 1 for j, token in enumerate(tokens) if token in eos), len(tokens))
            tokens = tokens[: min(ends, budget - len(generated[row]))]
            generated[row] += tokens
            stats.rows[row].record(num_drafts, len(tokens) - 1)
            stats.record(num_drafts, len(tokens) - 1)
        now = time.perf_counter()
        if policy is not None:
            policy.observe(num_drafts, accepted, now - start)
        # 4. Commit: the caches keep the slots some row still needs; the rest of each row's are holes.
        kept = 1 + max(accepted)
        if kept < width:
            cache.crop(kept - width)
        new_valid = torch.arange(kept, device=device) <= num_accepted[:, None]
        slot_ids = torch.cat([slot_ids, drafts[:, : kept - 1], next_token[:, None]], dim=-1)
        valid = torch.cat([valid, new_valid], dim=-1)
        positions = torch.cat([positions, step_positions[:, :kept]], dim=-1)
        anchor_position = anchor_position + num_accepted + 1
        if drafting:
            generator.pending_context.append(_context(outputs, generator, kept))
        rows, keep = _still_running(rows, generated, eos, budget)
        stats.draft_seconds += drafted - start
        stats.verify_seconds += now - drafted

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


def _context(outputs, generator, kept: int) -> torch.Tensor:
    """The drafter's context features of the first `kept` slots of the target's last forward: the hidden states
    after its `target_layer_ids`, concatenated, on the drafter's device."""
    hidden_states = outputs.hidden_states
    return torch.cat([hidden_states[i + 1][:, :kept].to(generator.device) for i in generator.target_layer_ids], dim=-1)


def _still_running(rows: list[int], generated: list[list[int]], eos: tuple[int, ...], budget: int):
    """`(rows, keep)`: the rows that go on, and their indices in the current batch (None when all go on)."""
    keep = [i for i, row in enumerate(rows) if len(generated[row]) < budget and generated[row][-1] not in eos]
    if len(keep) == len(rows):
        return rows, None
    return [rows[i] for i in keep], keep


__all__ = ["SCORE_ONLY_PROCESSORS", "check_batch", "decode_batch"]
