"""Weight pushes from CUDA tensors into vLLM on a GPU: in-process, and into an engine core in a child
process (CUDA IPC handles, the trainer's rollout.engine_core=separate). Skipped without CUDA or vLLM.
The push times are printed (pytest -s) as a first reading; benchmarks/bench_grpo_step.py measures
the trainer's."""

import pytest
import torch

from conftest import vllm_skip_reason
from test_engines import QUESTIONS, run_child_core_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("separate", [False, True], ids=["in_process", "separate"])
def test_push_from_cuda_tensors_takes_effect_and_restores(tiny_model_dir, separate):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok(q).input_ids for q in QUESTIONS]
    got = run_child_core_script(tiny_model_dir, prompts, "cuda", separate=separate)
    print(f"push of the tiny model's weights ({'separate' if separate else 'in-process'}): {got['push_s']:.3f} s")
    assert got["in_process"] != separate
    assert got["changed"] != got["before"] and got["after"] == got["before"]
