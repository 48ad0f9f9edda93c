"""Engines on a tiny random Llama with SmolLM2's tokenizer: batching, determinism, length limit and
stop strings, for transformers and for vLLM on CPU.

A random model never writes "</search>", so stop strings are taken from its own greedy output: a
piece of text that ends at a token boundary, which a second greedy run must stop right after.
"""

import asyncio
import gzip
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import vllm_skip_reason
from verl.workers.rollout.engine import Generation, SamplingConfig
from verl.workers.rollout.engine_by_name import create_engine
from verl.workers.rollout.hf_engine import HFEngine
from verl.workers.rollout.vllm_engine import VLLMEngine

GREEDY = SamplingConfig(temperature=0, max_tokens=24)
QUESTIONS = ["Who wrote Hamlet?", "What is the capital of France? Answer briefly.", "Hi"]
# Small explicit KV cache: vLLM then skips its warm-up and leaves the RAM of a CI machine alone.
VLLM_KW = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def hf_engine(tiny_model):
    return HFEngine(tiny_model, seed=0)


@pytest.fixture(scope="module")
def vllm_engine(tiny_model):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    return VLLMEngine(tiny_model, seed=0, **VLLM_KW)


@pytest.fixture(params=["hf", pytest.param("vllm", marks=pytest.mark.e2e)])
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture(scope="module")
def prompts(hf_engine):
    tok = hf_engine.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    return [tok(text).input_ids for text in texts]


def decode(tokenizer, ids):
    # Engines match stop strings on text without special tokens, as vLLM detokenizes it.
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_batch_gives_one_generation_per_prompt_in_order(engine, prompts):
    batch = engine.generate(prompts, GREEDY, stop=[])
    assert len(batch) == len(prompts) and all(isinstance(g, Generation) for g in batch)
    singles = [engine.generate([p], GREEDY, stop=[])[0] for p in prompts]
    assert [g.token_ids for g in batch] == [g.token_ids for g in singles]
    assert len({tuple(g.token_ids) for g in batch}) > 1, "prompts should give different outputs"


def test_greedy_is_deterministic(engine, prompts):
    first = engine.generate(prompts, GREEDY, stop=[])
    assert engine.generate(prompts, GREEDY, stop=[]) == first


def test_length_limit(engine, prompts):
    generations = engine.generate(prompts, SamplingConfig(temperature=0, max_tokens=5), stop=[])
    assert [(len(g.token_ids), g.finish_reason, g.stop_reason) for g in generations] == [(5, "length", None)] * 3


