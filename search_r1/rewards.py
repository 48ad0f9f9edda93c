"""Outcome rewards for search-augmented QA: answer extraction, normalisation, metrics, format check.

Everything here is a pure function of strings, so the trainer, `infer.py` and the evaluation
scripts score trajectories identically, and every rule can be tested on CPU.

Callers pass the model's *response* (generated tokens plus the `<information>` observations the
agent inserted), never the prompt: the Search-R1 prompt contains an example `<answer>` that would
otherwise be taken for the model's answer.

Rules chosen here, where the paper leaves room:
- `extract_answer` takes the last *innermost* `<answer>…</answer>` pair and ignores text inside
  `<information>` blocks, so a retrieved passage can never be scored as the model's answer.
  It reads the answer after the thinking: an answer inside `<think>…</think>` (written natively by a
  thinking model such as Qwen3, in either protocol) is a draft and does not count, nor one after a
  `<think>` never closed, nor one before a first `</think>` that closes thinking the prompt opened.
- `normalize_answer` is SQuAD's normalisation (casefold, drop punctuation and the articles a/an/the,
  collapse whitespace) extended to Unicode: Latin-script accents are dropped ("São Paulo" matches
  "Sao Paulo"), compatibility forms are folded (full-width letters, ligatures) and punctuation of
  every script is removed. Marks of other scripts (kana voicing, Indic vowel signs) are kept, as
  dropping them would change the word.
- `substring_match` and the retrieval hit match whole normalised tokens ("1" is not found in
  "1990"), a deliberate deviation from a raw character substring test.
- `compute_score` defaults to plain exact match, which is the paper's outcome-only reward; the
  optional format, structure and retrieval terms are described in its docstring.
"""
from __future__ import annotations

import logging
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Answer extraction

# A pair with no other answer tag inside it, so nested or unbalanced tags resolve to the innermost
# pair: "<answer>a <answer>b</answer>" -> "b", "<answer>a</answer> <answer>b" -> "a". (Linear: the
# tempered token stops at the next answer tag, so no start position scans past it.)
_ANSWER = re.compile(r"<answer>((?:(?!</?answer>).)*)</answer>", re.DOTALL)

# The other blocks are paired by hand, not by a lazy regex such as "<information>(.*?)</information>":
# the policy writes the response, and a regex scans to the end of the text from every opening tag that
# is never closed: quadratic in the length of the response.


