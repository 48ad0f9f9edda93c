"""verl: a small, generic RL trainer for language models (PPO, GRPO, RLOO, REINFORCE++).

It knows nothing about search: the agent loop that produces trajectories is named in the config.
"""
