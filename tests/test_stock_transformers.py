"""Our drafters run through stock transformers' own DFlash (`speculation_type="dflash"`), in a process
where dflash_hf cannot be imported: the saved folder (z-lab format + modeling_dflash.py) is all it needs."""

import json
import subprocess
import sys
import textwrap

import torch

from tiny import drafter, qwen3_target

STOCK_RUN = textwrap.dedent(
    """
    import json, sys
    sys.modules["dflash_hf"] = None  # importing dflash_hf fails from here on
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    folder = sys.argv[1]
    target = AutoModelForCausalLM.from_pretrained(folder + "/target").eval()
    forwards = []
    target.register_forward_hook(lambda module, args, output: forwards.append(1))
    results = {}
    for name in ("random", "sliding", "all_accept"):
        drafter = AutoModel.from_pretrained(folder + "/" + name, trust_remote_code=True).eval()
        assert "dflash_hf" not in type(drafter).__module__
        prompt = torch.tensor([[5, 6, 7, 8]])
        plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
        forwards.clear()
        stock = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                                speculation_type="dflash")
        results[name] = {"identical": bool(torch.equal(plain, stock)), "target_forwards": len(forwards),
                         "new_tokens": stock.shape[1] - prompt.shape[1]}
    print(json.dumps(results))
    """
)


def _all_accept_pair():
    """A target whose final norm is zero predicts token 0 everywhere, and so does a drafter whose norm is
    zero (both read the target's lm_head): every draft is accepted."""
    target, model = qwen3_target(), drafter(0, block_size=4)
    with torch.no_grad():
        target.model.norm.weight.zero_()
        model.norm.weight.zero_()
    return target, model


def test_stock_speculation_type_dflash_runs_our_drafters(tmp_path):
    target, all_accept = _all_accept_pair()
    target.save_pretrained(tmp_path / "target")
    all_accept.save_pretrained(tmp_path / "all_accept")
    drafter(1, block_size=4).save_pretrained(tmp_path / "random")
    drafter(2, block_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=3).save_pretrained(
        tmp_path / "sliding")
    run = subprocess.run([sys.executable, "-c", STOCK_RUN, str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(result["identical"] and result["new_tokens"] == 24 for result in results.values()), results
    # blocks of 4: the prefill, then 3 drafts + 1 bonus token per verification forward
    assert results["all_accept"]["target_forwards"] <= 1 + 24 // 4
    assert results["random"]["target_forwards"] > 12  # a random drafter is (almost) never right
