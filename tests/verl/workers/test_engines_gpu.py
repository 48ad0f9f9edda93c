"""Weight pushes from CUDA tensors into vLLM on a GPU: in-process, and into an engine core in a child
process (CUDA IPC handles, the trainer's rollout.engine_core=separate), and `reseed` in both, whichever
of vLLM's model runners samples; sleep mode; and the profile of such
an engine core (the trainer's profile_steps) summed up per rollout call. Skipped without CUDA or vLLM.
The push times are printed (pytest -s) as a first reading; benchmarks/bench_grpo_step.py measures the
trainer's."""

import gzip
import json
from pathlib import Path

import pytest
import torch

from conftest import vllm_skip_reason
from test_engines import QUESTIONS, run_child_core_script, run_script

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
    assert got["sampled"][0] == got["sampled"][1] != got["sampled"][2]  # reseed reaches the engine's worker


SLEEP_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from verl.workers.rollout.engine import SamplingConfig
from verl.workers.rollout.vllm_engine import VLLMEngine
model, prompts = sys.argv[1], json.loads(sys.argv[2])
torch.cuda.is_available()
engine = VLLMEngine(model, seed=0, max_model_len=512, gpu_memory_utilization=0.2, enable_sleep_mode=True,
                    separate_core=True)
greedy = SamplingConfig(temperature=0, max_tokens=24)
sample = lambda: [g.token_ids for g in engine.generate(prompts, greedy, [])]
out = {"before": sample()}
original = {k: v.cuda() for k, v in load_file(str(Path(model) / "model.safetensors")).items()}
free = lambda: torch.cuda.mem_get_info()[0]
awake = free()
engine.sleep()                   # the weights wait in host memory
out["freed"] = free() - awake
engine.wake()
out["kept"] = sample()
engine.load_weights(original.items())
out["pushed"] = sample()
engine.shutdown()
print("RESULT", json.dumps(out), flush=True)
"""


def test_sleep_frees_the_gpu_and_brings_the_weights_back(tiny_model_dir):
    """Sleep frees the GPU's memory, waking brings the weights back, and a push afterwards samples as
    before. With the engine core in a process of its own, as the trainer runs it."""
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    got = run_script(SLEEP_SCRIPT, tiny_model_dir, json.dumps([tok(q).input_ids for q in QUESTIONS]),
                     env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert got["kept"] == got["before"] and got["pushed"] == got["before"]
    assert got["freed"] > 0


PROFILE_SCRIPT = """
import json, sys
import torch
from verl.utils.profiling import StepProfiler, phase
from verl.workers.rollout.engine import SamplingConfig
from verl.workers.rollout.vllm_engine import VLLMEngine
model, out = sys.argv[1], sys.argv[2]
torch.cuda.is_available()
engine = VLLMEngine(model, seed=0, max_model_len=512, kv_cache_memory_bytes=64 << 20, separate_core=True,
                    profile_dir=out + "/engine")

@phase
def generate():
    return engine.generate([[1, 2, 3, 4]] * 8, SamplingConfig(temperature=0, max_tokens=32), [])

profiler = StepProfiler()
profiler.start()
engine.start_profile()
generate()
[trace] = engine.stop_profile(out + "/step1_policy0_engine")
files = profiler.stop(out + "/step1_policy0", engine_trace=trace)
engine.shutdown()
v2 = engine.llm.llm_engine.vllm_config.use_v2_model_runner  # names no parts of its steps
print("RESULT", json.dumps(files + [trace, v2]), flush=True)
"""


def test_a_separate_engine_cores_profile_is_summed_up_per_rollout_call(tiny_model_dir, tmp_path):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    _, table, engine, v2_runner = run_script(PROFILE_SCRIPT, tiny_model_dir, str(tmp_path))
    events = json.loads(gzip.decompress(Path(engine).read_bytes()))["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)   # the engine's kernels, recorded in its own process
    text = Path(table).read_text()
    row = text.split("What the engine core did during each rollout call")[1].splitlines()[2].split()
    print(text.split("\n\n")[0] + "\n" + "\n".join(text.split("\n\n")[1].splitlines()[:3]))
    assert row[0] == "generate" and float(row[2]) > 0 and int(row[3]) > 0   # GPU busy, model steps
    assert ("gpu_model_runner: sample" in text) != v2_runner   # vLLM's named parts of the steps, where it names them
