"""transformers generation features keep working with a DFlash drafter."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer, pipeline
from transformers.generation.streamers import BaseStreamer
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import dflash_hf
from tiny import OracleDrafter, drafter, qwen3_target, tokenizer


@pytest.fixture(scope="module")
def pair():
    target = dflash_hf.enable(qwen3_target(), verify_length=None)
    return target, drafter(0, block_size=4), tokenizer()


def _oracle_for(target, prompt, max_new_tokens, block_size=8, **generate_kwargs):
    expected = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **generate_kwargs)
    oracle = drafter(0, cls=OracleDrafter, block_size=block_size).arm(expected, target.get_output_embeddings())
    return expected, oracle


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_committed_tokens_in_order(pair):
    target, _, _ = pair
    prompt = torch.tensor([[3, 4, 5, 6]])
    expected, oracle = _oracle_for(target, prompt, 20)
    streamer = Collect()
    output = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=oracle, streamer=streamer)
    assert torch.equal(output, expected) and streamer.ended
    assert streamer.chunks[0] == prompt[0].tolist()
    assert sum(streamer.chunks[1:], []) == output[0, prompt.shape[1]:].tolist()
    assert max(len(chunk) for chunk in streamer.chunks[1:]) > 1  # whole accepted blocks at once


def test_text_streamer_prints_the_generated_text(pair, capsys):
    target, model, tok = pair
    inputs = tok("def fib(n):", return_tensors="pt")
    output = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=model,
                             streamer=TextStreamer(tok, skip_prompt=True))
    printed = capsys.readouterr().out
    assert printed.strip() == tok.decode(output[0, inputs.input_ids.shape[1]:]).strip()


def test_several_eos_tokens(pair):
    target, _, _ = pair
    prompt = torch.tensor([[9, 8, 7]])
    reference = target.generate(prompt, max_new_tokens=25, do_sample=False)
    eos = [int(reference[0, 3 + 12]), int(reference[0, 3 + 6])]
    expected, oracle = _oracle_for(target, prompt, 25, eos_token_id=eos)
    assert expected.shape[1] <= 3 + 7
    oracle.arm(reference, target.get_output_embeddings())
    actual = target.generate(prompt, max_new_tokens=25, do_sample=False, eos_token_id=eos, assistant_model=oracle)
    assert torch.equal(actual, expected)


def test_stop_strings(pair):
    target, model, tok = pair
    inputs = tok("hello", return_tensors="pt")
    reference = target.generate(**inputs, max_new_tokens=20, do_sample=False)
    stop = tok.decode(reference[0, 5 + 7])  # the 8th new word
    expected = target.generate(**inputs, max_new_tokens=20, do_sample=False, stop_strings=stop, tokenizer=tok)
    actual = target.generate(**inputs, max_new_tokens=20, do_sample=False, stop_strings=stop, tokenizer=tok,
                             assistant_model=model)
    assert expected.shape[1] < reference.shape[1]
    assert torch.equal(actual, expected)  # stop strings are checked after every committed token


def test_custom_stopping_criteria(pair):
    target, model, _ = pair

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 10, dtype=torch.bool)

    prompt = torch.tensor([[1, 2, 3]])
    criteria = StoppingCriteriaList([StopAtLength()])
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    actual = target.generate(prompt, max_new_tokens=30, do_sample=False, stopping_criteria=criteria,
                             assistant_model=model)
    assert torch.equal(actual, expected) and actual.shape[1] == 10


def test_attention_mask_and_left_padding(pair):
    target, model, _ = pair
    prompt = torch.tensor([[62, 62, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    expected = target.generate(prompt, attention_mask=mask, max_new_tokens=15, do_sample=False)
    actual = target.generate(prompt, attention_mask=mask, max_new_tokens=15, do_sample=False, assistant_model=model)
    assert torch.equal(actual, expected)
    ones = torch.ones_like(prompt)
    expected = target.generate(prompt, attention_mask=ones, max_new_tokens=15, do_sample=False)
    actual = target.generate(prompt, attention_mask=ones, max_new_tokens=15, do_sample=False, assistant_model=model)
    assert torch.equal(actual, expected)


def test_return_dict_in_generate(pair):
    target, _, _ = pair
    prompt = torch.tensor([[4, 4, 2]])
    expected, oracle = _oracle_for(target, prompt, 14)
    out = target.generate(prompt, max_new_tokens=14, do_sample=False, assistant_model=oracle,
                          return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert torch.equal(out.sequences, expected)
    assert len(out.scores) == len(out.logits) == 14
    assert torch.equal(torch.stack(out.scores, 1).argmax(-1), expected[:, 3:])


def test_output_hidden_states_match_plain_generate(pair):
    """Per step DFlash returns the hidden states of the committed positions only: laid end to end they are
    plain generate's, position by position."""
    target, _, _ = pair
    prompt = torch.tensor([[4, 5, 6]])
    expected, oracle = _oracle_for(target, prompt, 12)
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                            output_hidden_states=True)
    out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=oracle,
                          return_dict_in_generate=True, output_hidden_states=True)
    assert torch.equal(out.sequences, expected) and len(out.hidden_states) < len(plain.hidden_states)
    for layer in range(len(plain.hidden_states[0])):
        ours = torch.cat([step[layer] for step in out.hidden_states], dim=1)
        theirs = torch.cat([step[layer] for step in plain.hidden_states], dim=1)
        assert ours.shape == theirs.shape == (1, 3 + 12 - 1, theirs.shape[-1])
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_chat_template_and_pipeline(pair):
    target, model, tok = pair
    logger = logging.get_logger("transformers.pipelines.base")
    with CaptureLogger(logger) as captured:
        pipe = pipeline("text-generation", model=target, tokenizer=tok)
    assert "not supported" not in captured.out
    messages = [{"role": "user", "content": "write fib"}]
    expected = pipe(messages, max_new_tokens=10, do_sample=False)
    actual = pipe(messages, max_new_tokens=10, do_sample=False, assistant_model=model)
    assert actual == expected
    assert model.last_stats.committed_tokens == 9
    text_expected = pipe("x = 1", max_new_tokens=8, do_sample=False)
    assert pipe("x = 1", max_new_tokens=8, do_sample=False, assistant_model=model) == text_expected
    # a pipeline may hand over the (shared) tokenizer for the assistant too
    assert pipe("x = 1", max_new_tokens=8, do_sample=False, assistant_model=model,
                assistant_tokenizer=tok) == text_expected


