"""python -m verl.config [--write PATH | --check PATH]: render configs/ppo_trainer.yaml."""
import sys

from verl.config.render import main

sys.exit(main())
