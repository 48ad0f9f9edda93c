"""The chat template's keyword arguments (data.apply_chat_template_kwargs, e.g. Qwen3's thinking
switch) reach every rendering, and `thinks_natively` reads the thinking off the rendered template.
The tokenizer is the tiny model's with THINKING_TEMPLATE, ours (tests/conftest.py)."""
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from verl.tools.chat import ChatFormat
from verl.utils.dataset import encode_prompt, load_examples, thinks_natively

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ppo_trainer.yaml"
OFF = {"enable_thinking": False}
EMPTY_THINK = "<think>\n\n</think>\n\n"
QUESTION = [{"role": "user", "content": "Where is Tartu?"}]
TOOL = {"type": "function", "function": {"name": "search", "description": "search the web",
                                         "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tok(thinking_tokenizer_dir):
    return AutoTokenizer.from_pretrained(thinking_tokenizer_dir)


def test_thinks_natively_reads_the_rendered_template(tok, tiny_model_dir):
    assert thinks_natively(tok)                  # the switch on: the model opens its own block
    assert not thinks_natively(tok, OFF)         # an empty, closed block: thinking is off
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)   # SmolLM2's ChatML knows no <think>
    assert not thinks_natively(plain)
    plain.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                           "{% if add_generation_prompt %}<think>\n{% endif %}")
    assert thinks_natively(plain)                # the template opens the block itself


def test_template_kwargs_reach_the_prompts(tok, tmp_path):
    on = tok.decode(encode_prompt(QUESTION, tok, True, "q"))
    off = tok.decode(encode_prompt(QUESTION, tok, True, "q", template_kwargs=OFF))
    assert not on.endswith(EMPTY_THINK) and off == on + EMPTY_THINK
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "nq", "prompt": QUESTION,
                                          "reward_model": {"ground_truth": {"target": ["Estonia"]}},
                                          "extra_info": {"index": 0}}]), path)
    (example,) = load_examples(str(path), tok, 512, template_kwargs=OFF)
    assert tok.decode(example.prompt_ids) == off


def test_template_kwargs_reach_the_tool_messages(tok):
    """The generation prompt after a tool message is the template's too, so the switch must reach it."""
    on, off = ChatFormat(tok, [TOOL]), ChatFormat(tok, [TOOL], OFF)
    assert tok.decode(off.prompt_ids(QUESTION)).endswith(EMPTY_THINK)
    assert not tok.decode(on.prompt_ids(QUESTION)).endswith(EMPTY_THINK)
    assert tok.decode(off.tool_message_ids("Tartu is in Estonia.", 100)).endswith("assistant\n" + EMPTY_THINK)
    assert tok.decode(on.tool_message_ids("Tartu is in Estonia.", 100)).endswith("assistant\n")


def test_the_config_key_reaches_the_agent_loop():
    from hydra import compose, initialize_config_dir

    from verl.workers.rollout.loop_from_config import agent_loop_settings
    from verl.config.load import load_config
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
    with initialize_config_dir(config_dir=str(CONFIG.parent), version_base=None):
        assert load_config(compose("ppo_trainer", overrides=base)).data.apply_chat_template_kwargs is None
        cfg = load_config(compose("ppo_trainer", overrides=base + ["data.apply_chat_template_kwargs={enable_thinking:false}"]))
    assert cfg.data.apply_chat_template_kwargs == OFF
    assert agent_loop_settings(cfg, "cpu").chat_template_kwargs == OFF
    assert OmegaConf.load(CONFIG).data.apply_chat_template_kwargs is None
