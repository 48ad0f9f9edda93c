"""The trainer tests' stand-in reward counts what its docstring says."""
from rewards_for_tests import early_letter_reward


def test_share_of_early_letters():
    assert early_letter_reward("s", "abc XYZ!", None) == 0.5        # a b c of a b c x y z
    assert early_letter_reward("s", "Mn", None) == 0.5              # m is early, n is late
    assert early_letter_reward("s", "àbz 42 ß", None) == 0.5        # only ASCII letters count
    assert early_letter_reward("s", "", None) == 0.0
    assert early_letter_reward("s", "...", None) == 0.0
    assert early_letter_reward("s", "LLM", None) == 1.0