def _blocks(text: str, open_: str, close: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each `open_ … close` pair, left to right, each opening tag paired with the
    first closing tag after it: the pairs a lazy regex finds, in one pass."""
    pos = 0
    while (start := text.find(open_, pos)) != -1:
        end = text.find(close, start + len(open_))
        if end == -1:
            return   # no later opening tag can be closed either
        pos = end + len(close)
        yield start, pos


def _block_texts(text: str, open_: str, close: str) -> list[str]:
    return [text[start + len(open_):end - len(close)] for start, end in _blocks(text, open_, close)]


def _without_information(text: str) -> str:
    """`text` with every <information> block replaced by a space."""
    parts, pos = [], 0
    for start, end in _blocks(text, "<information>", "</information>"):
        parts += [text[pos:start], " "]
        pos = end
    return "".join(parts) + text[pos:]


def _without_thinking(text: str) -> str:
    """`text` without its thinking (see the module docstring), each block replaced by a space."""
    first_open, first_close = text.find("<think>"), text.find("</think>")
    pos = 0
    if first_close != -1 and (first_open == -1 or first_close < first_open):
        pos = first_close + len("</think>")   # the prompt opened the thinking
    parts = []
    while (start := text.find("<think>", pos)) != -1:
        parts.append(text[pos:start])
        end = text.find("</think>", start + len("<think>"))
        if end == -1:
            return " ".join(parts)   # never closed: the rest is thinking
        pos = end + len("</think>")
    return " ".join(parts + [text[pos:]])


# The tool-calling protocol writes a search as a <tool_call> block and its passages as a tool
# message, framed by the chat template's role markers (decoded without special tokens, e.g.
# "</tool_call>\nuser\n<tool_response>…</tool_response>\nassistant\n"). as_tags reads such a
# response in the tags' terms, so extraction, the format check and the retrieval hit apply as they are.
# A call counts when its closing tag is followed by a tool message (so a call runs on to the first
# closing tag that is); each pattern is anchored at one closing tag, so it costs the whitespace after it.
_CALL_ANSWERED = re.compile(r"\s*(?:(?:user|tool|ipython)\s*)?(?=<tool_response>)")
_AFTER_TOOL_RESPONSE = re.compile(r"\s*(?:assistant\b)?")


def _calls_as_searches(response: str) -> str:
    parts, pos = [], 0
    while (start := response.find("<tool_call>", pos)) != -1:
        close = start + len("<tool_call>")
        while (close := response.find("</tool_call>", close)) != -1:
            answered = _CALL_ANSWERED.match(response, close + len("</tool_call>"))
            if answered:
                break
            close += len("</tool_call>")
        if close == -1:
            break   # no closing tag after this call is answered, nor after any later one
        parts += [response[pos:start], f"<search>{response[start + len('<tool_call>'):close]}</search>\n"]
        pos = answered.end()
    return "".join(parts) + response[pos:]


def _tool_messages_as_information(response: str) -> str:
    parts, pos = [], 0
    for start, end in _blocks(response, "<tool_response>", "</tool_response>"):
        body = response[start + len("<tool_response>"):end - len("</tool_response>")]
        parts += [response[pos:start], f"<information>{body}</information>\n"]
        pos = _AFTER_TOOL_RESPONSE.match(response, end).end()
    return "".join(parts) + response[pos:]


def as_tags(response: str) -> str:
    """A tool-protocol response with <tool_call> as <search> and tool messages as <information>;
    other responses unchanged."""
    if "<tool_call>" not in response and "<tool_response>" not in response:
        return response
    return _tool_messages_as_information(_calls_as_searches(response))


_INFORMATION_NEXT = re.compile(r"\s*<information>")


def _searched(response: str) -> bool:
    """Whether the (tag) response has a search with a non-blank query that the environment answered:
    a <search> whose text up to a </search> followed by <information> is not blank. Only the first
    <search> needs checking: a later one can only close at a later </search>, whose text from the
    first includes a closing tag, so is not blank."""
    start = response.find("<search>")
    if start == -1:
        return False
    pos = start + len("<search>")
    while (close := response.find("</search>", pos)) != -1:
        pos = close + len("</search>")
        if _INFORMATION_NEXT.match(response, pos) and response[start + len("<search>"):close].strip():
            return True
    return False


def extract_answer(response: str) -> str | None:
    """The stripped content of the last complete `<answer>…</answer>` in `response`, else None.

    Pass the response only (never prompt + response): the prompt's example answer must not count.
    An empty pair gives "" (an answer that is simply wrong), not None. Thinking is skipped.
    """
    matches = _ANSWER.findall(_without_thinking(_without_information(as_tags(response))))
    return matches[-1].strip() if matches else None


# ---------------------------------------------------------------------------------------------
# Normalisation and metrics

_LATIN_ACCENTS = re.compile("[\u0300-\u036f]")   # the combining diacritical marks block
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
# SQuAD strips ASCII symbols such as $ + < = > ^ ` | ~ too, which are not Unicode punctuation.
_ASCII_PUNCTUATION = frozenset(string.punctuation)


def _is_punctuation(ch: str) -> bool:
    return ch in _ASCII_PUNCTUATION or unicodedata.category(ch).startswith("P")


def normalize_answer(s: str) -> str:
    """SQuAD-style normalisation, Unicode-aware (see the module docstring)."""
    s = unicodedata.normalize("NFKD", s.casefold())
    # Recompose after dropping the accents so that marks we keep (e.g. kana voicing) rejoin.
    s = unicodedata.normalize("NFC", _LATIN_ACCENTS.sub("", s))
    s = "".join(ch for ch in s if not _is_punctuation(ch))
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


# Or a numpy array of str; see gold_answers.
GroundTruth = str | Sequence[str] | Mapping[str, Any]


def gold_answers(ground_truth: GroundTruth) -> list[str]:
    """The gold answers as a list of str.

    Accepts a str, a list or tuple of str, a dict with a "target" key (the parquet
    `reward_model.ground_truth` layout) and numpy arrays of str, which is what parquet readers
    return for list columns.
    """
    if isinstance(ground_truth, Mapping):
        if "target" not in ground_truth:
            raise KeyError(f"ground truth dict has no 'target' key (keys: {sorted(ground_truth)})")
        ground_truth = ground_truth["target"]
    if hasattr(ground_truth, "tolist") and not isinstance(ground_truth, str):
        ground_truth = ground_truth.tolist()   # numpy array (a 0-d array gives a scalar)
    if isinstance(ground_truth, str):
        golds = [ground_truth]
    elif isinstance(ground_truth, (list, tuple)):
        golds = list(ground_truth)
    else:
        raise TypeError(f"ground truth must be a str, a list of str, a dict with 'target' or a "
                        f"numpy array of str, got {type(ground_truth).__name__}")
    if not golds:
        raise ValueError("ground truth has no answers: fix the data row, every question needs one")
    bad = [g for g in golds if not isinstance(g, str)]
    if bad:
        raise TypeError(f"gold answers must be str, got {bad[:3]!r}")
    return golds


def _contains_tokens(text_norm: str, gold_norm: str) -> bool:
    """Whether `gold_norm` occurs in `text_norm` as a run of whole tokens (both normalised)."""
    return bool(gold_norm) and f" {gold_norm} " in f" {text_norm} "


def exact_match(pred: str | None, golds: GroundTruth) -> float:
    """1.0 when the normalised prediction equals some normalised gold answer."""
    if pred is None:
        return 0.0
    pred_norm = normalize_answer(pred)
    return float(any(pred_norm == normalize_answer(g) for g in gold_answers(golds)))


def substring_match(pred: str | None, golds: GroundTruth) -> float:
    """1.0 when some normalised gold answer occurs in the normalised prediction as whole tokens.

    A gold that normalises to nothing (e.g. "The") never matches, since it would match anything.
    """
    if pred is None:
        return 0.0
    pred_norm = normalize_answer(pred)
    return float(any(_contains_tokens(pred_norm, normalize_answer(g)) for g in gold_answers(golds)))


_YES_NO = frozenset({"yes", "no", "noanswer"})


def _f1(pred_norm: str, gold_norm: str) -> float:
    # A yes/no answer shares no meaning with any other answer, even if tokens overlap.
    if (pred_norm in _YES_NO or gold_norm in _YES_NO) and pred_norm != gold_norm:
        return 0.0
    pred_tokens, gold_tokens = pred_norm.split(), gold_norm.split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(pred: str | None, golds: GroundTruth) -> float:
    """SQuAD token F1, the best over the gold answers.

    Tokens are whitespace-separated words after normalisation, so an unsegmented CJK answer is a
    single token and its F1 equals its exact match.
    """
    if pred is None:
        return 0.0
    pred_norm = normalize_answer(pred)
    return max(_f1(pred_norm, normalize_answer(g)) for g in gold_answers(golds))


# ---------------------------------------------------------------------------------------------
# Format check

_TAG = re.compile(r"<(/?)(think|search|information|answer)>")
# Which block may open after each closed block, giving
# think -> (search -> information -> think)* -> answer.
_MAY_FOLLOW = {
    None: ("think",),
    "think": ("search", "answer"),
    "search": ("information",),
    "information": ("think",),
    "answer": (),
}


@dataclass(frozen=True)
class FormatResult:
    valid: bool
    n_search: int          # complete blocks seen, up to the first error when invalid
    n_information: int
    reason: str | None     # why the format is invalid; None when valid


def _text_outside_reason(last: str | None) -> str:
    if last is None:
        return "text before the first <think>"
    if last == "answer":
        return "text after </answer>"
    return f"text outside any block after </{last}>"


def _order_reason(last: str | None, name: str) -> str:
    if last is None:
        return f"response must start with <think>, not <{name}>"
    if last == "answer":
        return f"<{name}> after </answer>"
    if last == "search":
        return f"<search> not followed by <information> (got <{name}>)"
    expected = " or ".join(f"<{n}>" for n in _MAY_FOLLOW[last])
    return f"<{name}> cannot follow </{last}> (expected {expected})"


def check_format(response: str) -> FormatResult:
    """Check the block structure think -> (search -> information -> think)* -> answer.

    Only whitespace may sit between blocks. Text inside `<information>` is retrieved text written by
    the environment, so tags inside it are not parsed: a passage that happens to contain "<think>"
    cannot make a trajectory invalid. Decode the response without special tokens (a trailing
    end-of-turn marker counts as text after </answer>). Tool-protocol responses are read through
    `as_tags`: a <tool_call> counts as a search and a tool message as its information.
    """
    response = as_tags(response)
    counts = Counter()
    last = None        # the last closed block
    open_ = None       # the block currently open
    pos = 0            # end of the last tag handled

    def invalid(reason: str) -> FormatResult:
        return FormatResult(False, counts["search"], counts["information"], reason)

    for m in _TAG.finditer(response):
        closing, name = m.group(1) == "/", m.group(2)
        if open_ == "information" and not (closing and name == "information"):
            continue
        if open_ is None and response[pos:m.start()].strip():
            return invalid(_text_outside_reason(last))
        if closing:
            if open_ is None:
                return invalid(f"</{name}> without an opening <{name}>")
            if name != open_:
                return invalid(f"</{name}> while <{open_}> is open")
            counts[name] += 1
            last, open_ = name, None
        else:
            if open_ is not None:
                return invalid(f"<{name}> nested inside <{open_}>")
            if name not in _MAY_FOLLOW[last]:
                return invalid(_order_reason(last, name))
            open_ = name
        pos = m.end()

    if open_ is not None:
        return invalid(f"<{open_}> is never closed")
    if response[pos:].strip():
        return invalid(_text_outside_reason(last))
    if last == "search":
        return invalid("<search> not followed by <information>")
    if last != "answer":
        return invalid("no <answer> block")
    return FormatResult(True, counts["search"], counts["information"], None)


# ---------------------------------------------------------------------------------------------
# Reward


@dataclass(frozen=True)
class RewardResult:
    score: float               # the training reward
    em: float
    f1: float
    substring: float
    format_ok: bool
    answer: str | None         # the extracted answer, None when there is none
    retrieval_hit: bool        # some <information> block contains a gold answer
    # Logged by the trainer by name, as means over the trajectories that report them (score_for:
    # em_by_hops/<n> and searches_by_hops/<n> where the row's extra_info gives its hop count).
    metrics: dict[str, float] = field(default_factory=dict)


def retrieval_hit(response: str, golds: GroundTruth) -> bool:
    """Whether some `<information>` block of the response contains a gold answer (whole tokens)."""
    gold_norms = [normalize_answer(g) for g in gold_answers(golds)]
    for block in _block_texts(as_tags(response), "<information>", "</information>"):
        block_norm = normalize_answer(block)
        if any(_contains_tokens(block_norm, g) for g in gold_norms):
            return True
    return False


def _check_terms(format_score: float, final_format_score: float, retrieval_score: float,
                 search_cost: float) -> None:
    if not 0.0 <= format_score <= 1.0 or not 0.0 <= retrieval_score <= 1.0:
        raise ValueError(f"format_score = {format_score} and retrieval_score = {retrieval_score} "
                         f"must lie in [0, 1]")
    if not 0.0 <= final_format_score <= format_score:
        raise ValueError(f"final_format_score = {final_format_score} must lie in [0, format_score = "
                         f"{format_score}], so that a valid format never pays less than an "
                         f"invalid one")
    if format_score + retrieval_score >= 1.0:
        raise ValueError(f"format_score + retrieval_score = {format_score + retrieval_score} "
                         f"must be below 1, so that a wrong answer always scores below a "
                         f"correct one")
    if search_cost < 0.0:
        raise ValueError(f"search_cost = {search_cost} must be >= 0: it is what one search costs")


@dataclass
class RewardTerms:
    """The optional terms of `compute_score`, as `score_for` takes them: its options
    (`score_for.Options`), which the trainer's `reward.reward_kwargs` is checked against at start-up.
    The original Search-R1's `reward_model.structure_format_score`, `final_format_score`,
    `retrieval_score` and this trainer's earlier `reward.*` names of them are read into
    `reward.reward_kwargs` (search_r1.compat). The defaults give plain EM, the paper's reward."""
    format_score: float = 0.0        # a wrong answer in the valid format (a right one in an invalid format: 1 - it)
    final_format_score: float = 0.0  # a wrong answer in an invalid format with an answer block, <= format_score
    retrieval_score: float = 0.0     # added to a wrong answer in the valid format whose passages held a gold answer
    search_cost: float = 0.0         # taken from a right answer's reward once per search it made, >= 0
    # format_score and final_format_score paid only after a search (compute_score says why)
    format_needs_search: bool = False

    def __post_init__(self):
        _check_terms(self.format_score, self.final_format_score, self.retrieval_score, self.search_cost)
        if self.format_needs_search and not self.format_score:
            raise ValueError("format_needs_search=true pays the format's reward only after a search, and "
                             "format_score is 0: set format_score too")


def compute_score(response: str, ground_truth: GroundTruth, *, format_score: float = 0.0,
                  final_format_score: float = 0.0, retrieval_score: float = 0.0,
                  search_cost: float = 0.0, format_needs_search: bool = False) -> RewardResult:
    """Exact-match outcome reward with optional format, structure, retrieval and search-cost terms.

    With valid = check_format(response).valid and em in {0, 1}:

        score = (1 - format_score) * em + format_score * valid

    i.e. correct+valid -> 1, correct+invalid -> 1 - format_score, wrong+valid -> format_score,
    wrong+invalid -> 0. Two optional additions, only when the answer is wrong:
    - wrong+invalid but with a complete <answer> block -> `final_format_score` instead of 0;
    - wrong+valid and a gold answer appears in some <information> block (the search found it
      but the model did not use it) -> `retrieval_score` is added. Only a valid trajectory, one
      that ends in an answer, earns it, as in the original: paid on any trajectory, it also pays a
      policy that searches and never answers (benchmarks/RESULTS.md, "The second hop and the
      search cost").
    A correct answer then pays `search_cost` once per search the response made (per <information>
    block, i.e. per search the environment answered), so a policy can trade searches for accuracy.
    Wrong answers pay nothing for their searches: GRPO divides each group's advantages by its reward
    std, so a cost on every trajectory would turn the groups where all answers are wrong (most
    groups early in training) into a full-strength signal against searching (same section).
    With `format_needs_search`, a wrong answer earns `format_score` (or `final_format_score`) only if
    the response searched at least once (a non-empty query the environment answered; an empty
    <search></search> gets a correction, which does not count): the cheapest reward then needs a
    search, so a policy cannot settle on answering at once for the format alone
    (benchmarks/RESULTS.md, "Reinforcement learning alone: the rl-only preset").
    The defaults (all 0) give plain EM, the paper's reward.
    """
    _check_terms(format_score, final_format_score, retrieval_score, search_cost)

    golds = gold_answers(ground_truth)
    answer = extract_answer(response)
    valid = check_format(response).valid
    em = exact_match(answer, golds)
    hit = retrieval_hit(response, golds)

    score = (1.0 - format_score) * em + format_score * valid
    if not em:
        if not valid and answer is not None:
            score = final_format_score
        if format_needs_search and not _searched(as_tags(response)):
            score = 0.0
        if hit and valid:
            score += retrieval_score
    if search_cost and em:
        score -= search_cost * len(_block_texts(as_tags(response), "<information>", "</information>"))
    return RewardResult(score=score, em=em, f1=token_f1(answer, golds),
                        substring=substring_match(answer, golds), format_ok=valid,
                        answer=answer, retrieval_hit=hit)


# Scoring function per `data_source`. All use EM; to change one, map it to another function with
# the same signature, e.g. functools.partial(compute_score, format_score=0.2).
RewardFn = Callable[..., RewardResult]
REWARD_FNS: dict[str, RewardFn] = {
    source: compute_score
    for source in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique",
                   "bamboogle", "geo_qa")
}

