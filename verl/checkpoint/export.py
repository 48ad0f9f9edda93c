"""A checkpoint's model as a Hugging Face model directory, streamed from its DCP shards a few
tensors at a time: about one safetensors shard of memory, no process group or GPU.

`python -m verl.checkpoint export --checkpoint DIR --model actor --config-source ORIGINAL_MODEL_DIR
--out OUT [--dtype bfloat16] [--allow-unverified-checkpoint]`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from verl.checkpoint.manifest import MANIFEST, CheckpointCorrupt, reading, verify_checkpoint, write_text
from verl.checkpoint.store import checkpoint_dir, complete_steps, latest_step, single_process_quiet

logger = logging.getLogger(__name__)

# Files of the original model directory that hold weights: everything else (config, tokenizer, chat
# template, generation config, custom code) is copied into the export.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")
# Wrapper segments that can appear in parameter names (torch.compile, FSDP1, activation
# checkpointing). get_state_dict already removes them; we strip them again in case a checkpoint was
# written from a state dict taken another way.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")

def export_hf(
    checkpoint_dir: str | os.PathLike,
    model_name: str,
    out_dir: str | os.PathLike,
    config_source: str | os.PathLike,
    max_shard_bytes: int = 2**31,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    allow_unverified: bool = False,
) -> str:
    """Write `model_name` of a checkpoint as a Hugging Face model directory, streaming from the DCP
    shards. `checkpoint_dir` is a `global_step_<N>` directory or a checkpoint root (newest step is
    used); `config_source` is the original model directory (config and tokenizer are copied from
    it); `dtype` casts floating-point weights (e.g. "bfloat16"), None keeps them as saved;
    `overwrite` replaces an existing `out_dir` (only once the new export is complete).
    The model's files are checked against the checkpoint's manifest first: a corrupted checkpoint,
    or one without a manifest unless `allow_unverified`, raises CheckpointCorrupt and nothing is
    written. Single process, no GPU; peak memory is about one shard of `max_shard_bytes`."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = _resolve_checkpoint(checkpoint_dir)
    model_dir = os.path.join(ckpt, model_name, "model")
    if not os.path.isdir(model_dir):
        names = sorted(p.parent.name for p in Path(ckpt).glob("*/model"))
        raise FileNotFoundError(f"{ckpt} has no model {model_name!r}; it has {names}")
    verified = _verify_for_export(ckpt, model_name, allow_unverified)
    if not os.path.isfile(os.path.join(config_source, "config.json")):
        raise FileNotFoundError(f"{config_source} has no config.json: --config-source must be the local directory "
                                f"of the model training started from")
    out = Path(out_dir)
    if out.resolve() == Path(config_source).resolve():
        raise ValueError(f"The export would overwrite the original model {config_source}: choose another output")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: choose a new output directory, delete it, "
                              f"or pass overwrite=True (--overwrite)")
    if isinstance(dtype, str):
        name, dtype = dtype, getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"Unknown dtype {name!r}: use float32, bfloat16 or float16")

    with reading(ckpt, os.path.join(model_dir, ".metadata"), verified):
        metadata = dcp.FileSystemReader(model_dir).read_metadata().state_dict_metadata
    saved = {_hf_name(key): (key, meta) for key, meta in metadata.items() if isinstance(meta, TensorStorageMetadata)}

    # The names HF writes: those of a model built from the config (on the meta device: no memory),
    # with tied weights once. get_state_dict saves a tied lm_head.weight separately; it is dropped.
    config = AutoConfig.from_pretrained(config_source)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    tied = ({name for name, _ in reference.named_parameters(remove_duplicate=False)}
            - {name for name, _ in reference.named_parameters()})
    expected = set(reference.state_dict()) - tied
    missing = sorted(expected - set(saved))
    if missing:
        raise ValueError(f"Checkpoint {model_dir} lacks weights that {config.architectures} needs, "
                         f"e.g. {missing[:5]}: is --model {model_name!r} the model that started from {config_source}?")
    extra = sorted(set(saved) - expected - tied)
    if extra:
        logger.warning("Exporting %d weights that %s does not know, e.g. %s",
                       len(extra), config.architectures, extra[:5])
    names = [name for name in saved if name not in tied]  # checkpoint order: layer by layer

    def out_dtype(name):
        saved_dtype = saved[name][1].properties.dtype
        return dtype if dtype is not None and saved_dtype.is_floating_point else saved_dtype

    def nbytes(name):
        return saved[name][1].size.numel() * out_dtype(name).itemsize

    # Plan the shards from the metadata first: file names carry the shard count.
    shards, size = [[]], 0
    for name in names:
        if shards[-1] and size + nbytes(name) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes(name)

    tmp = Path(f"{out}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map = {}
    for i, shard in enumerate(tqdm(shards, desc="Exporting", unit="shard", disable=len(shards) == 1)):
        file_name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # DCP copies each stored chunk into these tensors, casting to their dtype on the way.
        tensors = {name: torch.empty(saved[name][1].size, dtype=out_dtype(name)) for name in shard}
        with single_process_quiet(), reading(ckpt, model_dir, verified):
            dcp.load({saved[name][0]: tensors[name] for name in shard}, checkpoint_id=model_dir, no_dist=True)
        save_file(tensors, tmp / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
        logger.info("Wrote %s (%d tensors)", file_name, len(shard))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes(n) for n in names)}, "weight_map": weight_map}
        write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2))

    for source in Path(config_source).iterdir():
        if source.is_file() and not source.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(source, tmp / source.name)
    config_json = json.loads(Path(config_source, "config.json").read_text())
    float_dtypes = {out_dtype(n) for n in names if out_dtype(n).is_floating_point}
    if len(float_dtypes) == 1:  # from_pretrained(dtype="auto") reads it
        written = str(float_dtypes.pop()).removeprefix("torch.")
        config_json["dtype"] = written
        if "torch_dtype" in config_json:  # configs written by transformers < 4.56
            config_json["torch_dtype"] = written
    write_text(tmp / "config.json", json.dumps(config_json, indent=2) + "\n")

    replaced = Path(f"{out}.old")
    shutil.rmtree(replaced, ignore_errors=True)  # left by a crash between the two renames
    if out.exists():
        os.replace(out, replaced)
    os.replace(tmp, out)
    shutil.rmtree(replaced, ignore_errors=True)
    logger.info("Exported %s of %s to %s (%d shards)", model_name, ckpt, out, len(shards))
    return str(out)

