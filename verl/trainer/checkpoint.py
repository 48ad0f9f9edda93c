# `python -m verl.trainer.checkpoint export …` in existing scripts keeps working: the command is `python -m verl.checkpoint`.
from verl.checkpoint.export import main
if __name__ == "__main__": main()
