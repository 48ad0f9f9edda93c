"""A reward for the end-to-end trainer test. The tiny random policy never answers, so the real
EM reward would be 0 for every sample and every advantage and gradient would be 0. This one
varies between samples of the same prompt, so the updates the test checks are non-zero. (The
real rewards are tested in tests/search_r1/test_rewards.py.)

The GRPO step benchmark scores its whole batch with it on the driver, so it counts letters with
bytes.translate rather than a loop over characters: the bench's reward phase should cost about
what the real scorer does, not what this stand-in would cost in pure Python."""
import string

_NOT_LETTERS = bytes(c for c in range(256) if chr(c) not in string.ascii_lowercase)
_EARLY = string.ascii_lowercase[:13].encode()


def early_letter_reward(data_source, response, ground_truth):
    """The share of ASCII letters from the first half of the alphabet."""
    letters = response.lower().encode("ascii", "ignore").translate(None, _NOT_LETTERS)
    late = letters.translate(None, _EARLY)
    return (len(letters) - len(late)) / max(1, len(letters))