def _verify_for_export(ckpt: str, model_name: str, allow_unverified: bool) -> bool:
    """verify_checkpoint for the files an export reads (the model's, not its optimizer's); a failure
    says that nothing was written and which other steps there are."""
    try:
        return verify_checkpoint(ckpt, allow_unverified, under=os.path.join(model_name, "model"))
    except CheckpointCorrupt as error:
        root = os.path.dirname(os.path.abspath(ckpt))
        others = [s for s in complete_steps(root) if checkpoint_dir(root, s) != os.path.abspath(ckpt)]
        raise CheckpointCorrupt(error.checkpoint, error.file, f"{error.reason}. Nothing was exported"
                                + (f"; other checkpoints under {root}: steps {others}" if others else "")) from None

def _resolve_checkpoint(path: str | os.PathLike) -> str:
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return str(path)
    step = latest_step(path)
    if step is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint (global_step_<N>/) nor a directory of checkpoints")
    return checkpoint_dir(path, step)

def _hf_name(key: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        key = key.replace(segment, "")
    return key

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl.checkpoint",
                                     description="Sharded, resumable training checkpoints, and a streaming export to "
                                                 "a Hugging Face model directory.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write one model of a checkpoint as a Hugging Face model directory")
    export.add_argument("--checkpoint", required=True,
                        help="a global_step_<N> directory, or the checkpoint root (its newest step)")
    export.add_argument("--model", default="actor", help="which model of the checkpoint (default: actor)")
    export.add_argument("--config-source", required=True, help="the original model directory (config, tokenizer)")
    export.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="cast floating-point weights (default: keep the saved dtype)")
    export.add_argument("--max-shard-bytes", type=int, default=2**31, help="size limit of one safetensors file")
    export.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    export.add_argument("--allow-unverified-checkpoint", action="store_true",
                        help=f"export a checkpoint that has no {MANIFEST} (written before checksums existed) "
                             f"without checking its files; by default such a checkpoint is refused as corrupt")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        export_hf(args.checkpoint, args.model, args.out, args.config_source, args.max_shard_bytes, args.dtype,
                  args.overwrite, args.allow_unverified_checkpoint)
    except (FileNotFoundError, FileExistsError, ValueError, CheckpointCorrupt) as error:  # says what to do
        parser.exit(1, f"error: {error}\n")
