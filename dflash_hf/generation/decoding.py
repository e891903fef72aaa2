"""The DFlash decoding loop: propose, verify in one target forward, commit; one host read per step.

It is ours rather than transformers' assisted loop because that loop cannot take another candidate
generator than its own, stops only at block ends, and returns no statistics; it reuses transformers'
pieces (`prepare_inputs_for_generation`, caches that crop and roll back linear-attention states).
`api.dflash_decode`, the `custom_generate` callable, checks the call and builds the candidate generator
before handing both to `decode`.

On an accelerator the host waits whenever it reads a value the device computed. Each step reads one
small tensor, the accepted length with the proposed tokens and the target's own; the end of the call
(EOS, `max_length`), the candidate generator's next decisions and its host copy of the sequence all
come from it (tests/test_host_syncs.py counts).
"""

import time

import torch
from transformers import PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .candidate_generator import DFlashCandidateGenerator
from .stats import DFlashGenerateOutput, DFlashStats
from .verify import verify


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
    outputs, accepted, first = None, 0, True
    while True:
        start = time.perf_counter()
        # 1. Drafts or a copy (nothing for the prefill and for plain steps), from the last forward's hidden states.
        proposal = generator.propose(input_ids, model_kwargs, outputs, first, accepted)
        length = input_ids.shape[1]
        num_drafts = proposal.ids.shape[1] - length
        drafted = time.perf_counter()
        # 2. One target forward over [last token, drafts] (the whole prompt at the prefill). A compiled forward
        # runs at a few fixed widths, so that its graphs are reused: the drafts are padded with copies of the
        # last one, which the causal mask hides from the real positions and the crop below drops from the cache.
        ids, width, forward = proposal.ids, num_drafts + 1, model
        if compiled is not None and not first:
            padded = next(w for w in widths if w >= width)
            if length - 1 + padded <= capacity:  # else this forward runs eagerly: a padded one would not fit
                ids = torch.cat([ids, ids[:, -1:].expand(-1, padded - width)], dim=-1)
                width, forward = padded, compiled
        inputs = model.prepare_inputs_for_generation(
            ids, next_sequence_length=None if first else width, is_first_iteration=first,
            **_extend(model_kwargs, width - 1),
        )
        if "logits_to_keep" in inputs:
            inputs["logits_to_keep"] = width
        outputs = forward(**(inputs | proposal.model_kwargs_overrides))
        if first and not outputs.cache.is_croppable:
            raise ValueError(f"DFlash needs a target cache that can be cropped after rejected drafts; "
                             f"{type(cache).__name__} of {type(model).__name__} cannot (a static cache with "
                             f"sliding-window layers cannot). Use the default cache.")
        logits = outputs.logits[:, -width:][:, : num_drafts + 1].to(input_ids.device, torch.float32)
        processed = logits.clone()
        for i in range(num_drafts + 1):
            processed[:, i] = logits_processor(proposal.ids[:, : length + i], processed[:, i])
        # 3. Accepted prefix + one token of the target's: the step's one host read, cut at EOS and max_length.
        drafts = proposal.ids[:, length:]
        num_accepted, next_token = verify(drafts, proposal.scores, processed, generation_config.do_sample)
        read = torch.cat([num_accepted, next_token, drafts[0]]).tolist()
        tokens = read[2 : 2 + read[0]] + [read[1]]
        ends = next((i + 1 for i, token in enumerate(tokens) if token in eos), None)
        tokens = tokens[: min(ends or len(tokens), generation_config.max_length - length)]
        new_tokens = torch.cat([drafts[:, : read[0]], next_token[:, None]], dim=-1)[:, : len(tokens)]
        new_tokens, stopped = _cut_at_criteria(new_tokens, input_ids, processed, per_token)
        tokens = tokens[: new_tokens.shape[1]]
        committed = len(tokens)
        done = ends is not None or stopped or length + committed >= generation_config.max_length
        # 4. Commit: the cache keeps exactly the committed tokens but the last (recurrent states too).
        input_ids = torch.cat([input_ids, new_tokens], dim=-1)
        cache.crop(-(width - committed))
        model_kwargs = _extend(model_kwargs, committed)
        if streamer is not None:
            streamer.put(torch.tensor([tokens]))  # from the host copy: no second read
        if scores is not None:
            scores += tuple(processed[:, i] for i in range(committed))
        if raw_logits is not None:
            raw_logits += tuple(logits[:, i] for i in range(committed))
        if hidden_states is not None:
            hidden_states += (tuple(h[:, -width:][:, :committed] if not first else h for h in outputs.hidden_states),)
        now = time.perf_counter()
        stats.draft_seconds += drafted - start
        stats.verify_seconds += now - drafted
        if proposal.plan is not None:  # (None: the prefill, which proposed nothing)
            stats.record(proposal.num_proposed, committed - 1, proposal.copied)
        generator.observe(proposal, tokens, now - start)
        accepted, first = committed - 1, False
        if done:
            break
    if streamer is not None:
        streamer.end()
    if not keep:
        return input_ids
    return DFlashGenerateOutput(sequences=input_ids, scores=scores, logits=raw_logits, hidden_states=hidden_states,
                                cache=cache, dflash_stats=stats)


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


def _extend(model_kwargs: dict, num_tokens: int) -> dict:
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


__all__ = ["decode", "per_token_criteria"]
