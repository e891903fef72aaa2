"""At most one host sync per decoding step, counted on the CPU.

On an accelerator the host waits for the device whenever it reads a value the device computed: `.item()`,
`int()`/`bool()` of a tensor (both `aten._local_scalar_dense`, or `aten.is_nonzero`), `.tolist()`, `.cpu()`,
`.numpy()`, and ops whose output shape depends on the data (`nonzero`, `masked_select`, `unique`), or that
return a Python value (`equal`). A tensor made from host data (`torch.tensor(list)`, `aten.lift_fresh`)
is a host-to-device copy there. On the CPU none of these waits, but each is still visible: `SyncCounter`
counts them (the dispatch mode sees the aten ops; `tolist`, `cpu` and `numpy` are counted by wrapping the
Tensor methods, since on the CPU they dispatch nothing) per interval between two target forwards.

Per step the loop reads one thing, the step's proposal and its accepted length; before the first target
forward it may read the prompt once (plus whatever plain `generate` itself reads before its first forward,
measured here with the same counter). Reads that the candidate generator does only where they cost no sync
(on the CPU: the drafter's confidence per slot, its first draft against a passed-over copy) are switched off
here as on an accelerator (`candidate_generator.host_reads_are_free`).

Left out: a left-padded prompt, whose attention mask the drafter's forward reads once per drafted step (whether
any token is padding), as transformers' attention-mask helpers read it in the target's forward (in plain
`generate` too). Not covered on the CPU: whether a host-to-device copy of an existing CPU tensor is blocking (the loop makes
none per step: copied runs are sliced from the sequence on the device, the block's mask tokens are made on
the device once); stop strings and custom stopping criteria, which return a device tensor per committed
token and are read one token at a time as plain `generate` reads them.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dflash_hf
import tiny
from dflash_hf.generation import candidate_generator

aten = torch.ops.aten
READS = {aten._local_scalar_dense, aten.is_nonzero, aten.nonzero, aten.masked_select, aten.equal, aten.unique_dim,
         aten._unique2, aten.unique_consecutive}
UPLOADS = {aten.lift_fresh}


class SyncCounter(TorchDispatchMode):
    """Would-be host syncs (`reads`) and host-to-device copies (`uploads`) per interval: index 0 before the first
    forward of `target`, index i after its i-th forward began. Nothing is counted inside the forward of a module
    in `unseen` (a test double's own bookkeeping)."""

    def __init__(self, target, unseen=()):
        super().__init__()
        self.reads, self.uploads, self.where = [0], [0], []
        self.paused = 0
        self.handles = [target.register_forward_pre_hook(self._next_step)]
        for module in unseen:
            self.handles += [module.register_forward_pre_hook(self._pause),
                             module.register_forward_hook(self._resume)]

    def _next_step(self, module, args):
        self.reads.append(0)
        self.uploads.append(0)

    def _pause(self, module, args):
        self.paused += 1

    def _resume(self, module, args, output):
        self.paused -= 1

    def count(self, kind: str, what: str) -> None:
        if not self.paused:
            getattr(self, kind)[-1] += 1
            self.where.append((len(self.reads) - 1, kind, what))

    def over(self, kind: str, budget: int, first: int = 1) -> list:
        """What was counted in the intervals from `first` on that exceed `budget`."""
        counts = getattr(self, kind)
        return [entry for entry in self.where if entry[1] == kind and entry[0] >= first and counts[entry[0]] > budget]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in READS or func in READS:
            self.count("reads", str(func))
        elif func.overloadpacket in UPLOADS or func in UPLOADS:
            self.count("uploads", str(func))
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)


@pytest.fixture
def counted(monkeypatch):
    """`counted(target, unseen)`: a SyncCounter that also counts Tensor.tolist / cpu / numpy."""
    active = []
    for name in ("tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, _original=original, _name=name, **kwargs):
            for counter in active:
                counter.count("reads", f"Tensor.{_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)

    def make(target, unseen=()):
        counter = SyncCounter(target, unseen)
        active.append(counter)
        return counter

    return make


@pytest.fixture(scope="module")
def looping():
    """A prompt whose greedy continuation repeats (copies are found), from a target sure enough of its tokens that
    samples mostly follow that continuation (the oracle drafts it, wrong every other step: partial acceptances)."""
    target = tiny.qwen3_target()
    with torch.no_grad():
        target.lm_head.weight.mul_(100.0)
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6]])
    script = target.generate(prompt, max_new_tokens=48, do_sample=False)
    return target, prompt, script


def plain_setup_reads(target, prompt, counted, **kwargs) -> int:
    counter = counted(target)
    with counter:
        target.generate(prompt, max_new_tokens=4, **kwargs)
    return counter.reads[0]


def assert_one_read_per_step(counter, plain_setup):
    """At most one read per step, none of host data uploaded after the prefill (whose forward makes the target's
    cache), and one read at most before the first forward beyond what plain `generate` reads there."""
    assert counter.reads[0] <= plain_setup + 1, (counter.reads[0], plain_setup, counter.over("reads", -1, first=0))
    assert max(counter.reads[1:]) <= 1, (counter.reads, counter.over("reads", 1))
    assert max(counter.uploads[2:], default=0) == 0, (counter.uploads, counter.over("uploads", 0, first=2))


