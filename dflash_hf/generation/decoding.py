"""The DFlash decoding loop: propose, verify in one target forward, commit; one host read per step.

It is ours rather than transformers' assisted loop because that loop cannot take another candidate
generator than its own, stops only at block ends, and returns no statistics; it reuses transformers'
pieces (`prepare_inputs_for_generation`, caches that crop and roll back linear-attention states).
`api.dflash_decode`, the `custom_generate` callable, checks the call and builds the candidate generator
before handing both to `decode` (one sequence) or `batched.decode_batch` (a batch); both run each step's
target forward, processors, verification and read through `target_step`.

On an accelerator the host waits whenever it reads a value the device computed. Each step reads one
small tensor, the accepted length with the proposed tokens and the target's own; the end of the call
(EOS, `max_length`), the candidate generator's next decisions and its host copy of the sequence all
come from it (tests/test_host_syncs.py counts).
"""

import time
from typing import NamedTuple

import torch
from transformers import PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .candidate_generator import DFlashCandidateGenerator, Proposal
from .stats import DFlashGenerateOutput, DFlashStats
from .verify import verify


class Verified(NamedTuple):
    """What `target_step` returns: the target's `outputs`; its float32 `logits` `(batch, k + 1, vocab)` at the
    anchor and every draft, and the same after the processors (`scores`); `num_accepted` and `next_token`
    `(batch,)` on the device; each row's accepted drafts (`accepted`, host) and committed `tokens` (host ids: the
    accepted drafts and the target's own token, cut after the first EOS and at the row's room)."""

    outputs: object
    logits: torch.Tensor
    scores: torch.Tensor
    num_accepted: torch.LongTensor
    next_token: torch.LongTensor
    accepted: list[int]
    tokens: list[list[int]]


def target_step(model: PreTrainedModel, proposal: Proposal, length: int, model_kwargs: dict, logits_processor,
                do_sample: bool, eos: tuple[int, ...], rooms: list[int], first: bool = False, forward=None,
                attention_mask=None) -> Verified:
    """One target forward over every row's `[anchor, drafts]` (the whole prompt at the prefill, `first`), the
    processors on each slot's prefix, verification, and the step's one host read.

    Args:
        proposal (`Proposal`): `ids` `(batch, length + k [+ padding])`: the sequences (each ending with its anchor)
            followed by the drafts, and maybe copies of the last one that a compiled forward's width needs.
        length (`int`): the sequences' length before the drafts.
        model_kwargs (`dict`): covering `ids` whole (the attention mask, the positions).
        rooms (`list[int]`): the tokens each row may still commit (`max_length`).
        forward: the target's forward to run (default: the model's own; `decode` passes a compiled one).
        attention_mask: masks to give the forward instead of the ones transformers builds (a batch's windows).
    """
    ids, num_drafts = proposal.ids, proposal.num_proposed
    width = ids.shape[1] - length + 1
    inputs = model.prepare_inputs_for_generation(ids, next_sequence_length=None if first else width,
                                                 is_first_iteration=first, **model_kwargs)
    if "logits_to_keep" in inputs:
        inputs["logits_to_keep"] = width
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    outputs = (forward or model)(**(inputs | proposal.model_kwargs_overrides))
    logits = outputs.logits[:, -width:][:, : num_drafts + 1].to(ids.device, torch.float32)
    scores = logits.clone()
    for i in range(num_drafts + 1):  # the prefix each slot's token follows, as plain generate gives it
        scores[:, i] = logits_processor(ids[:, : length + i], scores[:, i])
    drafts = ids[:, length : length + num_drafts]
    num_accepted, next_token = verify(drafts, proposal.scores, scores, do_sample)
    read = torch.cat([num_accepted, next_token, drafts.reshape(-1)]).tolist()
    batch, tokens = ids.shape[0], []
    for row in range(batch):
        offset = 2 * batch + row * num_drafts
        committed = read[offset : offset + read[row]] + [read[batch + row]]
        end = next((i + 1 for i, token in enumerate(committed) if token in eos), len(committed))
        tokens.append(committed[: min(end, rooms[row])])
    return Verified(outputs, logits, scores, num_accepted, next_token, read[:batch], tokens)


