"""How DFlash plugs into `generate()`: the `custom_generate` callable, its checks, `generate` and `enable`.

transformers' `generate(custom_generate=callable)` prepares everything (generation config, logits
processors, stopping criteria, the target's cache, attention mask, position ids) and hands the decoding
loop to the callable: `dflash_decode` checks the call, builds the candidate generator and runs
`decoding.decode`.

`generate(model, ...)` is `model.generate` with DFlash: given a DFlash drafter as `assistant_model` it
calls transformers' `generate` with `custom_generate=dflash_decode`, otherwise plain `generate`.
`enable(model)` binds it onto one instance, the way transformers binds a `custom_generate` repo's
`generate` (`model.generate = partial(generate, model=model)`), but through a weak reference, so
that dropping the last reference to the model frees it.
"""

import copy
import functools
import inspect
import warnings
import weakref

import torch
from transformers import GenerationMixin, PreTrainedModel, StoppingCriteriaList
from transformers.generation.logits_process import (
    SynthIDTextWatermarkLogitsProcessor, UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, StopStringCriteria

from ..targets import check_compatible, is_dflash_drafter
from .candidate_generator import ADAPTIVE, DFlashCandidateGenerator, check_settings
from .batched import check_batch, decode_batch
from .decoding import decode, per_token_criteria
from .stats import DFlashStats

# Logits processors of transformers that keep state across calls (each call advances it by one token), with the
# generate option that adds them: DFlash refuses them (`check_processors`). Every other processor transformers
# builds is a function of the ids and scores it is given.
STATEFUL_PROCESSORS = {
    UnbatchedClassifierFreeGuidanceLogitsProcessor: "guidance_scale",
    SynthIDTextWatermarkLogitsProcessor: "watermarking_config",
}
_SETTINGS = "_dflash_settings"  # where enable() keeps its options, in the instance's __dict__
DEFAULTS = {"proposal": "sample", "verify_length": ADAPTIVE, "lookup": ADAPTIVE}
_UNSET = object()
# Prompt tokens searched for a chat template's think markers: Qwen3's enable_thinking=False generation prompt
# ends with `<think>\n\n</think>\n\n` (4 tokens), room is left for a prefilled start of the answer.
CHAT_MODE_WINDOW = 16


def dflash_decode(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    drafter=None,
    dflash_verify_length=_UNSET,
    dflash_proposal=_UNSET,
    dflash_lookup=_UNSET,
    dflash_settings: dict | None = None,
    **model_kwargs,
):
    """DFlash speculative decoding, as a `custom_generate` callable of transformers' `generate`.

    `target.generate(ids, custom_generate=dflash_decode, drafter=drafter)` runs it directly (transformers
    then neither passes a streamer nor builds stop-string criteria: `dflash_hf.generate` or `enable` do).
    Per call, `dflash_verify_length=`, `dflash_proposal=` and `dflash_lookup=` (or the same fields of a
    `GenerationConfig`; `prompt_lookup_num_tokens=n` is `dflash_lookup=n`) override `dflash_settings`
    (what `enable` stored), see `DFlashCandidateGenerator`.
    """
    generator, eos = _start(model, drafter, input_ids, generation_config, logits_processor, model_kwargs,
                            stopping_criteria,
                            {"verify_length": dflash_verify_length, "proposal": dflash_proposal, "lookup": dflash_lookup},
                            dflash_settings)
    drafter.last_stats = stats = DFlashStats()
    if input_ids.shape[0] > 1:
        check_batch(model, logits_processor, per_token_criteria(stopping_criteria), streamer, generation_config,
                    model_kwargs.get("cache"))
        return decode_batch(model, generator, input_ids, logits_processor, generation_config, model_kwargs, eos, stats)
    return decode(model, generator, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs,
                  eos, streamer, stats)


def _start(model, drafter, input_ids, generation_config, logits_processor, model_kwargs, stopping_criteria, call, stored):
    """Checks the call before any forward and builds its candidate generator, started with the prompts; returns it
    and the EOS ids. What the call needs of the device (the prompts, whether they are padded, the EOS ids) is read
    in one transfer."""
    if drafter is None:
        raise TypeError("dflash_decode needs the drafter: generate(..., custom_generate=dflash_decode, drafter=drafter).")
    settings = {**DEFAULTS, **(stored or {})}
    for name, value in call.items():  # the call's own option, else the GenerationConfig's, else enable()'s
        if value is _UNSET:
            value = getattr(generation_config, f"dflash_{name}", _UNSET)
        if value is not _UNSET:
            settings[name] = value
    if generation_config.prompt_lookup_num_tokens is not None:  # with a DFlash drafter: copy where it can
        settings["lookup"] = generation_config.prompt_lookup_num_tokens
    check_settings(settings["proposal"], settings["verify_length"], settings["lookup"])
    if input_ids.shape[0] > 1:  # a batch verifies as many drafts in every row, never a copy (generation/batched.py)
        if settings["lookup"] not in (ADAPTIVE, None):
            raise ValueError(f"DFlash with a batch of prompts does not copy from the context (lookup="
                             f"{settings['lookup']!r}); drop prompt_lookup_num_tokens / dflash_lookup, or generate one "
                             "prompt at a time.")
        settings["lookup"] = None
    check_compatible(model, drafter)
    for name, what in {"num_beams": "beam search", "num_return_sequences": "several sequences per prompt"}.items():
        if (getattr(generation_config, name, None) or 1) > 1:
            raise ValueError(f"DFlash does not do {what} ({name}={getattr(generation_config, name)}); drop {name} or "
                             "the DFlash drafter.")
    if generation_config.output_attentions:
        raise ValueError("DFlash does not return attentions; drop output_attentions.")
    if input_ids.shape[1] == 0 and model_kwargs.get("inputs_embeds") is None:
        raise ValueError("DFlash needs a prompt of at least one token (the drafter drafts from the target's context).")
    if model_kwargs.get("cache") is None:
        raise ValueError("DFlash needs the target's cache; drop use_cache=False.")
    check_processors(logits_processor)
    embeds = model_kwargs.get("inputs_embeds")
    expected = (input_ids.shape[0], input_ids.shape[1] or (embeds.shape[1] if embeds is not None else 0))
    for name in ("attention_mask", "position_ids"):  # (generate derives the positions from the mask, then drops a
        given = model_kwargs.get(name)                # mask of ones)
        if given is not None and tuple(given.shape[-2:]) != expected:
            raise ValueError(f"The {name} has shape {tuple(given.shape)}, the prompt {expected} (batch, tokens): pass "
                             "the attention_mask the tokenizer returned with these ids (one entry per prompt token).")
    mask = model_kwargs.get("attention_mask")
    eos = next((c.eos_token_id for c in stopping_criteria if isinstance(c, EosTokenCriteria)), None)
    unpadded = mask.all() if mask is not None else input_ids.new_ones(())
    *prompts, unpadded, eos = _read(*input_ids, unpadded, eos if eos is not None else input_ids.new_zeros(0))
    if (mismatch := next(filter(None, (chat_mode_mismatch(drafter, prompt) for prompt in prompts)), None)) is not None:
        warnings.warn(mismatch, UserWarning, stacklevel=2)
    generator = DFlashCandidateGenerator(model, drafter, generation_config, logits_processor, **settings)
    generator.start(prompts, padded=not unpadded[0])
    # Linear-attention and sliding-window layers keep the states of the last tokens, to roll back to: as many as
    # the longest verify forward covers (a copied run can be longer than the block).
    model_kwargs["cache"].activate_past_recording(recurrent_states_to_keep=generator.longest_verify)
    return generator, tuple(dict.fromkeys(eos))  # in order: a batch pads with the first, as plain generate


def check_processors(logits_processor) -> None:
    """Raises a `ValueError` naming the fix for a processor that keeps state from call to call (`STATEFUL_PROCESSORS`).

    DFlash calls the logits processors on the scores of every slot it verifies, rejected drafts' included, and on
    the drafter's: a processor that is a function of the ids and scores it is given gives the committed tokens
    exactly the scores plain `generate` would, one that advances its own state per call does not."""
    for cls, option in STATEFUL_PROCESSORS.items():
        if any(isinstance(processor, cls) for processor in logits_processor or ()):
            raise ValueError(f"DFlash does not support {cls.__name__} ({option}): it keeps state from call to call, and "
                             "DFlash calls the logits processors on drafts it may reject, so its output would differ "
                             f"from plain generate. Drop {option}, or generate without the DFlash drafter.")


def _read(*tensors: torch.Tensor) -> list[list[int]]:
    """Small integer tensors (any shape) as host lists, read from the device in one transfer."""
    flat = [t.reshape(-1).to(tensors[0].device, torch.long) for t in tensors]
    values = torch.cat(flat).tolist()
    sizes = [t.numel() for t in flat]
    return [values[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]


def chat_mode_mismatch(drafter, prompt: list[int]) -> str | None:
    """The warning for a prompt rendered in another chat mode than the drafter's training prompts, else None.

    Needs the drafter config's `dflash_config.chat_template_kwargs.enable_thinking` and `think_token_ids`
    (`DFlashConfig.set_chat_mode`); without them nothing is checked. A prompt counts as rendered without
    thinking when the last think marker among its last `CHAT_MODE_WINDOW` tokens is `</think>` (the empty
    block `enable_thinking=False` templates put before the answer), else as rendered with thinking. Mismatched
    modes cost acceptance, never correctness.
    """
    dflash_config = getattr(getattr(drafter, "config", None), "dflash_config", None)
    if not isinstance(dflash_config, dict) or not prompt:
        return None
    thinking = (dflash_config.get("chat_template_kwargs") or {}).get("enable_thinking")
    think_ids = dflash_config.get("think_token_ids")
    if not isinstance(thinking, bool) or not think_ids:
        return None
    open_id, close_id = think_ids
    tail = prompt[-CHAT_MODE_WINDOW:]
    last_marker = next((token for token in reversed(tail) if token in (open_id, close_id)), None)
    if (last_marker != close_id) == thinking:
        return None
    seen = ("ends with a closed <think></think> block, as enable_thinking=False renders it" if thinking else
            "does not end with the empty <think></think> block that enable_thinking=False puts before the answer")
    return (f"This DFlash drafter was trained on prompts rendered with enable_thinking={thinking}, and this prompt "
            f"{seen}: fewer drafts will be accepted (the output is unchanged). Render prompts with "
            f"tokenizer.apply_chat_template(..., enable_thinking={thinking}).")


# ----------------------------------------------------------------------------------------- generate()
def generate(model: PreTrainedModel, *args, assistant_model=None, **kwargs):
    """`model.generate(*args, **kwargs)`, decoding with DFlash when `assistant_model` is a DFlash drafter.

    Everything of `generate` applies (streamers, stop strings, stopping criteria, logits processors,
    sampling, `return_dict_in_generate`, which then also carries `dflash_stats`); per call,
    `dflash_verify_length=` and `dflash_proposal=` override what `enable` stored.
    """
    if assistant_model is None or not is_dflash_drafter(assistant_model):
        for name in ("dflash_verify_length", "dflash_proposal", "dflash_lookup"):
            if name in kwargs:
                raise ValueError(f"{name} applies to DFlash calls only (assistant_model=<a DFlash drafter>).")
        return type(model).generate(model, *args, assistant_model=assistant_model, **kwargs)
    if args:  # name positional arguments, so that they can be inspected below
        bound = inspect.signature(GenerationMixin.generate).bind_partial(model, *args).arguments
        kwargs.update({name: value for name, value in bound.items() if name != "self"})
    if kwargs.get("custom_generate") is not None:
        raise ValueError("A DFlash drafter brings its own decoding loop; drop custom_generate.")
    kwargs.pop("assistant_tokenizer", None)  # the drafter shares the target's tokenizer; pipelines may pass it
    _take_stop_strings(model, kwargs)
    loop = functools.partial(
        dflash_decode, drafter=assistant_model, streamer=kwargs.get("streamer"),
        dflash_settings=dict(getattr(model, "__dict__", {}).get(_SETTINGS) or {}),
    )
    return type(model).generate(model, custom_generate=loop, **kwargs)


def _take_stop_strings(model, kwargs: dict) -> None:
    """transformers hands a `custom_generate` callable neither the tokenizer nor the streamer, and refuses
    stop strings without a tokenizer: turn them into a stopping criterion here, where the tokenizer is."""
    config = kwargs.get("generation_config")
    stop_strings = kwargs["stop_strings"] if "stop_strings" in kwargs else (config or model.generation_config).stop_strings
    if not stop_strings or kwargs.get("tokenizer") is None:
        return  # without a tokenizer transformers raises its own error
    criterion = StopStringCriteria(kwargs["tokenizer"], stop_strings)
    kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), criterion])
    if config is not None and "stop_strings" not in kwargs:
        kwargs["generation_config"] = config = copy.copy(config)
        config.stop_strings = None
    else:
        kwargs["stop_strings"] = None