@pytest.mark.parametrize("end", [0, 2], ids=["at-token-end", "inside-token"])
def test_stop_string_ends_output_and_is_included(engine, prompts, end):
    tok = engine.tokenizer
    reference = engine.generate(prompts[:1], GREEDY, stop=[])[0].token_ids
    # A piece of the greedy text ending at a token boundary (or `end` characters before it),
    # clear of partial UTF-8.
    k = next(k for k in range(len(reference) // 2, len(reference))
             if "\ufffd" not in decode(tok, reference[:k]) and decode(tok, reference[:k])[-6:-2].strip())
    text = decode(tok, reference[:k])
    stop = text[len(text) - 6:len(text) - end]
    # The output ends with the token that completes the first occurrence of the stop string.
    cut = next(j for j in range(1, k + 1) if stop in decode(tok, reference[:j]))

    generation = engine.generate(prompts[:1], GREEDY, stop=["</never>", stop])[0]
    assert generation == Generation(reference[:cut], "stop", stop)
    assert stop in decode(tok, generation.token_ids) and stop not in decode(tok, generation.token_ids[:-1])


def test_sampling_is_seeded(engine, prompts):
    sampling = SamplingConfig(temperature=1.0, max_tokens=8)
    generations = engine.generate([prompts[0]] * 4, sampling, stop=[])
    assert len({tuple(g.token_ids) for g in generations}) > 1, "samples of one prompt should differ"


def test_reseed_repeats_the_samples_of_unseeded_requests(engine, prompts):
    """`reseed` restarts the stream that unseeded requests draw from (the trainer's
    rollout.request_seeds=false), in vLLM's worker as in transformers; vLLM on CPU, which ignores a
    request's own seed, is seeded this way too."""
    sampling = SamplingConfig(temperature=1.0, max_tokens=8)

    def sample(seed):
        torch.rand(5)  # other work moved the stream on
        engine.reseed(seed)
        return [g.token_ids for g in engine.generate(prompts, sampling, stop=[])]

    first = sample(3)
    assert sample(3) == first and sample(4) != first


def test_hf_seed_reproduces_samples(hf_engine, prompts):
    sampling = SamplingConfig(temperature=1.0, max_tokens=8, seed=7)
    assert hf_engine.generate(prompts, sampling, stop=[]) == hf_engine.generate(prompts, sampling, stop=[])


def test_hf_eos_ends_output_without_stop_reason(hf_engine, prompts, monkeypatch):
    # The random model never writes <|im_end|>: declare a token of its greedy output to be EOS.
    reference = hf_engine.generate(prompts[:1], GREEDY, stop=[])[0].token_ids
    eos = reference[5]
    monkeypatch.setattr(hf_engine, "eos_ids", {eos})
    generation = hf_engine.generate(prompts[:1], GREEDY, stop=[])[0]
    assert generation == Generation(reference[:reference.index(eos) + 1], "stop", None)


def test_generate_one_batches_concurrent_calls(engine, prompts, monkeypatch):
    calls = []
    generate = engine._batcher._generate
    monkeypatch.setattr(engine._batcher, "_generate",
                        lambda ps, s, stop: calls.append(len(ps)) or generate(ps, s, stop))

    async def run():
        return await asyncio.gather(*[engine.generate_one(p, GREEDY, []) for p in prompts])

    assert asyncio.run(run()) == engine.generate(prompts, GREEDY, stop=[])
    assert calls == [len(prompts)]


# Pushes noisy weights into a VLLMEngine and then the originals, from tensors on argv[3] ("cpu":
# shared-memory handles when the core has its own process; "cuda": CUDA IPC handles).
CHILD_CORE_SCRIPT = """
import json, sys, time
from pathlib import Path
import torch
from safetensors.torch import load_file
from verl.workers.rollout.engine import SamplingConfig
from verl.workers.rollout.vllm_engine import VLLMEngine
model, prompts, device = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
torch.cuda.is_available()  # as every GPU code path asks first: after it, a forked engine core dies
engine = VLLMEngine(model, seed=0, max_model_len=512, kv_cache_memory_bytes=64 << 20)
greedy = SamplingConfig(temperature=0, max_tokens=24)
before = [g.token_ids for g in engine.generate(prompts, greedy, [])]
original = {k: v.to(device) for k, v in load_file(str(Path(model) / "model.safetensors")).items()}
g = torch.Generator().manual_seed(0)
noisy = {k: v + 0.5 * torch.randn(v.shape, generator=g).to(device) if v.dim() == 2 else v for k, v in original.items()}
t0 = time.perf_counter()
engine.load_weights(noisy.items())
push_s = time.perf_counter() - t0
changed = [g.token_ids for g in engine.generate(prompts, greedy, [])]
engine.load_weights(original.items())
after = [g.token_ids for g in engine.generate(prompts, greedy, [])]
sampled = []
for seed in (3, 3, 4):  # reseed reaches the engine's worker, wherever it runs; one request, so that its
    engine.reseed(seed)  # batch (and row of noise) cannot depend on when a child core received it
    sampled.append(engine.generate(prompts[:1], SamplingConfig(temperature=1.0, max_tokens=12), [])[0].token_ids)
engine.shutdown()
print("RESULT", json.dumps({"in_process": engine.in_process, "before": before, "changed": changed, "after": after,
                            "push_s": push_s, "sampled": sampled}), flush=True)
"""


def run_script(script: str, *args: str, env: dict | None = None):
    """A Python script in a process of its own, with the repository on its path; returns what it
    printed after "RESULT " (JSON)."""
    root = Path(__file__).resolve().parents[3]
    # The repository first, then whatever the caller had on the path (packages installed with --target).
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, cwd=root,
                       env={**os.environ, "PYTHONPATH": path, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])


