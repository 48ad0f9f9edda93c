"""A reward for the end-to-end trainer test. The tiny random policy never answers, so the real
EM reward would be 0 for every sample and every advantage and gradient would be 0. This one
varies between samples of the same prompt, so the updates the test checks are non-zero. (The
real rewards are tested in tests/search_r1/test_rewards.py.)"""


def early_letter_reward(data_source, response, ground_truth):
    """The share of letters from the first half of the alphabet."""
    letters = [c for c in response.lower() if c.isascii() and c.isalpha()]
    return sum(c <= "m" for c in letters) / max(1, len(letters))
