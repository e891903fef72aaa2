"""DFlash inside `generate()` and `pipeline()`, offline on a CPU, with tiny models built in-process.

Swap the two constructors for real checkpoints to run a real pair:

    target = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-8B", dtype="auto")
    drafter = dflash_hf.DFlashDraftModel.from_pretrained("z-lab/Qwen3-8B-DFlash-b16")
"""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash_hf

torch.manual_seed(0)
target = Qwen3ForCausalLM(Qwen3Config(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
)).eval()
drafter = dflash_hf.DFlashDraftModel(dflash_hf.DFlashConfig(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    block_size=8, num_target_layers=8, dflash_config={"mask_token_id": 1023},  # target_layer_ids derived: [1, 5]
)).eval()

dflash_hf.enable(target)  # this instance only; nothing global changes
prompt = torch.randint(0, 1000, (1, 12))
plain = target.generate(prompt, max_new_tokens=32, do_sample=False)
dflash = target.generate(prompt, max_new_tokens=32, do_sample=False, assistant_model=drafter)

stats = drafter.last_stats
print("identical to plain greedy:", torch.equal(plain, dflash))
print("target forwards:", stats.num_target_forwards, "acceptance lengths:", stats.acceptance_lengths)
print(f"tau = {stats.mean_acceptance_length:.2f} (an untrained drafter: ~1; a trained one: 3-7)")
assert torch.equal(plain, dflash)
