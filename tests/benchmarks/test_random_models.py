"""The benchmarks' model shapes (benchmarks/random_models.py) are those of the published models:
with the published vocabularies their parameter counts are the model cards' (on the meta device:
no weights)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from random_models import SHAPES  # noqa: E402

from verl.trainer.metrics import active_param_count  # noqa: E402

# shape: (vocabulary, parameters, parameters without the embeddings, parameters a token runs through), billions
PUBLISHED = {"0.5b": (151936, 0.49, 0.36, 0.49), "3b": (151936, 3.09, 2.77, 3.09), "7b": (152064, 7.61, 6.53, 7.61),
             "qwen3-4b": (151936, 4.0, 3.6, 4.0), "qwen3-30b-a3b": (151936, 30.5, 29.9, 3.3)}


@pytest.mark.parametrize("shape", sorted(PUBLISHED))
def test_each_shape_has_the_parameter_counts_of_its_published_model(shape):
    from transformers import AutoModelForCausalLM
    vocab, total, body, active = PUBLISHED[shape]
    config = SHAPES[shape].config("bfloat16", max_position_embeddings=8192, init_std=0.02)
    config.vocab_size = vocab
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    embeddings = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" in name or "lm_head" in name)
    # the cards round to one or two decimals (and the 30B-A3B's "3.3B activated" is 3.35B)
    assert (n / 1e9, (n - embeddings) / 1e9, active_param_count(model) / 1e9) == pytest.approx(
        (total, body, active), abs=0.06)
    assert type(model).__name__ == {"qwen3-4b": "Qwen3ForCausalLM", "qwen3-30b-a3b": "Qwen3MoeForCausalLM"}.get(
        shape, "LlamaForCausalLM")
