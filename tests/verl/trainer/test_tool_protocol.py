"""The tool-calling protocol end to end, as verl's search recipe is run: `bash train_grpo.sh` with
verl's multi_turn keys, verl's own tool YAML (its class name and schema as that project ships them,
pointed at a real BM25 server over the bundled corpus) and rows in the layout verl's preprocessing
writes. The policy is conftest's tiny Llama fitted to call the search tool and then answer, so the
model really searches: calls parsed from sampled tokens, sent to the server through the tool
runner, tool messages masked out of the loss."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import vllm_skip_reason

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[3]
# verl's example tool config (its class name and keys); its tool_schema is left out, so the search
# tool's own is rendered, the one the tiny model was fitted with (the schema as verl writes it is
# read in tests/verl/workers/test_tool_loop.py).
VERL_TOOL_YAML = """\
tools:
  - class_name: verl.tools.search_tool.SearchTool
    config:
      retrieval_service_url: {url}
      num_workers: 120
      rate_limit: 120
      timeout: 30
      type: native
"""


@pytest.fixture(scope="module")
def tool_yaml(bundled_bm25_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "search_tool_config.yaml"
    path.write_text(VERL_TOOL_YAML.format(url=bundled_bm25_server.url + "/retrieve"))
    return path


def test_train_grpo_sh_with_verls_multi_turn_keys_searches_and_trains(tool_caller_model, verl_tool_data, tool_yaml,
                                                                          tmp_path):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    args = ["actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_yaml}",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
            "data.train_data_num=8", "data.val_data_num=2", "data.train_batch_size=2",
            "data.max_prompt_length=1024", "data.max_response_length=256", "data.max_obs_length=96",
            "actor_rollout_ref.rollout.n_agent=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size=2", "actor_rollout_ref.actor.optim.lr=1e-4",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "actor_rollout_ref.model.use_torch_compile=false",
            "trainer.n_gpus_per_node=2", "trainer.device=cpu", "trainer.logger=[console,jsonl]",
            "trainer.total_training_steps=1", "trainer.val_before_train=true", "trainer.save_freq=-1",
            f"trainer.default_local_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = {**os.environ, "BASE_MODEL": str(tool_caller_model), "DATA_DIR": str(verl_tool_data), "RAY_DEDUP_LOGS": "0",
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run(["bash", "train_grpo.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=env)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (step,) = [row for row in rows if row["step"] == 1]
    # Sampled at temperature 1, some calls come out malformed: counted, and answered with an error.
    assert step["agent/tool_calls"] + step["agent/malformed_calls"] == pytest.approx(1.0)
    assert step["agent/tool_calls"] > 0 and step["agent/tool_s"] > 0   # real searches, through the server
    assert step["grad_norm"] > 0
    assert rows[0]["val/agent/tool_calls"] == 1.0 and "val/reward/em" in rows[0]   # greedy: every prompt searches
    samples = [json.loads(line) for line in (tmp_path / "samples" / "val_step_0.jsonl").read_text().splitlines()]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tool_caller_model)
    for s in samples:
        assert s["tool_calls"] == 1 and "<tool_response>\nDoc 1(Title:" in s["response"]
        tool_text = tok.decode([i for i, m in zip(s["response_ids"], s["loss_mask"]) if not m])
        assert tool_text.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\nDoc 1(Title:")
        assert "Doc 1" not in tok.decode([i for i, m in zip(s["response_ids"], s["loss_mask"]) if m])