def test_stop_string_inside_an_accepted_block_stops_like_plain_generate(pair):
    target, _, tok = pair
    inputs = tok("hello", return_tensors="pt")
    reference = target.generate(**inputs, max_new_tokens=30, do_sample=False)
    new = reference[0, 5:].tolist()
    # a two-character stop string that first completes at new token 4..14: inside the first 16-block
    index = next(i for i in range(4, 15) if tok.decode(new[i - 1 : i + 1]) not in tok.decode(new[:i]))
    stop = tok.decode(new[index - 1 : index + 1])
    expected = target.generate(**inputs, max_new_tokens=30, do_sample=False, stop_strings=stop, tokenizer=tok,
                               return_dict_in_generate=True, output_scores=True)
    oracle = drafter(0, cls=OracleDrafter, block_size=16).arm(reference, target.get_output_embeddings())
    actual = target.generate(**inputs, max_new_tokens=30, do_sample=False, stop_strings=stop, tokenizer=tok,
                             assistant_model=oracle, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(actual.scores) == len(expected.scores)
    # one verification of 15 (all right) drafts gave every token up to the stop string, which cut the block
    assert oracle.last_stats.verify_lengths == [15] and oracle.last_stats.acceptance_lengths[0] == actual.sequences.shape[1] - 6


def test_stopping_criteria_inside_an_accepted_block(pair):
    target, _, _ = pair

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 9, dtype=torch.bool)

    prompt = torch.tensor([[1, 2, 3]])
    reference = target.generate(prompt, max_new_tokens=30, do_sample=False)
    criteria = StoppingCriteriaList([StopAtLength()])
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    oracle = drafter(0, cls=OracleDrafter, block_size=16).arm(reference, target.get_output_embeddings())
    actual = target.generate(prompt, max_new_tokens=30, do_sample=False, stopping_criteria=criteria,
                             assistant_model=oracle)
    assert torch.equal(actual, expected) and actual.shape[1] == 9


def test_prompt_as_inputs_embeds(pair):
    target, _, _ = pair
    prompt = torch.tensor([[3, 4, 5, 6, 7]])
    embeds = target.get_input_embeddings()(prompt).detach()
    expected = target.generate(inputs_embeds=embeds, max_new_tokens=20, do_sample=False)
    oracle = drafter(0, cls=OracleDrafter, block_size=8).arm(torch.cat([prompt, expected], dim=1),
                                                             target.get_output_embeddings())
    actual = target.generate(inputs_embeds=embeds, max_new_tokens=20, do_sample=False, assistant_model=oracle)
    assert torch.equal(actual, expected)
    assert oracle.context_lengths[0] == prompt.shape[1]  # the drafter saw the embedded prompt's context
    assert oracle.last_stats.mean_acceptance_length > 2