@pytest.mark.parametrize("lookup", (None, "adaptive"), ids=("no-copies", "copies"))
@pytest.mark.parametrize("do_sample", (False, True), ids=("greedy", "sampling"))
def test_one_host_read_per_step_at_the_defaults(looping, counted, monkeypatch, do_sample, lookup):
    target, prompt, script = looping
    monkeypatch.setattr(candidate_generator, "host_reads_are_free", lambda device: False)
    oracle = tiny.drafter(0, cls=tiny.OracleDrafter, block_size=4).arm(script, target.get_output_embeddings(),
                                                                      wrong_every=2)
    kwargs = dict(do_sample=True, top_k=20) if do_sample else dict(do_sample=False)  # (sampling: with a processor)
    plain = plain_setup_reads(target, prompt, counted, **kwargs)
    torch.manual_seed(0)
    counter = counted(target, unseen=(oracle,))
    with counter:
        out = dflash_hf.generate(target, prompt, max_new_tokens=40, assistant_model=oracle, dflash_lookup=lookup,
                                 return_dict_in_generate=True, **kwargs)
    stats = out.dflash_stats
    assert len(counter.reads) == stats.num_target_forwards + 1
    # the modes did what they are there for: drafts accepted, copies verified where lookup is on
    assert stats.accepted_tokens > 0 and stats.drafted_tokens > stats.accepted_tokens
    assert (stats.copied_steps > 0) == (lookup is not None)
    if not do_sample:
        assert torch.equal(out.sequences, script[:, : out.sequences.shape[1]])
    assert_one_read_per_step(counter, plain)


@pytest.mark.parametrize("do_sample", (False, True), ids=("greedy", "sampling"))
def test_one_host_read_per_step_with_the_real_drafter_forward(looping, counted, monkeypatch, do_sample):
    """The real DFlash drafter's forward counted too, verifying every draft every step."""
    target, prompt, _ = looping
    monkeypatch.setattr(candidate_generator, "host_reads_are_free", lambda device: False)
    plain = plain_setup_reads(target, prompt, counted, do_sample=do_sample)
    counter = counted(target)
    with counter:
        out = dflash_hf.generate(target, prompt, max_new_tokens=24, assistant_model=tiny.drafter(0, block_size=4),
                                 do_sample=do_sample, dflash_verify_length=None, dflash_lookup=None,
                                 return_dict_in_generate=True)
    assert all(n > 0 for n in out.dflash_stats.verify_lengths[:-1])  # (the last one may lack the room)
    assert_one_read_per_step(counter, plain)


@pytest.mark.parametrize("do_sample", (False, True), ids=("greedy", "sampling"))
def test_a_batch_reads_no_more_per_step_than_plain_batched_generate(counted, do_sample):
    """Batched DFlash (generation/batched.py) reads per step the one thing the loop reads (every row's accepted
    length, tokens and drafts) and the drafter forward's check of whether its mask pads anything (a batch's mask
    always has padding or holes; batch 1 with a padded prompt reads it too): two, as many as plain batched
    `generate` reads per token (the target's mask check and the stopping criteria's), measured with the same
    counter. Uploads: one of the remaining rows' indices when rows finish, and the output at the end."""
    target = tiny.qwen3_target()
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5], [0, 8, 9, 10, 11]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [1]])).long()
    kwargs = dict(attention_mask=mask, do_sample=do_sample, pad_token_id=0)
    plain = counted(target)
    with plain:
        target.generate(ids, max_new_tokens=8, **kwargs)
    counter = counted(target)
    with counter:
        out = dflash_hf.generate(target, ids, max_new_tokens=16, assistant_model=tiny.drafter(0, block_size=4),
                                 return_dict_in_generate=True, dflash_verify_length=None, **kwargs)
    steps = [len(row.acceptance_lengths) for row in out.dflash_stats.rows]
    assert len(counter.reads) == max(steps) + 2 and min(steps) < max(steps)  # (a row finished early)
    assert counter.reads[0] <= plain.reads[0] + 1, counter.over("reads", -1, first=0)
    # (the last interval also reads the pad id for the output, and a last step with room for one token is a plain
    # step, whose forward checks its mask as plain decoding's does)
    assert max(counter.reads[2:-1]) <= min(plain.reads[2:]) == 2, (counter.reads, plain.reads, counter.over("reads", 1))
    assert counter.reads[-1] <= 3, counter.over("reads", 2, first=len(counter.reads) - 1)
    assert max(counter.uploads[2:], default=0) <= 1 and sum(counter.uploads[2:]) <= len(set(steps)), counter.uploads
    # the default, adaptive verify length: a plain step reads its target forward's mask check and its tokens, a
    # drafted one the drafter's mask check and its tokens (an interval runs from one target forward to the next, so
    # the one holding a plain step and the next step's drafter has three): two per step (the last interval holds
    # the output's reads too)
    adaptive = counted(target)
    with adaptive:
        dflash_hf.generate(target, ids, max_new_tokens=16, assistant_model=tiny.drafter(0, block_size=4), **kwargs)
    steps = adaptive.reads[2:-1]
    assert sum(steps) <= 2 * len(steps) and max(steps) <= 3, (adaptive.reads, adaptive.over("reads", 2, first=2))
