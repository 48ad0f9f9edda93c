"""Training checkpoints: the sharded store (save, load, rotation), manifests and verification, and
the export to a Hugging Face model directory."""
