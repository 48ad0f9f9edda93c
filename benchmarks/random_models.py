"""Random-weight models of the benchmarks that run a policy (bench_grpo_step.py, bench_rollout.py).

Both build the same Qwen2.5 shapes (Llama layout, tied embeddings) with random weights, so that a
shape means the same cost in either. A random policy never writes a search tag on its own: both
make `<search>` and `</search>` single tokens of the tokenizer (`tagged_tokenizer`) and raise them
with a logit bias (`tag_bias`); bench_rollout.py's docstring explains the steering in full.
"""
from __future__ import annotations

import math
from pathlib import Path

# hidden, layers, heads, kv heads, intermediate (Qwen2.5 shapes; head size 64 or 128)
SHAPES = {"tiny": (64, 2, 2, 1, 128), "0.5b": (896, 24, 14, 2, 4864), "3b": (2048, 36, 16, 2, 11008)}

TAGS = ("<search>", "</search>")


def make_random_model(out: Path, shape: str, tokenizer_from) -> str:
    """A model of one of SHAPES with random weights, written to `out`; its vocabulary is that of
    the tokenizer in `tokenizer_from` (None: SmolLM2's). "tiny" (the --quick runs, on CPU) is
    float32, the Qwen2.5 shapes bfloat16."""
    from search_r1.local_models import make_tiny_model

    hidden, layers, heads, kv, inter = SHAPES[shape]
    tiny = shape == "tiny"
    return make_tiny_model(out, tokenizer_from=tokenizer_from, hidden=hidden, layers=layers, heads=heads,
                           kv_heads=kv, intermediate=inter, max_position_embeddings=8192,
                           init_std=0.3 if tiny else 0.02, dtype="float32" if tiny else "bfloat16")


def tagged_tokenizer(source: str | None, out: Path):
    """The tokenizer with `<search>` and `</search>` as single ordinary tokens, saved to `out`."""
    from transformers import AutoTokenizer
    from search_r1.local_models import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer() if source is None else AutoTokenizer.from_pretrained(source)
    tok.add_tokens(list(TAGS))  # not special: the loop decodes with skip_special_tokens=True
    for tag in TAGS:
        if len(tok.encode(tag, add_special_tokens=False)) != 1:
            raise SystemExit(f"{tag!r} is not one token in {source or 'SmolLM2'}'s tokenizer after adding it")
    tok.save_pretrained(out)
    return tok


def tag_bias(vocab: int, mean_turn: float) -> float:
    """Logit bias giving each tag probability 1/mean_turn per token if the logits were uniform."""
    p = 1 / mean_turn
    return math.log(p * vocab / (1 - 2 * p))