@torch.no_grad()
def decode(model: PreTrainedModel, generator: DFlashCandidateGenerator, input_ids: torch.LongTensor, logits_processor,
           stopping_criteria: StoppingCriteriaList, generation_config, model_kwargs: dict, eos: tuple[int, ...] = (),
           streamer=None, stats: DFlashStats | None = None):
    """Decodes until EOS (one of the `eos` ids), `max_length` or a stopping criterion; `generator` has been `start`ed
    with the prompt. Returns the sequences, or a `DFlashGenerateOutput` under `return_dict_in_generate`."""
    stats, cache = stats if stats is not None else DFlashStats(), model_kwargs["cache"]
    # Stop strings and custom criteria are checked after every committed token, like plain generate.
    per_token = per_token_criteria(stopping_criteria)
    keep = generation_config.return_dict_in_generate
    scores = () if keep and generation_config.output_scores else None
    raw_logits = () if keep and generation_config.output_logits else None
    hidden_states = () if keep and generation_config.output_hidden_states else None

    compiled, widths, capacity = _compiled_verify(model, generation_config, model_kwargs, generator.longest_verify)
    first, max_length = True, generation_config.max_length
    while True:
        start = time.perf_counter()
        # 1. Drafts or a copy (nothing for the prefill and for plain steps), from the committed context.
        length = input_ids.shape[1]
        proposal = generator.propose(input_ids, model_kwargs, first, room=max_length - length - 1)
        drafted = time.perf_counter()
        # 2. One target forward over [last token, drafts] (the whole prompt at the prefill). A compiled forward
        # runs at a few fixed widths, so that its graphs are reused: the drafts are padded with copies of the
        # last one, which the causal mask hides from the real positions and the crop below drops from the cache.
        width, forward = proposal.num_proposed + 1, None
        if compiled is not None and not first:
            padded = next(w for w in widths if w >= width)
            if length - 1 + padded <= capacity:  # else this forward runs eagerly: a padded one would not fit
                ids = proposal.ids
                proposal = proposal._replace(ids=torch.cat([ids, ids[:, -1:].expand(-1, padded - width)], dim=-1))
                width, forward = padded, compiled
        # 3. Accepted prefix + one token of the target's: the step's one host read, cut at EOS and max_length.
        step = target_step(model, proposal, length, extend_kwargs(model_kwargs, width - 1), logits_processor,
                           generation_config.do_sample, eos, [max_length - length], first, forward)
        outputs, tokens = step.outputs, step.tokens[0]
        if first and not outputs.cache.is_croppable:
            raise ValueError(f"DFlash needs a target cache that can be cropped after rejected drafts; "
                             f"{type(cache).__name__} of {type(model).__name__} cannot (a static cache with "
                             f"sliding-window layers cannot). Use the default cache.")
        new_tokens = torch.cat([proposal.ids[:, length : length + step.accepted[0]], step.next_token[:, None]], dim=-1)
        new_tokens, stopped = _cut_at_criteria(new_tokens[:, : len(tokens)], input_ids, step.scores, per_token)
        tokens = tokens[: new_tokens.shape[1]]
        committed = len(tokens)
        done = tokens[-1] in eos or stopped or length + committed >= max_length
        # 4. Commit: the cache keeps exactly the committed tokens but the last (recurrent states too), the drafter
        # their context.
        input_ids = torch.cat([input_ids, new_tokens], dim=-1)
        cache.crop(-(width - committed))
        generator.ingest(outputs, None if first else committed)
        model_kwargs = extend_kwargs(model_kwargs, committed)
        if streamer is not None:
            streamer.put(torch.tensor([tokens]))  # from the host copy: no second read
        if scores is not None:
            scores += tuple(step.scores[:, i] for i in range(committed))
        if raw_logits is not None:
            raw_logits += tuple(step.logits[:, i] for i in range(committed))
        if hidden_states is not None:
            hidden_states += (tuple(h[:, -width:][:, :committed] if not first else h for h in outputs.hidden_states),)
        now = time.perf_counter()
        record(stats, proposal, [tokens], drafted - start, now - drafted)
        generator.observe(proposal, [tokens], now - start)
        first = False
        if done:
            break
    if streamer is not None:
        streamer.end()
    if not keep:
        return input_ids
    return DFlashGenerateOutput(sequences=input_ids, scores=scores, logits=raw_logits, hidden_states=hidden_states,
                                cache=cache, dflash_stats=stats)


