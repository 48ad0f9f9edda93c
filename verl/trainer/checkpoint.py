# Kept so that scripts running `python -m verl.trainer.checkpoint export` still work.
from verl.checkpoint.export import main  # the command is now `python -m verl.checkpoint`
if __name__ == "__main__": main()
