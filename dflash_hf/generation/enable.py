"""`dflash_hf.enable(target)`: one target instance learns to draft with a DFlash drafter.

Only that instance changes, and only when `generate` gets a `DFlashDraftModel` as
`assistant_model`: its `_get_candidate_generator` then returns our candidate generator, and
transformers' own assisted-generation loop verifies the drafts. Its class, config, other
generation modes and every other model are untouched.
"""

import functools
import types

from transformers import PreTrainedModel

from ..modeling_dflash import DFlashDraftModel
from ..targets import check_compatible, is_stateful
from .candidate_generator import PROPOSALS, DFlashCandidateGenerator
from .rollback import RollbackCache, check_rollback_supported

_ENABLED = "_dflash_enabled"


def enable(target: PreTrainedModel, proposal: str = "sample", verify_length: int | None = None) -> PreTrainedModel:
    """Lets `target.generate(..., assistant_model=drafter)` use a DFlash drafter. Returns `target`.

    Args:
        target (`PreTrainedModel`): a causal LM (`AutoModelForCausalLM`), enabled in place.
        proposal (`str`, defaults to `"sample"`): how drafts are proposed under `do_sample=True`
            (`"argmax"`, `"sample"` or `"match"`, see `candidate_generator.PROPOSALS`); greedy
            decoding ignores it.
        verify_length (`int`, *optional*): verify at most this many drafts per target forward
            (default: all `block_size - 1`). Calling `enable` again changes both settings.
    """
    if isinstance(target, DFlashDraftModel):
        raise TypeError("dflash_hf.enable takes the target model, not the drafter.")
    if not isinstance(target, PreTrainedModel) or not target.can_generate():
        raise TypeError(
            f"dflash_hf.enable expects a transformers model that can generate (AutoModelForCausalLM), "
            f"got {type(target).__name__}."
        )
    if proposal not in PROPOSALS:
        raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
    if verify_length is not None and (not isinstance(verify_length, int) or verify_length < 1):
        raise ValueError(f"verify_length must be a positive int or None, got {verify_length!r}")
    if target.__dict__.get(_ENABLED):
        target.__dict__[_ENABLED].update(proposal=proposal, verify_length=verify_length)
        return target
    settings = {"proposal": proposal, "verify_length": verify_length}
    original_generate = target.generate
    original_get_candidate_generator = target._get_candidate_generator

    @functools.wraps(original_generate)
    def generate(*args, **kwargs):
        drafter = kwargs.get("assistant_model")
        if drafter is not None and not isinstance(drafter, DFlashDraftModel) and (
            type(drafter).__name__ == "DFlashDraftModel"
        ):
            raise TypeError(
                f"This DFlash drafter was loaded as remote code ({type(drafter).__module__}); load it with "
                "`dflash_hf.DFlashDraftModel.from_pretrained(path)` to decode with dflash_hf."
            )
        if isinstance(drafter, DFlashDraftModel):
            _check_call(target, drafter, args, kwargs)
            # The drafter shares the target's tokenizer by construction; pipelines may still pass one.
            kwargs.pop("assistant_tokenizer", None)
            if is_stateful(target):
                return _generate_stateful(target, original_generate, args, kwargs)
        return original_generate(*args, **kwargs)

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        if isinstance(assistant_model, DFlashDraftModel):
            return DFlashCandidateGenerator(self, assistant_model, generation_config, logits_processor, **settings)
        return original_get_candidate_generator(
            generation_config=generation_config,
            input_ids=input_ids,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            model_kwargs=model_kwargs,
            assistant_model=assistant_model,
            target_tokenizer=target_tokenizer,
            assistant_tokenizer=assistant_tokenizer,
        )

    target.generate = generate
    target._get_candidate_generator = types.MethodType(_get_candidate_generator, target)
    target.__dict__[_ENABLED] = settings
    return target


def is_enabled(target) -> bool:
    return bool(getattr(target, "__dict__", {}).get(_ENABLED))


def dflash_settings(target) -> dict:
    """The settings `enable` stored on `target` (a copy), e.g. to restore them after a sweep."""
    if not is_enabled(target):
        raise ValueError("call dflash_hf.enable(target) first")
    return dict(target.__dict__[_ENABLED])


def _generate_stateful(target, original_generate, args, kwargs):
    """Hybrid targets run in transformers' assisted loop too, with a `RollbackCache`.

    transformers refuses stateful models there because their cache cannot be cropped; this one can
    (it snapshots before each verification and replays the committed tokens after a rejection), so
    the refusal is lifted for this call on this instance only.
    """
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        raise ValueError(
            f"DFlash on {type(target).__name__} manages the target's cache itself (it must be rolled back "
            "after rejected drafts); call generate without cache/past_key_values."
        )
    cache = RollbackCache(config=target.config)
    check_rollback_supported(cache.layers)
    kwargs["cache"] = cache
    target.__dict__["_is_stateful"] = False
    try:
        return original_generate(*args, **kwargs)
    finally:
        del target.__dict__["_is_stateful"]


def _check_call(target: PreTrainedModel, drafter: DFlashDraftModel, args: tuple, kwargs: dict) -> None:
    """Rejects, before any forward, what DFlash cannot do (yet) with this call."""
    check_compatible(target, drafter)
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs", kwargs.get("inputs_embeds")))
    if inputs is not None and getattr(inputs, "ndim", 0) >= 2 and inputs.shape[0] > 1:
        raise ValueError(
            f"DFlash decodes one sequence at a time, got a batch of {inputs.shape[0]}; call generate once "
            "per prompt."
        )