def record(stats: DFlashStats, proposal: Proposal, tokens: list[list[int]], draft_seconds: float,
           verify_seconds: float, rows: list[DFlashStats] = ()) -> None:
    """A step into the call's statistics (one verification forward per row) and each row's own (`rows`, a batch)."""
    stats.draft_seconds += draft_seconds
    stats.verify_seconds += verify_seconds
    if proposal.plan is None:  # the prefill, which proposed nothing
        return
    for row, row_tokens in enumerate(tokens):
        for counted in (stats, rows[row]) if rows else (stats,):
            counted.record(proposal.num_proposed, len(row_tokens) - 1, proposal.copied)


def per_token_criteria(stopping_criteria: StoppingCriteriaList) -> StoppingCriteriaList:
    """The criteria other than EOS and `max_length` (which the loop applies from its host copy of the tokens)."""
    return StoppingCriteriaList([c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))])


def _compiled_verify(model, generation_config, model_kwargs: dict, longest: int) -> tuple:
    """`(compiled forward, widths, capacity)` where transformers' `generate` would compile the decoding forward (a
    compileable cache such as `cache_implementation="static"`, on an accelerator or with a `compile_config` that
    allows every device), else `(None, (), 0)`. Widths: the powers of two below the longest verify forward, then
    that forward (one graph each); capacity: the tokens the static cache holds. Hybrid targets never compile
    here: their cache records the recurrent states to roll back, which makes it not compileable."""
    if not model._valid_auto_compile_criteria(model_kwargs, generation_config):
        return None, (), 0
    capacity = min(layer.max_cache_len for layer in model_kwargs["cache"].layers if hasattr(layer, "max_cache_len"))
    widths = tuple(sorted({min(1 << i, longest) for i in range(longest.bit_length() + 1)}))
    return model.get_compiled_call(generation_config.compile_config), widths, capacity


def extend_kwargs(model_kwargs: dict, num_tokens: int) -> dict:
    """`model_kwargs` whose per-position entries cover `num_tokens` more tokens (as transformers grows them)."""
    if num_tokens == 0:
        return model_kwargs
    extended = dict(model_kwargs)
    if (mask := extended.get("attention_mask")) is not None:
        extended["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], num_tokens)], dim=-1)
    if (positions := extended.get("position_ids")) is not None:
        steps = torch.arange(1, num_tokens + 1, dtype=positions.dtype, device=positions.device)
        extended["position_ids"] = torch.cat([positions, positions[..., -1:] + steps], dim=-1)
    if (types := extended.get("token_type_ids")) is not None:
        extended["token_type_ids"] = torch.cat([types, types[:, -1:].repeat(1, num_tokens)], dim=-1)
    if (types := extended.get("mm_token_type_ids")) is not None:
        extended["mm_token_type_ids"] = torch.cat([types, types.new_zeros(types.shape[0], num_tokens)], dim=-1)
    return extended


def _cut_at_criteria(new_tokens, input_ids, scores, criteria: StoppingCriteriaList) -> tuple[torch.LongTensor, bool]:
    """`new_tokens` up to the first one after which a stop string or custom criterion stops, and whether one did
    (a criterion returns a device tensor: with any, each committed token costs a read, as in plain generate)."""
    if criteria:
        for end in range(1, new_tokens.shape[1] + 1):
            if bool(criteria(torch.cat([input_ids, new_tokens[:, :end]], dim=-1), scores[:, end - 1]).any()):
                return new_tokens[:, :end], True
    return new_tokens, False


__all__ = ["Verified", "decode", "extend_kwargs", "per_token_criteria", "record", "target_step"]