class _BoundGenerate:
    """`model.generate` of an enabled model: `generate` bound through a weak reference."""

    def __init__(self, model: PreTrainedModel):
        self._model = weakref.ref(model)
        self.__doc__ = generate.__doc__

    def __call__(self, *args, **kwargs):
        model = self._model()
        if model is None:
            raise ReferenceError("The model of this generate() was freed; keep a reference to it: "
                                 "`model = dflash_hf.enable(model)`, then `model.generate(...)`.")
        return generate(model, *args, **kwargs)

    def __deepcopy__(self, memo):
        # copy.deepcopy(model) registers the copy in `memo` before copying its __dict__ (and so us)
        model = self._model()
        return _BoundGenerate(memo.get(id(model), model))


def enable(target: PreTrainedModel, proposal: str = "sample", verify_length: int | str | None = ADAPTIVE,
           lookup: int | str | None = ADAPTIVE):
    """Lets `target.generate(..., assistant_model=drafter)` (and pipelines) decode with a DFlash drafter.

    Only this instance changes: its `generate` becomes `dflash_hf.generate` bound to it; calls without a
    DFlash drafter run transformers' `generate` unchanged. Calling `enable` again replaces the settings.

    Args:
        target (`PreTrainedModel`): a causal LM (`AutoModelForCausalLM`), enabled in place and returned.
        proposal (`str`, defaults to `"sample"`): how drafts are proposed under `do_sample=True`
            (`"sample"`, `"argmax"` or `"match"`, see `candidate_generator.PROPOSALS`).
        verify_length (`str` or `int`, *optional*, defaults to `"adaptive"`): drafts the target verifies per
            step: `"adaptive"` picks it each step from acceptance and step costs seen so far in the call
            (plain steps when drafting does not pay); `None` all `block_size - 1`; an int at most that many.
        lookup (`int` or `str`, *optional*, defaults to `"adaptive"`): also copy up to this many tokens from
            the context where its last tokens recur, verified instead of the DFlash block when that is
            expected to pay more. `"adaptive"`: 10 tokens with the adaptive verify length, off with a fixed
            one (which would verify every copy found in place of the block); None: off. Per call
            `prompt_lookup_num_tokens=n` or `dflash_lookup=n` (None: off).
    """
    if is_dflash_drafter(target):
        raise TypeError("dflash_hf.enable takes the target model, not the drafter.")
    if not isinstance(target, PreTrainedModel) or not target.can_generate():
        raise TypeError(f"dflash_hf.enable expects a transformers model that can generate (AutoModelForCausalLM), "
                        f"got {type(target).__name__}.")
    check_settings(proposal, verify_length, lookup)
    target.__dict__[_SETTINGS] = {"proposal": proposal, "verify_length": verify_length, "lookup": lookup}
    target.generate = _BoundGenerate(target)
    return target


def is_enabled(target) -> bool:
    return _SETTINGS in getattr(target, "__dict__", {})


def dflash_settings(target) -> dict:
    """The settings `enable` stored on `target` (a copy)."""
    if not is_enabled(target):
        raise ValueError("call dflash_hf.enable(target) first")
    return dict(target.__dict__[_SETTINGS])


__all__ = ["dflash_decode", "dflash_settings", "enable", "generate", "is_enabled"]