def run_child_core_script(model: str, prompts, device: str, separate: bool) -> dict:
    """CHILD_CORE_SCRIPT in a process of its own (vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING once per process)."""
    return run_script(CHILD_CORE_SCRIPT, model, json.dumps(prompts), device,
                      env={"VLLM_ENABLE_V1_MULTIPROCESSING": str(int(separate))})


@pytest.mark.e2e
def test_vllm_engine_core_in_a_child_process(tiny_model, vllm_engine, prompts):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1 puts vLLM's engine core in a child process (the trainer's
    rollout.engine_core=separate): the same generations as in-process, and weights pushed from this
    process (as shared-memory handles) take effect there and can be restored. A process of its own:
    vLLM reads the variable once per process."""
    got = run_child_core_script(tiny_model, prompts, "cpu", separate=True)
    assert vllm_engine.in_process and not got["in_process"]
    assert got["before"] == [g.token_ids for g in vllm_engine.generate(prompts, GREEDY, stop=[])]
    assert got["changed"] != got["before"] and got["after"] == got["before"]
    assert got["sampled"][0] == got["sampled"][1] != got["sampled"][2]


def test_engine_core_is_spawned_unless_the_user_chose(monkeypatch, caplog):
    """A child engine core is spawned: PyTorch forbids CUDA in a child forked after it counted the
    GPUs, although vLLM then still sees CUDA uninitialised and would fork. A user's choice stays."""
    from verl.workers.rollout.vllm_engine import _spawn_engine_core
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    _spawn_engine_core()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    _spawn_engine_core()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    assert "forked engine core fails" in caplog.text


def test_create_engine_names_the_key_that_chose_an_unknown_engine(tiny_model):
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.name='sglang': use vllm or hf"):
        create_engine("sglang", tiny_model, key="actor_rollout_ref.rollout.name")


def test_create_engine_builds_the_hf_engine_on_the_cpu(tiny_model):
    engine = create_engine("hf", tiny_model, device="cpu")
    assert isinstance(engine, HFEngine) and not engine.continuous and engine.dtype == torch.float32


@pytest.mark.e2e
def test_vllm_load_weights_takes_effect_and_restores(vllm_engine, tiny_model, prompts):
    """Weights pushed in memory change the output (the prefix cache, on by default, must not
    serve keys/values of the old weights), and pushing the originals back restores it."""
    import torch
    from safetensors.torch import load_file
    from pathlib import Path
    original = load_file(str(Path(tiny_model) / "model.safetensors"))
    before = [g.token_ids for g in vllm_engine.generate(prompts, GREEDY, stop=[])]
    g = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.5 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in original.items()}
    vllm_engine.load_weights(noisy.items())
    changed = [g.token_ids for g in vllm_engine.generate(prompts, GREEDY, stop=[])]
    vllm_engine.load_weights(original.items())
    after = [g.token_ids for g in vllm_engine.generate(prompts, GREEDY, stop=[])]
    assert changed != before and after == before


def test_logit_bias_makes_a_token_appear(engine, prompts):
    token = engine.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    assert all(token not in g.token_ids for g in engine.generate(prompts, GREEDY, stop=[]))
    for sampling in (replace(GREEDY, logit_bias={token: 100.0}),
                     SamplingConfig(temperature=1.0, max_tokens=8, logit_bias={token: 100.0})):
        generations = engine.generate(prompts, sampling, stop=[])
        assert [g.token_ids for g in generations] == [[token] * sampling.max_tokens] * len(prompts)


def test_generate_one_keeps_biased_and_unbiased_calls_apart(engine, prompts):
    # Concurrent calls share a batch only with equal settings; a dict-valued bias must not break that.
    token = engine.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    plain = SamplingConfig(temperature=0, max_tokens=4)

    async def run():
        return await asyncio.gather(engine.generate_one(prompts[0], replace(plain, logit_bias={token: 100.0}), []),
                                    engine.generate_one(prompts[0], plain, []))

    biased, unbiased = asyncio.run(run())
    assert biased.token_ids == [token] * 4
    assert unbiased == engine.generate(prompts[:1], plain, stop=[])[0]


