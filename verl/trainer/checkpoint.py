"""`python -m verl.trainer.checkpoint export …`, the command's earlier name, kept for users' scripts;
the command is now `python -m verl.checkpoint export …`."""
from verl.checkpoint.export import main

if __name__ == "__main__":
    main()
