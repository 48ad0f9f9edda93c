"""python -m verl.checkpoint export …: a checkpoint's model as a Hugging Face model directory."""
from verl.checkpoint.export import main

main()
