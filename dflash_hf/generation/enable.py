"""`dflash_hf.enable(target)`: one target instance learns to draft with a DFlash drafter.

Only that instance changes, and only when `generate` gets a `DFlashDraftModel` as
`assistant_model`: its `_get_candidate_generator` then returns our candidate generator, and
transformers' own assisted-generation loop verifies the drafts. Its class, config, other
generation modes and every other model are untouched.
"""

import contextvars
import functools
import threading
import types

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.utils import ModelOutput

from ..modeling_dflash import DFlashDraftModel
from ..targets import check_compatible, is_stateful
from .candidate_generator import ADAPTIVE, DFlashCandidateGenerator, check_settings
from .profile import CostProfile
from .rollback import RollbackCache, check_rollback_supported, replay

_ENABLED = "_dflash_enabled"
_STATEFUL_LOCK = threading.Lock()
# The per-call option: `generate(..., dflash_verify_length=n)` or `GenerationConfig(dflash_verify_length=n)`.
CALL_OPTION = "dflash_verify_length"
_UNSET = object()
_CALL_VERIFY_LENGTH = contextvars.ContextVar(CALL_OPTION, default=_UNSET)


def enable(
    target: PreTrainedModel,
    proposal: str = "sample",
    verify_length: int | str | None = ADAPTIVE,
    cost_profile: CostProfile | None = None,
) -> PreTrainedModel:
    """Lets `target.generate(..., assistant_model=drafter)` use a DFlash drafter. Returns `target`.

    Args:
        target (`PreTrainedModel`): a causal LM (`AutoModelForCausalLM`), enabled in place.
        proposal (`str`, defaults to `"sample"`): how drafts are proposed under `do_sample=True`
            (`"argmax"`, `"sample"` or `"match"`, see `candidate_generator.PROPOSALS`); greedy
            decoding ignores it.
        verify_length (`str` or `int`, *optional*, defaults to `"adaptive"`): drafts the target
            verifies per step. `"adaptive"` picks it each step to maximise expected tokens per second
            (from acceptance so far and a hardware profile measured once and cached; plain one-token
            steps when drafting does not pay); `None` verifies all `block_size - 1`; an int at most that
            many (0: never draft). One call can override it with `generate(..., dflash_verify_length=n)`
            or a `GenerationConfig(dflash_verify_length=n)`.
        cost_profile (`CostProfile`, *optional*): step costs for `"adaptive"` (default: measured on
            first use and cached per model, device and dtype, see `dflash_hf.generation.profile`).

    Calling `enable` again replaces the settings.
    """
    if isinstance(target, DFlashDraftModel):
        raise TypeError("dflash_hf.enable takes the target model, not the drafter.")
    if not isinstance(target, PreTrainedModel) or not target.can_generate():
        raise TypeError(
            f"dflash_hf.enable expects a transformers model that can generate (AutoModelForCausalLM), "
            f"got {type(target).__name__}."
        )
    check_settings(proposal, verify_length, cost_profile)
    settings = {"proposal": proposal, "verify_length": verify_length, "cost_profile": cost_profile}
    if target.__dict__.get(_ENABLED):
        target.__dict__[_ENABLED].update(settings)
        return target
    # Bound methods of module-level functions, so that copy.deepcopy(target) gets ones bound to the copy.
    target.generate = types.MethodType(_generate, target)
    target._get_candidate_generator = types.MethodType(_get_candidate_generator, target)
    target.__dict__[_ENABLED] = settings
    return target


@functools.wraps(GenerationMixin.generate)
def _generate(self, *args, **kwargs):
    drafter = kwargs.get("assistant_model")
    if drafter is not None and not isinstance(drafter, DFlashDraftModel) and (
        type(drafter).__name__ == "DFlashDraftModel"
    ):
        raise TypeError(
            f"This DFlash drafter was loaded as remote code ({type(drafter).__module__}); load it with "
            "`dflash_hf.DFlashDraftModel.from_pretrained(path)` to decode with dflash_hf."
        )
    if not isinstance(drafter, DFlashDraftModel):
        if CALL_OPTION in kwargs:
            raise ValueError(f"{CALL_OPTION} applies to DFlash calls only (assistant_model=<DFlashDraftModel>).")
        return type(self).generate(self, *args, **kwargs)
    call_verify_length = kwargs.pop(CALL_OPTION, _UNSET)
    if call_verify_length is not _UNSET:
        check_settings(self.__dict__[_ENABLED]["proposal"], call_verify_length)
    _check_call(self, drafter, args, kwargs)
    # The drafter shares the target's tokenizer by construction; pipelines may still pass one.
    kwargs.pop("assistant_tokenizer", None)
    token = _CALL_VERIFY_LENGTH.set(call_verify_length)
    try:
        if is_stateful(self):
            output = _generate_stateful(self, args, kwargs)
        else:
            output = type(self).generate(self, *args, **kwargs)
    finally:
        _CALL_VERIFY_LENGTH.reset(token)
    return _stop_where_plain_generate_stops(output, args, kwargs)