@pytest.mark.e2e
def test_vllm_load_weights_streams_the_tensors(vllm_engine, tiny_model, prompts, monkeypatch):
    """In-process, each tensor is asked for while the engine is already loading the ones before it,
    not all up front: a sharded actor then gathers one full parameter at a time, never a whole model."""
    from pathlib import Path

    from safetensors.torch import load_file
    original = load_file(str(Path(tiny_model) / "model.safetensors"))
    loading, asked_while_loading = False, []
    real_rpc = vllm_engine.llm.collective_rpc

    def rpc(*args, **kwargs):  # the real call, marked as under way
        nonlocal loading
        loading = True
        try:
            return real_rpc(*args, **kwargs)
        finally:
            loading = False

    def tensors():
        for name, t in original.items():
            asked_while_loading.append(loading)
            yield name, t.clone()  # a fresh tensor, as a gather makes one

    monkeypatch.setattr(vllm_engine.llm, "collective_rpc", rpc)
    before = [g.token_ids for g in vllm_engine.generate(prompts, GREEDY, stop=[])]
    vllm_engine.load_weights(tensors())
    assert len(asked_while_loading) == len(original) and all(asked_while_loading)
    assert [g.token_ids for g in vllm_engine.generate(prompts, GREEDY, stop=[])] == before


def test_hf_engine_dtype_is_a_dtype_and_pushed_weights_take_effect(tiny_model, prompts):
    """The trainer pushes weights in the engine's dtype: `dtype` must be a torch.dtype, and the
    push (in-place copies into parameters that require grad) must work and change the output."""
    import torch
    engine = HFEngine(tiny_model, device="cpu", dtype="float32", seed=0)
    assert engine.dtype == torch.float32
    before = [g.token_ids for g in engine.generate(prompts, GREEDY, stop=[])]
    noisy = {k: v + 0.5 * torch.randn_like(v) for k, v in engine.model.state_dict().items() if v.dim() == 2}
    engine.load_weights((k, v.to(engine.dtype)) for k, v in noisy.items())
    assert [g.token_ids for g in engine.generate(prompts, GREEDY, stop=[])] != before


@pytest.mark.e2e
def test_a_pushed_embedding_reaches_the_tied_output_layer(vllm_engine, tiny_model, prompts):
    """The tiny model ties lm_head to the input embedding (as SmolLM2 and Qwen2.5 up to 3B do), so a
    push carries no lm_head weights. After it the engine must sample from the new embedding at the
    output too: the same greedy tokens as transformers with the pushed weights (vLLM on CPU once kept
    a kernel packed from the initial output layer)."""
    from pathlib import Path

    from safetensors.torch import load_file
    original = load_file(str(Path(tiny_model) / "model.safetensors"))
    assert "lm_head.weight" not in original  # tied
    g = torch.Generator().manual_seed(0)
    pushed = {k: v + 0.5 * torch.randn(v.shape, generator=g) if "embed_tokens" in k else v
              for k, v in original.items()}
    hf = HFEngine(tiny_model)
    hf.load_weights(pushed.items())
    try:
        vllm_engine.load_weights(pushed.items())
        assert [g.token_ids for g in vllm_engine.generate(prompts, GREEDY, stop=[])] == \
            [g.token_ids for g in hf.generate(prompts, GREEDY, stop=[])]
    finally:
        vllm_engine.load_weights(original.items())


def test_only_the_known_harmless_reload_warnings_are_dropped():
    import logging

    from verl.workers.rollout.vllm_engine import _KnownReloadWarnings

    def record(layer):
        return logging.LogRecord("vllm", logging.WARNING, "", 0, "%s: Failed to load weights", (layer,), None)
    keep = _KnownReloadWarnings().filter
    assert not keep(record("RotaryEmbedding")) and not keep(record("ParallelLMHead"))
    assert keep(record("QKVParallelLinear"))  # a layer that should have loaded: stays in the log


