import dataclasses
import inspect
import logging
import random

import numpy as np
import pytest

from search_r1.rewards import (
    REWARD_FNS,
    RewardTerms,
    check_format,
    compute_score,
    exact_match,
    extract_answer,
    gold_answers,
    normalize_answer,
    retrieval_hit,
    score_for,
    substring_match,
    token_f1,
)

INFO_PARIS = "<information>Doc 1 (Title: France) Paris is the capital of France.</information>"
INFO_OTHER = "<information>Doc 1 (Title: Lyon) Lyon is a city in France.</information>"


def trajectory(answer="Paris", info=INFO_OTHER):
    """A well-formed response with one search round."""
    return (f"<think>I should look this up.</think>\n<search>capital of France</search>\n\n{info}\n\n"
            f"<think>Now I know.</think>\n<answer> {answer} </answer>")


# --- extract_answer ---------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("<think>x</think><answer>Paris</answer>", "Paris"),
    ("<answer>a</answer> then <answer>b</answer>", "b"),             # the last one wins
    ("<answer>\n  São Paulo \n</answer>\n", "São Paulo"),             # whitespace and newlines
    ("<answer></answer>", ""),                                        # empty, but present
    ("no answer here", None),
    ("<answer>unterminated", None),
    ("stray </answer>", None),
    ("<answer>a <answer>b</answer>", "b"),                            # nested: innermost pair
    ("<answer>a</answer> <answer>b", "a"),                            # trailing unclosed: last complete
    ("<answer>b</answer></answer>", "b"),                             # extra closing tag
    ("</answer><answer>c</answer>", "c"),
])
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_extract_answer_ignores_retrieved_text():
    response = ("<think>x</think><search>q</search>"
                "<information>a passage quoting <answer>Berlin</answer></information>")
    assert extract_answer(response) is None
    assert extract_answer(response + "<think>y</think><answer>Paris</answer>") == "Paris"


@pytest.mark.parametrize("response, expected", [
    ("<think>maybe <answer>Lyon</answer></think>\n\n<answer>Paris</answer>", "Paris"),
    ("<think>maybe <answer>Lyon</answer></think>\n\nI cannot tell.", None),   # a draft only
    ("<think>first <answer>Lyon</answer> and never closed", None),
    ("thinking the template opened <answer>Lyon</answer></think>\n\n<answer>Paris</answer>", "Paris"),
    ("thinking the template opened <answer>Lyon</answer></think> no answer", None),
    ("<think>\n\n</think>\n\n<answer>Paris</answer>", "Paris"),               # thinking switched off
])
def test_an_answer_inside_the_thinking_does_not_count(response, expected):
    assert extract_answer(response) == expected
    assert compute_score(response, ["Lyon"]).em == 0.0


def test_a_tool_protocol_final_message_inside_the_thinking_does_not_count():
    call = '<tool_call>\n{"name": "search", "arguments": {"query_list": ["capital"]}}\n</tool_call>'
    passages = "<tool_response>\nDoc 1(Title: France) Its capital is Paris.\n</tool_response>"
    start = f"<think> look </think>\n{call}\nuser\n{passages}\nassistant\n"
    assert extract_answer(start + "<think> so <answer> Paris </answer> </think>\n\nDone.") is None
    assert extract_answer(start + "<think> so <answer> Lyon </answer> </think>\n\n<answer> Paris </answer>") == "Paris"


def test_prompt_example_answer_is_not_counted():
    prompt = ("Answer the question. For example, <answer> Beijing </answer>. "
              "Question: what is the capital of France?")
    response = "<think>I am not sure.</think><search>capital of France</search>"
    # Callers pass the response only; the prompt's example would be found in the concatenation.
    assert extract_answer(prompt + response) == "Beijing"
    assert extract_answer(response) is None
    assert compute_score(response, "Beijing").score == 0.0


# --- normalisation and metrics ----------------------------------------------------------------