def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                             assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
    if isinstance(assistant_model, DFlashDraftModel):
        settings = dict(self.__dict__[_ENABLED])
        override = _CALL_VERIFY_LENGTH.get()
        if override is _UNSET:
            override = getattr(generation_config, CALL_OPTION, _UNSET)
        if override is not _UNSET:
            settings["verify_length"] = override
        return DFlashCandidateGenerator(self, assistant_model, generation_config, logits_processor, **settings)
    return type(self)._get_candidate_generator(
        self,
        generation_config=generation_config,
        input_ids=input_ids,
        inputs_tensor=inputs_tensor,
        logits_processor=logits_processor,
        model_kwargs=model_kwargs,
        assistant_model=assistant_model,
        target_tokenizer=target_tokenizer,
        assistant_tokenizer=assistant_tokenizer,
    )


def is_enabled(target) -> bool:
    return bool(getattr(target, "__dict__", {}).get(_ENABLED))


def dflash_settings(target) -> dict:
    """The settings `enable` stored on `target` (a copy), e.g. to restore them after a sweep."""
    if not is_enabled(target):
        raise ValueError("call dflash_hf.enable(target) first")
    return dict(target.__dict__[_ENABLED])


_STATEFUL_CALLS = "_dflash_stateful_calls"


def _generate_stateful(target, args, kwargs):
    """Hybrid targets run in transformers' assisted loop too, with a `RollbackCache`.

    transformers refuses stateful models there because their cache cannot be cropped; this one can
    (it snapshots before each verification and replays the committed tokens after a rejection), so
    the refusal is lifted on this instance while DFlash calls run (counted, for nested or
    concurrent calls).
    """
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise ValueError(
            f"DFlash on {type(target).__name__} manages the target's cache itself (it must be rolled back "
            "after rejected drafts); call generate without cache/past_key_values."
        )
    cache = RollbackCache(config=target.config)
    check_rollback_supported(cache.layers)
    kwargs["cache"] = cache
    with _STATEFUL_LOCK:
        target.__dict__[_STATEFUL_CALLS] = target.__dict__.get(_STATEFUL_CALLS, 0) + 1
        target.__dict__["_is_stateful"] = False
    try:
        output = type(target).generate(target, *args, **kwargs)
    finally:
        with _STATEFUL_LOCK:
            target.__dict__[_STATEFUL_CALLS] -= 1
            if target.__dict__[_STATEFUL_CALLS] == 0:
                target.__dict__.pop("_is_stateful", None)
                target.__dict__.pop(_STATEFUL_CALLS)
    if cache.replay_from is not None and kwargs.get("return_dict_in_generate"):
        # Generation ended right after a rejection: bring the returned cache to the committed tokens.
        sequences = output.sequences
        replay(target, cache, sequences, {}, attention_mask=_full_attention_mask(kwargs, sequences))
    return output


def _full_attention_mask(kwargs, sequences):
    mask = kwargs.get("attention_mask")
    if mask is None:
        return None
    return torch.cat([mask, mask.new_ones(mask.shape[0], sequences.shape[1] - mask.shape[1])], dim=-1)


def _stop_where_plain_generate_stops(output, args, kwargs):
    """transformers' assisted loop checks stopping criteria once per target forward, on the sequence
    end, and trims only EOS and max length inside an accepted block; plain generate checks them
    after every token. With `stop_strings` or `stopping_criteria`, cut the output where plain
    generate would have stopped. (A streamer has already been sent the whole block.)"""
    criteria = list(kwargs.get("stopping_criteria") or [])
    if kwargs.get("stop_strings"):
        if kwargs.get("tokenizer") is None:
            return output  # transformers raised already
        criteria.append(StopStringCriteria(kwargs["tokenizer"], kwargs["stop_strings"]))
    if not criteria:
        return output
    sequences = output.sequences if isinstance(output, ModelOutput) else output
    inputs = _prompt(args, kwargs)
    # a prompt given as inputs_embeds is not part of the returned sequences
    prompt_length = inputs.shape[1] if "inputs_embeds" not in kwargs and isinstance(inputs, torch.Tensor) else 0
    for end in range(prompt_length + 1, sequences.shape[1]):
        if any(bool(criterion(sequences[:, :end], None).any()) for criterion in criteria):
            return _truncate(output, end, sequences.shape[1] - prompt_length, end - prompt_length)
    return output


def _truncate(output, end: int, num_new: int, keep_new: int):
    if not isinstance(output, ModelOutput):
        return output[:, :end]
    output.sequences = output.sequences[:, :end]
    for name in ("scores", "logits", "attentions", "hidden_states"):
        steps = getattr(output, name, None)
        if isinstance(steps, tuple) and len(steps) == num_new:
            setattr(output, name, steps[:keep_new])
    return output


def _check_call(target: PreTrainedModel, drafter: DFlashDraftModel, args: tuple, kwargs: dict) -> None:
    """Rejects, before any forward, what DFlash cannot do (yet) with this call."""
    check_compatible(target, drafter)
    inputs = _prompt(args, kwargs)
    if inputs is not None and getattr(inputs, "ndim", 0) >= 2 and inputs.shape[0] > 1:
        raise ValueError(
            f"DFlash decodes one sequence at a time, got a batch of {inputs.shape[0]}; call generate once "
            "per prompt."
        )


def _prompt(args: tuple, kwargs: dict):
    """The prompt tensor of a `generate` call, however it was passed (ids or embeddings)."""
    return args[0] if args else kwargs.get("input_ids", kwargs.get("inputs", kwargs.get("inputs_embeds")))
