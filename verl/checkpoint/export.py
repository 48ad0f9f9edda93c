"""A checkpoint's model as a Hugging Face model directory, streamed from its DCP shards a few
tensors at a time: about one safetensors shard of memory, no process group or GPU. A model trained
with LoRA adapters is written merged into its base weights, and its adapters alone beside it.

`python -m verl.checkpoint export --checkpoint DIR --model actor --config-source ORIGINAL_MODEL_DIR
--out OUT [--dtype bfloat16] [--allow-unverified-checkpoint]`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from verl.checkpoint.manifest import MANIFEST, CheckpointCorrupt, reading, verify_checkpoint, write_text
from verl.checkpoint.store import ADAPTER_CONFIG, checkpoint_dir, complete_steps, latest_step, single_process_quiet

logger = logging.getLogger(__name__)

# Files of the original model directory that hold weights: everything else (config, tokenizer, chat
# template, generation config, custom code) is copied into the export.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")
# Wrapper segments that can appear in parameter names (torch.compile, FSDP1, activation
# checkpointing). get_state_dict already removes them; we strip them again in case a checkpoint was
# written from a state dict taken another way.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")

@dataclass
class _Weights:
    """What an export writes: the names in file order, each one's element count and dtype as stored,
    and `load(names, dtypes)`, the tensors of one output shard in the dtypes asked for."""
    names: list[str]
    numel: dict[str, int]
    dtype: dict[str, torch.dtype]
    load: Callable[[list[str], dict[str, torch.dtype]], dict[str, torch.Tensor]]


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
    A model trained with LoRA adapters (its checkpoint holds them and their adapter_config.json) is
    written merged: each adapted weight of `config_source` plus B·A·alpha/r, in fp32 then cast; the
    adapters alone go to `<out_dir>/adapter` in PEFT's format (adapter_config.json,
    adapter_model.safetensors), for `peft.PeftModel.from_pretrained(base, <out_dir>/adapter)`.
    The model's files are checked against the checkpoint's manifest first: a corrupted checkpoint,
    or one without a manifest unless `allow_unverified`, raises CheckpointCorrupt and nothing is
    written. Single process, no GPU; peak memory is about one shard of `max_shard_bytes` (and the
    adapters)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    ckpt = _resolve_checkpoint(checkpoint_dir)
    model_dir = os.path.join(ckpt, model_name, "model")
    if not os.path.isdir(model_dir):
        names = sorted(p.parent.name for p in Path(ckpt).glob("*/model"))
        raise FileNotFoundError(f"{ckpt} has no model {model_name!r}; it has {names}")
    adapter_file = os.path.join(ckpt, model_name, ADAPTER_CONFIG)
    lora = os.path.isfile(adapter_file)
    verified = _verify_for_export(ckpt, model_name, allow_unverified, whole_model=lora)
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
    if lora:
        with reading(ckpt, adapter_file, verified):
            adapter = json.loads(Path(adapter_file).read_text())
        adapters = _load_saved(ckpt, model_dir, verified, saved, [n for n in saved if _adapter_part(n)], {})
        weights = _merged_weights(saved, adapters, adapter, config_source, model_dir, ckpt, verified)
    else:
        adapters, weights = {}, _saved_weights(saved, config_source, model_dir, ckpt, verified, model_name)

    def out_dtype(name):
        stored = weights.dtype[name]
        return dtype if dtype is not None and stored.is_floating_point else stored

    def nbytes(name):
        return weights.numel[name] * out_dtype(name).itemsize

    # Plan the shards from the metadata first: file names carry the shard count.
    shards, size = [[]], 0
    for name in weights.names:
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
        tensors = weights.load(shard, {name: out_dtype(name) for name in shard})
        save_file(tensors, tmp / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
        logger.info("Wrote %s (%d tensors)", file_name, len(shard))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes(n) for n in weights.names)}, "weight_map": weight_map}
        write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2))
    if lora:
        _write_adapter(tmp / "adapter", adapters, adapter, config_source, dtype)

    for source in Path(config_source).iterdir():
        if source.is_file() and not source.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(source, tmp / source.name)
    config_json = json.loads(Path(config_source, "config.json").read_text())
    float_dtypes = {out_dtype(n) for n in weights.names if out_dtype(n).is_floating_point}
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
    logger.info("Exported %s of %s to %s (%d shards%s)", model_name, ckpt, out, len(shards),
                ", merged with its LoRA adapters; the adapters alone in adapter/" if lora else "")
    return str(out)


def _load_saved(ckpt: str, model_dir: str, verified: bool, saved: dict, names: list[str],
                dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Tensors `names` of the checkpoint (HF names), in `dtypes` (default: as saved)."""
    # DCP copies each stored chunk into these tensors, casting to their dtype on the way.
    tensors = {name: torch.empty(saved[name][1].size, dtype=dtypes.get(name, saved[name][1].properties.dtype))
               for name in names}
    with single_process_quiet(), reading(ckpt, model_dir, verified):
        dcp.load({saved[name][0]: tensors[name] for name in names}, checkpoint_id=model_dir, no_dist=True)
    return tensors