@pytest.mark.parametrize("raw, expected", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  a   man,  an apple; the end. ", "man apple end"),
    ("U.S.A.", "usa"),
    ("theatre", "theatre"),                                # articles only as whole words
    ("São Paulo", "sao paulo"),
    ("Ångström", "angstrom"),
    ("Việt Nam", "viet nam"),
    ("Straße", "strasse"),
    ("ＡＢＣ　１２３", "abc 123"),                           # full-width forms fold
    ("東京都。", "東京都"),                                   # CJK kept, CJK punctuation removed
    ("「がっこう」", "がっこう"),                             # kana voicing marks are kept
    ("$1,000", "1000"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_exact_match():
    assert exact_match("the  Sao Paulo.", "São Paulo") == 1.0
    assert exact_match("Paris", ["London", "paris"]) == 1.0
    assert exact_match("Paris, France", "Paris") == 0.0
    assert exact_match(None, "Paris") == 0.0
    assert exact_match("東京", ["東京"]) == 1.0
    assert exact_match("東京", ["京都"]) == 0.0


def test_substring_match_uses_whole_tokens():
    assert substring_match("It is Paris, France.", "paris") == 1.0
    assert substring_match("in the year 1990", "1990") == 1.0
    assert substring_match("in the year 1990", "1") == 0.0
    assert substring_match("anything", "The") == 0.0                 # gold normalises to ""
    assert substring_match(None, "Paris") == 0.0


def test_token_f1_yes_no():
    assert token_f1("yes", "yes") == 1.0
    assert token_f1("yes", "no") == 0.0
    assert token_f1("yes it is", "yes") == 0.0                       # gold yes, pred differs
    assert token_f1("no", "no answer at all") == 0.0
    assert token_f1("noanswer", "the noanswer") == 1.0


def naive_f1(pred, gold):
    """SQuAD F1 with explicit loops, as a reference for token_f1."""
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    remaining = list(g)
    common = 0
    for tok in p:
        if tok in remaining:
            remaining.remove(tok)
            common += 1
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def test_token_f1_matches_naive_reference():
    rng = random.Random(0)
    vocab = ["paris", "france", "capital", "city", "the", "a", "Lyon", "river,", "seine"]
    for _ in range(500):
        pred = " ".join(rng.choices(vocab, k=rng.randint(0, 6)))
        golds = [" ".join(rng.choices(vocab, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        assert token_f1(pred, golds) == pytest.approx(max(naive_f1(pred, g) for g in golds))


def test_token_f1_values():
    assert token_f1("Paris France", "Paris") == pytest.approx(2 / 3)
    assert token_f1("paris paris", "paris") == pytest.approx(2 / 3)   # repeated tokens count once
    assert token_f1(None, "Paris") == 0.0


# --- ground truth types -----------------------------------------------------------------------

@pytest.mark.parametrize("gt", [
    "Paris",
    ["Lyon", "Paris"],
    ("Paris",),
    {"target": ["Lyon", "Paris"]},
    {"target": "Paris"},
    np.array(["Lyon", "Paris"]),
    np.array(["Lyon", "Paris"], dtype=object),
    {"target": np.array(["Paris"], dtype=object)},
    np.array("Paris"),
])
def test_ground_truth_types(gt):
    assert "Paris" in gold_answers(gt)
    assert exact_match("paris", gt) == 1.0
    assert compute_score(trajectory("Paris"), gt).score == 1.0


@pytest.mark.parametrize("gt, error", [
    ([], ValueError),
    (np.array([], dtype=object), ValueError),
    ({"answers": ["Paris"]}, KeyError),
    (None, TypeError),
    ([1990], TypeError),
])
def test_bad_ground_truth(gt, error):
    with pytest.raises(error):
        gold_answers(gt)


# --- check_format -----------------------------------------------------------------------------

@pytest.mark.parametrize("response, n_search", [
    ("<think>easy</think><answer>Paris</answer>", 0),
    ("  <think>easy</think>\n\n<answer>Paris</answer>\n", 0),
    (trajectory(), 1),
    ("<think>a</think><search>q</search><information>d</information>"
     "<think>b</think><search>r</search><information>e</information>"
     "<think>c</think><answer>x</answer>", 2),
    # Retrieved text is opaque: tags inside <information> are not parsed.
    ("<think>a</think><search>q</search><information>see <think> and <answer>z</answer></information>"
     "<think>b</think><answer>x</answer>", 1),
])
def test_check_format_valid(response, n_search):
    result = check_format(response)
    assert result.valid, result.reason
    assert result.reason is None
    assert result.n_search == result.n_information == n_search


@pytest.mark.parametrize("response, reason", [
    ("<think>a</think>", "no <answer> block"),                                       # answer missing
    ("", "no <answer> block"),
    ("<think>a</think><answer>x</answer> trailing words", "text after </answer>"),
    ("<think>a</think><answer>x</answer><think>b</think>", "<think> after </answer>"),
    ("<think>a</think><search>q</search>", "<search> not followed by <information>"),
    ("<think>a</think><search>q</search><think>b</think><answer>x</answer>",
     "<search> not followed by <information> (got <think>)"),
    ("<think>a</think><search>q</search><answer>x</answer>",
     "<search> not followed by <information> (got <answer>)"),
    ("<answer>x</answer>", "response must start with <think>, not <answer>"),        # wrong order
    ("<think>a</think><information>d</information><think>b</think><answer>x</answer>",
     "<information> cannot follow </think> (expected <search> or <answer>)"),
    ("<think>a</think><search>q</search><information>d</information><answer>x</answer>",
     "<answer> cannot follow </information> (expected <think>)"),
    ("<think>a</think><search>q</search><information>d</information><search>r</search>",
     "<search> cannot follow </information> (expected <think>)"),
    ("<think>a</think><think>b</think><answer>x</answer>",
     "<think> cannot follow </think> (expected <search> or <answer>)"),
    ("<think>a <answer>x</answer></think>", "<answer> nested inside <think>"),       # nested
    ("<think>a</think><answer>a <answer>b</answer></answer>", "<answer> nested inside <answer>"),
    ("<think>a</search><answer>x</answer>", "</search> while <think> is open"),     # unbalanced
    ("<think>a</think></think><answer>x</answer>", "</think> without an opening <think>"),
    ("<think>a</think><answer>x", "<answer> is never closed"),
    ("<think>a", "<think> is never closed"),
    ("preamble <think>a</think><answer>x</answer>", "text before the first <think>"),
    ("<think>a</think> stray <answer>x</answer>", "text outside any block after </think>"),
    ("<think>a</think><answer>x</answer><|im_end|>", "text after </answer>"),
])
def test_check_format_invalid(response, reason):
    result = check_format(response)
    assert not result.valid
    assert result.reason == reason


def test_check_format_counts_up_to_error():
    result = check_format("<think>a</think><search>q</search><information>d</information>"
                          "<think>b</think><search>r</search>")
    assert not result.valid
    assert (result.n_search, result.n_information) == (2, 1)


# --- compute_score ----------------------------------------------------------------------------

VALID_CORRECT = trajectory("Paris")
VALID_WRONG = trajectory("Lyon")
VALID_WRONG_HIT = trajectory("Lyon", info=INFO_PARIS)
INVALID_CORRECT = trajectory("Paris") + " trailing"
INVALID_WRONG_WITH_ANSWER = trajectory("Lyon") + " trailing"
INVALID_NO_ANSWER = "<think>I should look this up.</think><search>capital</search>" + INFO_OTHER
INVALID_NO_ANSWER_HIT = "<think>I should look this up.</think><search>capital</search>" + INFO_PARIS

SCHEME = dict(format_score=0.2, final_format_score=0.1, retrieval_score=0.3)


@pytest.mark.parametrize("response, default, configured", [
    (VALID_CORRECT, 1.0, 1.0),
    (VALID_WRONG, 0.0, 0.2),
    (VALID_WRONG_HIT, 0.0, 0.5),
    (INVALID_CORRECT, 1.0, 0.8),
    (INVALID_WRONG_WITH_ANSWER, 0.0, 0.1),
    (INVALID_NO_ANSWER, 0.0, 0.0),
    (INVALID_NO_ANSWER_HIT, 0.0, 0.0),   # the retrieval term pays valid trajectories only
    (trajectory("Lyon", info=INFO_PARIS) + " trailing", 0.0, 0.1),
    (trajectory("Paris", info=INFO_PARIS), 1.0, 1.0),     # no retrieval bonus on a correct answer
])
def test_compute_score_matrix(response, default, configured):
    assert compute_score(response, ["Paris"]).score == pytest.approx(default)
    assert compute_score(response, ["Paris"], **SCHEME).score == pytest.approx(configured)


def test_search_cost_is_charged_per_search_of_a_correct_answer_only():
    two = ("<think>a</think><search>Lyon</search>" + INFO_OTHER + "<think>b</think><search>France capital</search>"
           + INFO_PARIS + "<think>c</think><answer>Paris</answer>")
    assert compute_score(two, ["Paris"], search_cost=0.1).score == pytest.approx(0.8)
    assert compute_score(VALID_CORRECT, ["Paris"], search_cost=0.1).score == pytest.approx(
        1.0 - 0.1 * VALID_CORRECT.count("<information>"))
    assert compute_score("<think>x</think><answer>Paris</answer>", ["Paris"], search_cost=0.1).score == 1.0
    # wrong answers pay nothing, so a group of wrong answers stays flat however much each searched
    wrong = [compute_score(r, ["Berlin"], search_cost=0.1, format_score=0.2).score for r in (two, VALID_CORRECT)]
    assert wrong == [pytest.approx(0.2)] * 2
    with pytest.raises(ValueError, match="search_cost"):
        compute_score(two, ["Paris"], search_cost=-0.1)


def test_format_needs_search_pays_the_format_after_a_search_only():
    at_once = "<think>x</think><answer>Lyon</answer>"
    needs = dict(format_score=0.2, final_format_score=0.1, retrieval_score=0.3, format_needs_search=True)
    assert compute_score(at_once, ["Paris"], format_score=0.2).score == pytest.approx(0.2)
    assert compute_score(at_once, ["Paris"], **needs).score == 0.0
    assert compute_score(at_once + " trailing", ["Paris"], **needs).score == 0.0
    assert compute_score(VALID_WRONG, ["Paris"], **needs).score == pytest.approx(0.2)
    assert compute_score(VALID_WRONG_HIT, ["Paris"], **needs).score == pytest.approx(0.5)
    assert compute_score(INVALID_WRONG_WITH_ANSWER, ["Paris"], **needs).score == pytest.approx(0.1)
    # an empty search is answered by a correction, not passages: it does not unlock the format's reward
    from search_r1.agent.loop import INVALID_ACTION
    empty = "<think>x</think><search> </search>" + INVALID_ACTION + "<think>y</think><answer>Lyon</answer>"
    assert check_format(empty).valid and compute_score(empty, ["Paris"], **needs).score == 0.0
    # a right answer is paid whether it searched or not
    assert compute_score("<think>x</think><answer>Paris</answer>", ["Paris"], **needs).score == 1.0


def test_compute_score_default_is_plain_em():
    for response in (VALID_CORRECT, VALID_WRONG, INVALID_CORRECT, INVALID_NO_ANSWER_HIT):
        result = compute_score(response, "Paris")
        assert result.score == result.em


def test_compute_score_fields():
    result = compute_score(trajectory("Paris, France", info=INFO_PARIS), {"target": ["Paris"]})
    assert result.answer == "Paris, France"
    assert result.em == 0.0
    assert result.substring == 1.0
    assert result.f1 == pytest.approx(2 / 3)
    assert result.format_ok
    assert result.retrieval_hit
    assert not retrieval_hit(VALID_CORRECT, "Paris")


@pytest.mark.parametrize("kwargs", [
    dict(format_score=-0.1),
    dict(format_score=1.5),
    dict(format_score=0.1, final_format_score=0.2),
    dict(format_score=0.5, retrieval_score=0.5),
])
def test_compute_score_and_its_options_reject_bad_settings(kwargs):
    with pytest.raises(ValueError):
        compute_score(VALID_CORRECT, "Paris", **kwargs)
    with pytest.raises(ValueError):   # what the trainer checks reward.reward_kwargs with, at start-up
        RewardTerms(**kwargs)


def test_score_fors_options_are_the_terms_compute_score_takes_with_its_defaults():
    """score_for.Options is what the trainer checks reward.reward_kwargs against and passes on
    whole: each field must be a keyword of compute_score, with the same default (plain EM)."""
    assert score_for.Options is RewardTerms
    keywords = {name: p.default for name, p in inspect.signature(compute_score).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert dataclasses.asdict(RewardTerms()) == keywords
    assert score_for("nq", VALID_WRONG, "Paris", **dataclasses.asdict(RewardTerms())) == \
        score_for("nq", VALID_WRONG, "Paris")
    with pytest.raises(ValueError, match="set format_score too"):   # a switch that would do nothing
        RewardTerms(format_needs_search=True)


# --- per-source dispatch ----------------------------------------------------------------------

def test_reward_fns_cover_the_benchmarks():
    for source in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique",
                   "bamboogle", "geo_qa"):
        assert REWARD_FNS[source] is compute_score


def test_score_for_known_source_passes_kwargs():
    assert score_for("nq", VALID_WRONG, "Paris", format_score=0.2).score == pytest.approx(0.2)


def test_score_for_unknown_source_falls_back_to_em_and_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="search_r1.rewards"):
        first = score_for("my_new_dataset", VALID_CORRECT, np.array(["Paris"], dtype=object))
        second = score_for("my_new_dataset", VALID_WRONG, "Paris")
    assert (first.score, second.score) == (1.0, 0.0)
    warnings = [r for r in caplog.records if "my_new_dataset" in r.getMessage()]
    assert len(warnings) == 1
    assert "nq" in warnings[0].getMessage()


def test_tool_protocol_responses_score_like_tags():
    """A tool-protocol response, decoded without special tokens: the call counts as a search, the tool
    message as its information (never taken for the answer), and verl's searchR1_ source names map
    to ours."""
    from search_r1.rewards import as_tags, score_for
    call = '<tool_call>\n{"name": "search", "arguments": {"query_list": ["capital of France"]}}\n</tool_call>'
    passages = "<tool_response>\nDoc 1(Title: France) Its capital is <answer> Lyon </answer> Paris.\n</tool_response>"
    good = f"<think> look </think>\n{call}\nuser\n{passages}\nassistant\n<think> found </think>\n<answer> Paris </answer>"
    result = score_for("searchR1_nq", good, {"target": ["Paris"]}, format_score=0.2)
    assert result.em == 1.0 and result.format_ok and result.retrieval_hit and result.score == 1.0
    assert check_format(good).n_search == 1 and extract_answer(good) == "Paris"
    assert extract_answer(f"<think> x </think>\n{call}\nuser\n{passages}\nassistant\n") is None
    unanswered = f"<think> look </think>\n{call}"   # a call that got no tool message: not a valid format
    assert not check_format(unanswered).valid
    assert as_tags("<answer> a </answer>") == "<answer> a </answer>"


# -- responses the policy can write to stall the scorer ------------------------------------------

N_OPEN = 20_000   # a lazy regex scans to the end from each of these: quadratic, far past the bound below


@pytest.mark.parametrize("response", [
    "<information>x" * N_OPEN,                                  # passages never closed
    "<tool_call>x" * N_OPEN,                                    # calls never closed
    "<tool_response>x" * N_OPEN,                                # tool messages never closed
    "<tool_call>q</tool_call>" + " " * N_OPEN + "u",            # whitespace after a call, no tool message
    "<search> q </search>" * N_OPEN + "<answer> x </answer>",   # searches never answered
], ids=["information", "tool_call", "tool_response", "whitespace", "unanswered_searches"])
def test_unclosed_or_unanswered_tags_are_scored_in_linear_time(response):
    import time
    start = time.monotonic()
    result = compute_score(response, ["Paris"], format_score=0.1, format_needs_search=True, search_cost=0.1)
    assert result.score == 0.0 and time.monotonic() - start < 2


def test_tag_pairing_matches_the_lazy_regexes_it_replaces():
    """The hand-written pairing gives what the regexes gave (they are the specification here), on
    random sequences of every tag, role marker and whitespace."""
    import re
    from search_r1 import rewards
    information = re.compile(r"<information>(.*?)</information>", re.DOTALL)
    answered = re.compile(r"<search>\s*\S.*?</search>\s*<information>", re.DOTALL)
    tool_call = re.compile(r"<tool_call>(.*?)</tool_call>\s*(?:user|tool|ipython)?\s*(?=<tool_response>)", re.DOTALL)
    tool_response = re.compile(r"<tool_response>(.*?)</tool_response>\s*(?:assistant\b)?", re.DOTALL)

    def as_tags(r):
        if "<tool_call>" not in r and "<tool_response>" not in r:
            return r
        r = tool_call.sub(lambda m: f"<search>{m.group(1)}</search>\n", r)
        return tool_response.sub(lambda m: f"<information>{m.group(1)}</information>\n", r)

    pieces = ["<information>", "</information>", "<search>", "</search>", "<tool_call>", "</tool_call>",
              "<tool_response>", "</tool_response>", "user", "tool", "assistant", "assistantx", " ", "\n", "a"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        tags = rewards.as_tags(text)
        assert tags == as_tags(text), text
        assert rewards._without_information(tags) == information.sub(" ", tags), text
        assert rewards._block_texts(tags, "<information>", "</information>") == information.findall(tags), text
        assert rewards._searched(tags) == bool(answered.search(tags)), text


def test_a_huge_answer_is_normalised_and_scored_in_linear_time():
    import time
    start = time.monotonic()
    answer = "The Paris, a city; " * 20_000
    assert token_f1(answer, ["Paris"]) > 0 and exact_match(answer, ["Paris"]) == 0.0
    assert time.monotonic() - start < 5
