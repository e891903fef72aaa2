"""Tiny random targets and drafters built in-process (no Hub), plus an oracle drafter test double."""

import torch
from transformers import (
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflash_hf import DFlashConfig, DFlashDraftModel

# vocab == hidden keeps lm_head square, so the oracle can invert it exactly.
VOCAB = 64
HIDDEN = 64
MASK_ID = VOCAB - 1
TARGET_LAYERS = 4


def _common(**overrides):
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return kwargs


def qwen3_target(seed=0, **overrides):
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**_common(**overrides))).eval()


def llama_target(seed=0, **overrides):
    torch.manual_seed(seed)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return LlamaForCausalLM(LlamaConfig(**_common(rope_parameters=rope, **overrides))).eval()


def gemma4_target(seed=0, moe=False, **overrides):
    torch.manual_seed(seed)
    extra = dict(
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
        global_head_dim=16,
    )
    if moe:
        extra.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    extra.update(overrides)
    return Gemma4ForCausalLM(Gemma4TextConfig(**_common(**extra))).eval()


TARGETS = {"qwen3": qwen3_target, "llama": llama_target, "gemma4": gemma4_target,
           "gemma4-moe": lambda seed=0, **kw: gemma4_target(seed, moe=True, **kw)}


def drafter_config(block_size=4, target_layer_ids=(1, 3), num_layers=2, **overrides):
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        block_size=block_size,
        num_target_layers=TARGET_LAYERS,
        dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": list(target_layer_ids)},
    )
    kwargs.update(overrides)
    return DFlashConfig(**kwargs)


def drafter(seed=0, cls=DFlashDraftModel, **config_overrides):
    torch.manual_seed(seed + 1000)
    return cls(drafter_config(**config_overrides)).eval()


class OracleDrafter(DFlashDraftModel):
    """Runs the real drafter forward (cache and all), then replaces its output with hidden states
    that make the target's lm_head pick `script[position]` at every block slot.

    `script` is the target's own greedy continuation (prompt included); `wrong_every`: every n-th
    step, slot `wrong_slot` drafts a wrong token, so partial acceptances happen too.
    It also checks the context bookkeeping: each step the drafter receives exactly the committed
    tokens its cache does not hold yet, at contiguous positions.
    """

    script: torch.Tensor
    lm_head: torch.nn.Linear
    wrong_every: int = 0
    wrong_slot: int = 2
    logit_scale: float = 20.0  # how sure the oracle is: lower spreads its q over other tokens
    slot_scales: dict = {}  # block slot -> its own logit scale (an oracle unsure of some slots)

    def arm(self, script, lm_head, wrong_every=0, wrong_slot=2):
        self.script, self.lm_head = script[0], lm_head
        self.wrong_every, self.wrong_slot, self.steps = wrong_every, wrong_slot, 0
        self.context_lengths = []
        return self

    def forward(self, noise_embeds, context_hidden_states, position_ids, attention_mask=None, cache=None, **kwargs):
        cached = cache.get_seq_length() if cache is not None else 0
        first_position = int(position_ids[0, 0])
        assert first_position == cached, f"context restarts at {first_position}, cache holds {cached}"
        assert position_ids.shape[1] == context_hidden_states.shape[1] + noise_embeds.shape[1]
        self.context_lengths.append(context_hidden_states.shape[1])
        output = super().forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache, **kwargs)

        block_positions = position_ids[0, -noise_embeds.shape[1]:]
        wanted = torch.zeros_like(block_positions)
        in_script = block_positions < self.script.shape[0]
        wanted[in_script] = self.script[block_positions[in_script]]
        self.steps += 1
        if self.wrong_every and self.steps % self.wrong_every == 0 and self.wrong_slot < wanted.shape[0]:
            wanted[self.wrong_slot] = (wanted[self.wrong_slot] + 1) % (self.lm_head.weight.shape[0] - 1)
        weight = self.lm_head.weight.detach().float()
        scales = torch.full((wanted.shape[0], 1), self.logit_scale)
        for slot, scale in self.slot_scales.items():
            scales[slot] = scale
        targets = torch.nn.functional.one_hot(wanted, weight.shape[0]).float() * scales
        hidden = (torch.linalg.pinv(weight) @ targets.T).T  # lm_head(hidden) == targets (vocab <= hidden)
        output.last_hidden_state = hidden[None].to(output.last_hidden_state.dtype)
        return output


def tokenizer():
    """A character-level tokenizer over the tiny vocabulary (61 characters, <unk>, <eos>, <mask>)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;()[]=+-*/_'!?#<>{}%&"
    assert len(characters) == VOCAB - 3
    vocab = {c: i for i, c in enumerate(characters)}
    vocab.update({"<unk>": VOCAB - 3, "<eos>": VOCAB - 2, "<mask>": MASK_ID})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>",
                                  pad_token="<eos>", mask_token="<mask>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tok


class ForwardCounter:
    """Counts the forward calls of a module while in a `with` block (target forwards, drafter forwards)."""

    def __init__(self, module):
        self.module, self.count = module, 0

    def __enter__(self):
        self.handle = self.module.register_forward_pre_hook(self._seen)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def _seen(self, module, args):
        self.count += 1


class BatchOracleDrafter(DFlashDraftModel):
    """The oracle for a batch: `scripts[r]` is row r's greedy continuation indexed by the row's own positions (its
    first real token at 0). A row is recognised by its anchor (token and position), since finished rows leave the
    batch; `wrong(row, step)` gives the block slot that drafts a wrong token in that step (None: none), so that
    rows accept different numbers of drafts."""

    scripts: list
    logit_scale: float = 20.0

    def arm(self, scripts, target, wrong=lambda row, step: None):
        self.scripts, self.wrong, self.steps = [s.tolist() for s in scripts], wrong, 0
        self.lm_head, self._embeddings = target.get_output_embeddings(), target.get_input_embeddings()
        return self

    def forward(self, noise_embeds, context_hidden_states, position_ids, attention_mask=None, cache=None, **kwargs):
        output = super().forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache, **kwargs)
        block = noise_embeds.shape[1]
        weight = self.lm_head.weight.detach().float()
        table = self._embeddings.weight.detach().float()
        anchors = torch.cdist(noise_embeds[:, 0].float(), table).argmin(-1).tolist()  # the anchor's own embedding
        hidden = []
        for i, start in enumerate(position_ids[:, -block:][:, 0].tolist()):
            row = next((r for r, s in enumerate(self.scripts) if start < len(s) and s[start] == anchors[i]), None)
            script = self.scripts[row] if row is not None else []
            wanted = [script[p] if p < len(script) else 0 for p in range(start, start + block)]
            slot = self.wrong(row, self.steps) if row is not None else None
            if slot is not None and 0 < slot < block:
                wanted[slot] = (wanted[slot] + 1) % (weight.shape[0] - 1)
            targets = torch.nn.functional.one_hot(torch.tensor(wanted), weight.shape[0]).float() * self.logit_scale
            hidden.append((torch.linalg.pinv(weight) @ targets.T).T)
        self.steps += 1
        output.last_hidden_state = torch.stack(hidden).to(output.last_hidden_state.dtype)
        return output
