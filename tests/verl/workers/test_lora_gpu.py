"""LoRA and vLLM on a GPU (verl.workers.lora): the engine built as the trainer builds it (sleep mode,
engine core in its own process, bf16) serves the policy's adapters after a sleep and a wake, and a
merged push from CUDA tensors gives the engine the trained model too. What the engine samples is
compared with the trainer's model in fp32: nearer it than the base model by far. Skipped without
CUDA or vLLM."""
import json

import pytest
import torch

from conftest import vllm_skip_reason
from test_engines import run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RANK, ALPHA, SEED = 8, 16, 3

ENGINE_SCRIPT = """
import json, sys
import torch
from safetensors.torch import load_file
from verl.workers.lora import add_adapters, merged_state_dict_iter, vllm_lora_kwargs
from verl.workers.modeling import build_causal_lm
from verl.workers.rollout.engine import SamplingConfig
from verl.workers.rollout.vllm_engine import VLLMEngine
model_dir, adapter_dir, prompts, push = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
torch.cuda.is_available()
lora = push == "adapter"
engine = VLLMEngine(model_dir, seed=0, max_model_len=256, gpu_memory_utilization=0.2, dtype="bfloat16",
                    enable_sleep_mode=True, separate_core=True, **(vllm_lora_kwargs(%(rank)d) if lora else {}))
greedy = SamplingConfig(temperature=0, max_tokens=12, logprobs=True)
sample = lambda: [(g.token_ids, g.logprobs) for g in engine.generate(prompts, greedy, [])]
out = {"base": sample()}
engine.sleep()   # as the trainer's engine sleeps while the actor trains, then wakes for the push
engine.wake()
if lora:
    engine.load_adapter(adapter_dir)
else:   # the trainer's model on the GPU, its adapters read back from the adapter file
    model = add_adapters(build_causal_lm(model_dir), %(rank)d, %(alpha)d, "all-linear", %(seed)d, "x").cuda()
    saved = load_file(adapter_dir + "/adapter_model.safetensors")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                part = name.replace(".default.weight", ".weight")
                p.copy_(saved["base_model.model." + part])
    engine.load_weights(merged_state_dict_iter(model, dtype=engine.dtype))
out["pushed"] = sample()
engine.sleep()
engine.wake()
out["after_sleep"] = sample()
engine.shutdown()
print("RESULT", json.dumps(out), flush=True)
""" % dict(rank=RANK, alpha=ALPHA, seed=SEED)


@pytest.mark.parametrize("push", ["adapter", "merged"])
def test_the_engine_on_a_gpu_samples_the_adapted_policy(tiny_model_dir, tmp_path, push):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    from transformers import AutoTokenizer

    from verl.workers.lora import adapters_disabled, add_adapters, write_adapter
    from verl.workers.modeling import build_causal_lm
    model = add_adapters(build_causal_lm(tiny_model_dir), RANK, ALPHA, "all-linear", SEED, "x")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():   # trained adapters: B away from zero, enough to change what is sampled
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=g)
    write_adapter(model, str(tmp_path / "adapter"), tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok(q).input_ids for q in ("Who wrote Hamlet?", "The capital of France is")]
    got = run_script(ENGINE_SCRIPT, tiny_model_dir, str(tmp_path / "adapter"), json.dumps(prompts), push,
                     env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert got["after_sleep"] == got["pushed"]   # the adapters survive a sleep and a wake
    assert [t for t, _ in got["pushed"]] != [t for t, _ in got["base"]]

    def trainer_logprobs(prompt, tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]

    to_adapted, to_base = [], []
    for prompt, (tokens, engine_lp) in zip(prompts, got["pushed"]):
        engine_lp = torch.tensor(engine_lp)
        to_adapted.append((engine_lp - trainer_logprobs(prompt, tokens)).abs().mean())
        with adapters_disabled(model):
            to_base.append((engine_lp - trainer_logprobs(prompt, tokens)).abs().mean())
    # bf16 against fp32: close to the adapted model, and far nearer it than to the base
    assert max(to_adapted) < 0.1 and sum(to_adapted) < 0.25 * sum(to_base), (to_adapted, to_base)