@pytest.mark.e2e
def test_vllm_without_sleep_mode_never_calls_vllms_sleep(vllm_engine, prompts, monkeypatch):
    """Without sleep mode vLLM's sleep frees nothing, yet on a GPU it fails when another process
    allocated meanwhile (runs sharing a GPU): the engine must not call it, nor wake_up."""
    def refuse(*args, **kwargs):
        raise AssertionError("vLLM's sleep/wake_up called without sleep mode")
    assert not vllm_engine.sleep_mode
    monkeypatch.setattr(vllm_engine.llm, "sleep", refuse)
    monkeypatch.setattr(vllm_engine.llm, "wake_up", refuse)
    before = [g.token_ids for g in vllm_engine.generate(prompts, GREEDY, stop=[])]
    vllm_engine.sleep()
    vllm_engine.wake()
    assert [g.token_ids for g in vllm_engine.generate(prompts, GREEDY, stop=[])] == before


def test_logprobs_are_those_of_the_distribution_sampled_from(engine, tiny_model, prompts):
    # The trainer's importance weights (rollout.calculate_log_probs) compare these with the actor's
    # log-softmax(logits / temperature) of the same tokens: a plain forward must give the same.
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    sampling = SamplingConfig(temperature=0.7, max_tokens=12, seed=3, logprobs=True)

    def check(prompt, gen):
        assert gen.logprobs is not None and len(gen.logprobs) == len(gen.token_ids) > 0
        with torch.no_grad():
            logits_TV = model(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1:-1]
        expected = (logits_TV / 0.7).log_softmax(-1).gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=2e-2), (gen.logprobs, expected.tolist())

    for prompt, gen in zip(prompts, engine.generate(prompts, sampling, stop=[])):
        check(prompt, gen)
    if engine.continuous:  # the continuous schedule's path: submit, step until finished
        for key, prompt in enumerate(prompts):
            engine.submit(key, prompt, sampling, stop=[])
        done = {}
        while engine.has_unfinished():
            done.update(engine.step())
        for key, prompt in enumerate(prompts):
            check(prompt, done[key])
    assert all(g.logprobs is None for g in engine.generate(prompts, replace(sampling, logprobs=False), stop=[]))


@pytest.mark.e2e
def test_vllm_profiler_writes_the_engines_trace_where_asked(tiny_model, vllm_engine, prompts, tmp_path):
    """profile_dir turns on vLLM's own profiler (the trainer's profile_steps with the engine core in a
    process of its own): each start/stop records the model steps and moves the trace out."""
    with pytest.raises(RuntimeError, match="without profile_dir"):
        vllm_engine.start_profile()
    engine = VLLMEngine(tiny_model, seed=0, profile_dir=str(tmp_path / "engine"), **VLLM_KW)
    try:
        for step in (1, 2):   # a run may profile several steps
            engine.start_profile()
            engine.generate(prompts, GREEDY, [])
            [trace] = engine.stop_profile(str(tmp_path / "profile" / f"step{step}_policy0_engine"))
            assert trace == str(tmp_path / "profile" / f"step{step}_policy0_engine.json.gz")
            events = json.loads(gzip.decompress(Path(trace).read_bytes()))["traceEvents"]
            assert any(e.get("name", "").startswith("execute_context_") for e in events)
            assert not (tmp_path / "engine").exists()   # nothing else left behind
    finally:
        engine.shutdown()


def test_qwen3_dense_and_moe_generate_and_take_a_push_of_every_weight(tiny_qwen3_dir):
    """The Qwen3 shapes (MoE: routed experts) in the HF engine: it generates, and after a push of
    changed weights, experts included, its logits are those of transformers' model with the pushed weights."""
    from transformers import AutoModelForCausalLM
    engine = HFEngine(tiny_qwen3_dir, device="cpu", dtype="float32", seed=0)
    ids = engine.tokenizer("Where is Tartu?").input_ids
    (before,) = engine.generate([ids], replace(GREEDY, max_tokens=4), stop=[])
    assert len(before.token_ids) == 4
    g = torch.Generator().manual_seed(1)
    pushed = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in engine.model.state_dict().items()
              if k != "lm_head.weight"}   # tied to the embedding, so not pushed (as the trainer's push)
    assert any("experts" in k for k in pushed) == tiny_qwen3_dir.endswith("moe")
    engine.load_weights(pushed.items())
    reference = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    reference.load_state_dict(pushed, strict=False)
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(engine.model(x).logits, reference(x).logits)
        assert not torch.allclose(engine.model(x).logits, AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)(x).logits)
