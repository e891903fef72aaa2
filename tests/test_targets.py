"""What the drafter borrows from each target family: embeddings (Gemma's scale) and logit soft-capping."""

import math

import torch
from transformers import GenerationConfig

from dflash_hf import DFlashCandidateGenerator
from dflash_hf.targets import logit_softcap
from tiny import HIDDEN, MASK_ID, drafter, gemma4_target, qwen3_target


class RecordingDrafter(type(drafter())):
    def forward(self, noise_embeds, *args, **kwargs):
        self.block_embeds = noise_embeds
        return super().forward(noise_embeds, *args, **kwargs)


def _draft_once(target, model, prompt):
    generator = DFlashCandidateGenerator(target, model, GenerationConfig(max_length=64, do_sample=False),
                                         verify_length=None)
    generator.start(prompt.tolist(), padded=False)
    with torch.no_grad():
        outputs = target(prompt, **generator.model_kwargs_overrides)
        generator.ingest(outputs)
        next_token = outputs.logits[:, -1:].argmax(-1)
        proposal = generator.propose(torch.cat([prompt, next_token], dim=-1), model_kwargs={})
        return proposal.ids, proposal.scores


def test_gemma_block_embeddings_carry_the_sqrt_hidden_scale():
    target = gemma4_target()
    model = drafter(0, cls=RecordingDrafter, block_size=4)
    prompt = torch.tensor([[5, 6, 7]])
    _draft_once(target, model, prompt)
    table = target.get_input_embeddings().weight
    block = torch.tensor([int(torch.argmax(target(prompt).logits[0, -1]))] + [MASK_ID] * 3)
    torch.testing.assert_close(model.block_embeds[0], table[block] * math.sqrt(HIDDEN))


def test_draft_logits_get_the_target_softcap():
    target = gemma4_target()
    assert logit_softcap(target) == 30.0
    with torch.no_grad():
        target.lm_head.weight.mul_(1000.0)
    _, scores = _draft_once(target, drafter(0, block_size=4), torch.tensor([[1, 2, 3]]))
    assert scores.abs().max() <= 30.0 and scores.abs().max() > 29.0

    plain = qwen3_target()
    with torch.no_grad():
        plain.lm_head.weight.mul_(1000.0)
    assert logit_softcap(plain) is None
    _, scores = _draft_once(plain, drafter(0, block_size=4), torch.tensor([[1, 2, 3]]))
    assert scores.abs().max() > 30.0
