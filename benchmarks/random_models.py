"""Random-weight models of the benchmarks that run a policy (bench_grpo_step.py, bench_rollout.py).

Both build the same shapes with random weights, so that a shape means the same cost in either:
Qwen2.5's (in the Llama layout, which has no attention biases), Qwen3-4B and Qwen3-30B-A3B (a
mixture of experts: 128 experts of which 8 run per token). The vocabulary is the tokenizer's
(SmolLM2's by default), not the published models' 151k tokens. Weights are drawn and written shard
by shard (`search_r1.local_models.write_random_model`), so the 30B model never sits in memory.

A random policy never writes a search tag on its own: both make `<search>` and `</search>` single
tokens of the tokenizer (`tagged_tokenizer`) and raise them with a logit bias (`tag_bias`);
bench_rollout.py's docstring explains the steering in full.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


class Architecture(StrEnum):
    LLAMA = "llama"            # LlamaForCausalLM
    QWEN3 = "qwen3"            # Qwen3ForCausalLM: q/k norms, head size of its own
    QWEN3_MOE = "qwen3_moe"    # Qwen3MoeForCausalLM: every MLP a mixture of routed experts


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes, named as transformers' configs name them (LlamaConfig, Qwen3Config,
    Qwen3MoeConfig)."""
    architecture: Architecture
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int                    # the dense MLP's width (unused where every layer is MoE)
    head_dim: int | None = None               # None: hidden_size / num_attention_heads
    tie_word_embeddings: bool = True          # the output layer is the input embedding
    moe_intermediate_size: int | None = None  # MoE: each expert's MLP width
    num_experts: int | None = None            # MoE: routed experts per layer
    num_experts_per_tok: int | None = None    # MoE: experts each token runs through

    def config(self, dtype: str, max_position_embeddings: int, init_std: float):
        """The transformers config of this shape (its vocabulary is set by the writer)."""
        from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig
        common = dict(hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                      num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                      intermediate_size=self.intermediate_size, tie_word_embeddings=self.tie_word_embeddings,
                      max_position_embeddings=max_position_embeddings, initializer_range=init_std, dtype=dtype)
        if self.head_dim is not None:
            common["head_dim"] = self.head_dim
        if self.architecture == Architecture.LLAMA:
            return LlamaConfig(**common)
        if self.architecture == Architecture.QWEN3:
            return Qwen3Config(**common)
        return Qwen3MoeConfig(**common, moe_intermediate_size=self.moe_intermediate_size, num_experts=self.num_experts,
                              num_experts_per_tok=self.num_experts_per_tok, norm_topk_prob=True)


SHAPES = {
    "tiny": Shape(Architecture.LLAMA, 64, 2, 2, 1, 128),   # the --quick runs, on CPU
    "0.5b": Shape(Architecture.LLAMA, 896, 24, 14, 2, 4864),
    "3b": Shape(Architecture.LLAMA, 2048, 36, 16, 2, 11008),
    "7b": Shape(Architecture.LLAMA, 3584, 28, 28, 4, 18944, tie_word_embeddings=False),
    "qwen3-4b": Shape(Architecture.QWEN3, 2560, 36, 32, 8, 9728, head_dim=128),
    # the GPU smoke's Qwen3-MoE step: every piece of the 30B-A3B (q/k norms, routed experts) at a size that
    # starts in seconds
    "qwen3-moe-small": Shape(Architecture.QWEN3_MOE, 512, 4, 8, 4, 1024, head_dim=64, tie_word_embeddings=False,
                             moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2),
    "qwen3-30b-a3b": Shape(Architecture.QWEN3_MOE, 2048, 48, 32, 4, 6144, head_dim=128, tie_word_embeddings=False,
                           moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8),
}

TAGS = ("<search>", "</search>")


def make_random_model(out: Path, shape: str, tokenizer_from) -> str:
    """A model of one of SHAPES with random weights, written to `out`; its vocabulary is that of
    the tokenizer in `tokenizer_from` (None: SmolLM2's). The published shapes are bfloat16 with the
    usual 0.02, drawn shard by shard. "tiny" (the --quick runs, on CPU) is the tests' tiny Llama
    (`make_tiny_model`: float32, wide weights for varied text): the weights on which the quick runs'
    steering (a handful of 16-token turns) has been seen to write searches; another draw of the same
    statistics wrote none."""
    from search_r1.local_models import make_tiny_model, write_random_model

    s = SHAPES[shape]
    if shape == "tiny":
        return make_tiny_model(out, tokenizer_from=tokenizer_from, hidden=s.hidden_size, layers=s.num_hidden_layers,
                               heads=s.num_attention_heads, kv_heads=s.num_key_value_heads,
                               intermediate=s.intermediate_size, max_position_embeddings=8192, init_std=0.3,
                               dtype="float32")
    config = s.config("bfloat16", max_position_embeddings=8192, init_std=0.02)
    return write_random_model(out, config, tokenizer_from=tokenizer_from, init_std=0.02)


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
