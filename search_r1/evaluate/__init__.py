"""Evaluate a model on QA test sets, and a retriever on answer recall.

`search-r1 eval` runs a model over test parquet files (the training schema) in one of three modes:
- search: the multi-turn search agent against a retrieval server, on the parquet's own prompt;
- no-search: the model answers directly, from a short prompt of ours built from the question;
- rag: the question's top-k passages are retrieved once and put in the prompt; one answer turn.
It scores the extracted answers per data source (EM, cover EM = gold inside the answer as whole
words, token F1, answer rate, searches, turns, response tokens), macro-averages over sources, and
writes `eval_<mode>.json`, `predictions_<mode>.jsonl` and `eval_<mode>.md`, a table laid out as
the Search-R1 paper's main table.

`search-r1 eval-retrieval` asks the retriever for each question and reports answer recall@k: the
share of questions where one of the first k passages holds a gold answer (normalised, whole words).

The model may be a training run's checkpoint: it is exported to a Hugging Face directory first.
"Searches" counts the searches the model asked for, so it is 0 in rag mode (the retrieval there is
ours). Response tokens count the whole response, observations included.

One module per job:
- `config.py`: `EvalConfig` and the modes;
- `questions.py`: the questions of the test parquet files;
- `model.py`: the model to evaluate (a checkpoint exported first) and the engine that runs it;
- `run.py`: `run_eval`, the prompts of each mode, generation, and the result files;
- `scoring.py`: scores of the predictions and the tables in the paper's layout;
- `recall.py`: `run_retrieval_eval`, answer recall@k of a retrieval server;
- `cli.py`: the `search-r1 eval` and `eval-retrieval` commands (`__main__.py`: `python -m search_r1.evaluate`).
"""
from search_r1.evaluate.cli import add_parser, main, template_kwargs
from search_r1.evaluate.config import EvalConfig, Mode
from search_r1.evaluate.model import build_engine, find_checkpoint, resolve_model
from search_r1.evaluate.questions import Question, load_questions, question_text
from search_r1.evaluate.recall import retrieve, run_retrieval_eval
from search_r1.evaluate.run import DIRECT_PROMPT, RAG_PROMPT, build_prompts, generate, run_eval
from search_r1.evaluate.scoring import (METRICS, PAPER_COLUMNS, group_table, paper_table, score_predictions,
                                        score_record)

__all__ = ["DIRECT_PROMPT", "METRICS", "PAPER_COLUMNS", "RAG_PROMPT", "EvalConfig", "Mode", "Question", "add_parser",
           "build_engine", "build_prompts", "find_checkpoint", "generate", "group_table", "load_questions", "main",
           "paper_table", "question_text", "resolve_model", "retrieve", "run_eval", "run_retrieval_eval",
           "score_predictions", "score_record", "template_kwargs"]
