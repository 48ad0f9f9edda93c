"""The tool-calling protocol end to end, as verl's search recipe is run: `bash train_grpo.sh` with
verl's multi_turn keys, verl's own tool YAML (its class name and schema as that project ships them,
pointed at a real BM25 server over the bundled corpus) and rows in the layout verl's preprocessing
writes. The policy is a tiny Llama first fitted to one conversation shape (call the search tool,
then answer), so the random-weight model really searches: calls parsed from sampled tokens, sent
to the server through the tool runner, tool messages masked out of the loss."""
import json
import os
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import vllm_skip_reason

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[3]
CALL = '<tool_call>\n{"name": "search", "arguments": {"query_list": ["capital"]}}\n</tool_call>'
ANSWER = "<answer> Paris </answer>"

# verl's example tool config, as its repository has it (class name, keys and schema layout,
# including its `item:` where JSON schema says `items:`); only the URL differs.
VERL_TOOL_YAML = """\
tools:
  - class_name: verl.tools.search_tool.SearchTool
    config:
      retrieval_service_url: {url}
      num_workers: 120
      rate_limit: 120
      timeout: 30
      type: native
    tool_schema:
      type: function
      function:
        name: search
        description: Searches for relevant information based on the given query.
        parameters:
          type: object
          properties:
            query_list:
              type: array
              item:
                type: string
              description: A list of fully-formed semantic queries.
          required:
            - query_list
"""


def verl_rows(questions: list[dict], split: str) -> list[dict]:
    """Rows in the layout of verl's search-R1 preprocessing: a system and a user message, the source
    prefixed with searchR1_, the tool's creation arguments in extra_info, a metadata column."""
    rows = []
    for i, q in enumerate(questions):
        gt = {"target": q["golden_answers"]}
        rows.append({
            "data_source": "searchR1_geo_qa",
            "prompt": [{"role": "system", "content": "You are a helpful assistant."},
                       {"role": "user", "content": "Use the search tool, then answer inside <answer> and </answer>. "
                                                   f"Question: {q['question']}"}],
            "ability": "fact-reasoning", "reward_model": {"style": "rule", "ground_truth": gt},
            "extra_info": {"index": i, "need_tools_kwargs": True, "question": q["question"], "split": split,
                           "tools_kwargs": {"search": {"create_kwargs": {
                               "ground_truth": gt, "question": q["question"], "data_source": "searchR1_geo_qa"}}}},
            "metadata": None})
    return rows


@pytest.fixture(scope="module")
def verl_data(tmp_path_factory):
    from search_r1.data.bundled import bundled_paths, read_jsonl
    out = tmp_path_factory.mktemp("verl_data")
    # Validation asks training questions: the fitted tiny model writes its call for prompts it has seen.
    questions = read_jsonl(bundled_paths()["train"])[:16]
    for split, n in (("train", 16), ("test", 4)):
        pq.write_table(pa.Table.from_pylist(verl_rows(questions[:n], split)), out / f"{split}.parquet")
    return out


@pytest.fixture(scope="module")
def tool_yaml(bundled_bm25_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "search_tool_config.yaml"
    path.write_text(VERL_TOOL_YAML.format(url=bundled_bm25_server.url + "/retrieve"))
    return path


@pytest.fixture(scope="module")
def tool_caller(tiny_model_dir, verl_data, tool_yaml, tmp_path_factory):
    """The tiny random Llama fitted (a few dozen Adam steps on the 16 training rows) to answer every
    prompt with one search call and, after the tool message, an answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.tools.base import read_tool_config, tool_schemas
    from verl.tools.chat import ChatFormat

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    chat = ChatFormat(tok, tool_schemas(read_tool_config(tool_yaml)))
    seqs = []
    for row in pq.read_table(verl_data / "train.parquet").to_pylist():
        prompt = chat.prompt_ids(row["prompt"])
        rest = chat.encode(CALL) + chat.tool_message_ids("Doc 1(Title: Paris) Paris is a capital.", 64) \
            + chat.encode(ANSWER) + [tok.eos_token_id]
        seqs.append((prompt, rest))
    width = max(len(p) + len(r) for p, r in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    fitted = torch.zeros_like(ids, dtype=torch.bool)   # positions whose next token is learned
    for i, (p, r) in enumerate(seqs):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        fitted[i, len(p) - 1:len(p) + len(r) - 1] = True
    targets = ids[:, 1:][fitted[:, :-1]]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1][fitted[:, :-1]]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), targets)  # the vocabulary only where learned
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, loss.item()
    out = tmp_path_factory.mktemp("models") / "tool_caller"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_train_grpo_sh_with_verls_multi_turn_keys_searches_and_trains(tool_caller, verl_data, tool_yaml, tmp_path):
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
    env = {**os.environ, "BASE_MODEL": str(tool_caller), "DATA_DIR": str(verl_data), "RAY_DEDUP_LOGS": "0",
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
    tok = AutoTokenizer.from_pretrained(tool_caller)
    for s in samples:
        assert s["tool_calls"] == 1 and "<tool_response>\nDoc 1(Title:" in s["response"]
        tool_text = tok.decode([i for i, m in zip(s["response_ids"], s["loss_mask"]) if not m])
        assert tool_text.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\nDoc 1(Title:")
        assert "Doc 1" not in tok.decode([i for i, m in zip(s["response_ids"], s["loss_mask"]) if m])