_warned_sources: set[str] = set()


def searches_made(response: str) -> int:
    """The searches the environment answered: non-blank queries followed by their passages (each
    <search> paired with the first </search> after it, in one pass)."""
    text = as_tags(response)
    opened, closed = len("<search>"), len("</search>")
    return sum(1 for start, end in _blocks(text, "<search>", "</search>")
               if text[start + opened:end - closed].strip() and _INFORMATION_NEXT.match(text, end))


def score_for(data_source: str, response: str, ground_truth: GroundTruth, extra_info: Mapping | None = None,
              **kwargs) -> RewardResult:
    """Score with the function registered for `data_source`; unknown sources fall back to EM.

    The fallback warns once per source, so a new data set trains without code changes but a
    misspelt source name does not go unnoticed. Where the row's `extra_info` gives its hop count
    (`hops`, as the bundled task does), the result's metrics say by hop count whether the answer was
    right and how many searches it took: does a two-hop question get its second search?
    `kwargs`: the terms of `RewardTerms` (its `Options`), passed on to the source's function.
    """
    result = _score_by_source(data_source, response, ground_truth, **kwargs)
    hops = (extra_info or {}).get("hops")
    if hops is None:
        return result
    return replace(result, metrics={**result.metrics, f"em_by_hops/{int(hops)}": float(result.em),
                                    f"searches_by_hops/{int(hops)}": float(searches_made(response))})


score_for.Options = RewardTerms   # its keyword arguments, as the trainer checks reward.reward_kwargs


def _score_by_source(data_source: str, response: str, ground_truth: GroundTruth, **kwargs) -> RewardResult:
    # verl's search-tool preprocessing names the sources searchR1_nq, searchR1_hotpotqa, …
    fn = REWARD_FNS.get(data_source) or REWARD_FNS.get(data_source.removeprefix("searchR1_"))
    if fn is None:
        if data_source not in _warned_sources:
            _warned_sources.add(data_source)
            logger.warning("No reward function for data_source %r (known: %s); scoring with exact "
                           "match. Add it to search_r1.rewards.REWARD_FNS to choose another.",
                           data_source, ", ".join(sorted(REWARD_FNS)))
        fn = compute_score
    return fn(response, ground_truth, **kwargs)