def _saved_weights(saved: dict, config_source, model_dir: str, ckpt: str, verified: bool,
                   model_name: str) -> _Weights:
    """A model trained in full: every weight is in the checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

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
    return _Weights(names, {n: saved[n][1].size.numel() for n in names},
                    {n: saved[n][1].properties.dtype for n in names},
                    lambda shard, dtypes: _load_saved(ckpt, model_dir, verified, saved, shard, dtypes))


def _adapter_part(name: str) -> tuple[str, str] | None:
    """(layer, "A" | "B") of a saved adapter weight (`<layer>.lora_A.<adapter>.weight`), else None."""
    match = re.fullmatch(r"(.+)\.lora_([AB])\.[^.]+\.weight", name)
    return (match.group(1), match.group(2)) if match else None


def _merged_weights(saved: dict, adapters: dict[str, torch.Tensor], adapter: dict, config_source, model_dir: str,
                    ckpt: str, verified: bool) -> _Weights:
    """A model trained with LoRA adapters: the base weights of `config_source`'s safetensors, each
    adapted one plus B·A·scale (fp32, then cast); a weight the checkpoint holds in full replaces
    the base's."""
    from safetensors import safe_open

    files = _safetensors_files(config_source)
    shapes, dtypes = {}, {}
    for name, file in files.items():
        with safe_open(file, framework="pt") as f:
            part = f.get_slice(name)
            shapes[name] = math.prod(part.get_shape())
            dtypes[name] = _SAFETENSORS_DTYPES[part.get_dtype()]
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        layer, part = _adapter_part(name)
        layers.setdefault(layer, {})[part] = tensor
    missing = sorted(f"{layer}.weight" for layer in layers if f"{layer}.weight" not in files)
    if missing:
        raise ValueError(f"Checkpoint {model_dir} has adapters on weights that {config_source} lacks, e.g. "
                         f"{missing[:3]}: is --config-source the model training started from?")
    full = {name.replace(".base_layer.", "."): name for name in saved if not _adapter_part(name)}
    if unknown := sorted(set(full) - set(files)):
        raise ValueError(f"Checkpoint {model_dir} holds weights that {config_source} lacks, e.g. {unknown[:3]}: is "
                         "--config-source the model training started from?")
    rank = adapter["r"]
    scale = adapter["lora_alpha"] / (math.sqrt(rank) if adapter.get("use_rslora") else rank)

    def load(shard: list[str], out: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        tensors = {}
        in_full = [full[n] for n in shard if n in full]
        trained = _load_saved(ckpt, model_dir, verified, saved, in_full, {}) if in_full else {}
        for name in shard:
            if name in full:
                tensors[name] = trained[full[name]].to(out[name])
                continue
            with safe_open(files[name], framework="pt") as f:
                tensor = f.get_tensor(name)
            layer = name.removesuffix(".weight")
            if name.endswith(".weight") and layer in layers:
                pair = layers[layer]
                tensor = tensor.float() + scale * (pair["B"].float() @ pair["A"].float())
            tensors[name] = tensor.to(out[name])
        return tensors

    return _Weights(list(files), shapes, dtypes, load)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _safetensors_files(model_dir) -> dict[str, str]:
    """Weight name -> the safetensors file of `model_dir` that holds it, in file order."""
    from safetensors import safe_open

    index = Path(model_dir, "model.safetensors.index.json")
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: str(Path(model_dir, file)) for name, file in weight_map.items()}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no safetensors weights: exporting a LoRA checkpoint merges its "
                                "adapters into the base weights read from there (save the base model with "
                                "save_pretrained(safe_serialization=True) first)")
    names = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), str(file)))
    return names


def _write_adapter(out: Path, adapters: dict[str, torch.Tensor], adapter: dict, config_source,
                   dtype: torch.dtype | None) -> None:
    """The adapters in PEFT's format: tensors named as from a PeftModel, without the adapter's name."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    tensors = {}
    for name, tensor in adapters.items():
        layer, part = _adapter_part(name)
        tensors[f"base_model.model.{layer}.lora_{part}.weight"] = tensor if dtype is None else tensor.to(dtype)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    write_text(out / ADAPTER_CONFIG, json.dumps({**adapter, "base_model_name_or_path": str(config_source)},
                                                indent=2) + "\n")


def _verify_for_export(ckpt: str, model_name: str, allow_unverified: bool, whole_model: bool = False) -> bool:
    """verify_checkpoint for the files an export reads (the model's, not its optimizer's, unless
    `whole_model`: a LoRA model's adapter config sits beside its weights); a failure says that
    nothing was written and which other steps there are."""
    try:
        return verify_checkpoint(ckpt, allow_unverified,
                                 under=model_name if whole_model else os.path.join(model_name, "model"))
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
    export = commands.add_parser("export", help="write one model of a checkpoint as a Hugging Face model directory "
                                                "(a LoRA model: merged, and its adapters alone in <out>/adapter)")
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
