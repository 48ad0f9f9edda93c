"""Sharded checkpoints: exact resume at world size 2 (gloo, FSDP2), resharded resume at world size 1,
keep_last, crash leftovers and the checksum manifest, and the streaming HF export. (Faults: corrupted
shards, non-finite state, a full disk: test_checkpoint_faults.py.)

One module-scoped fixture runs the first training run, since every test reads its checkpoints."""
from __future__ import annotations

import json
import multiprocessing
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from verl.checkpoint.export import export_hf, main
from verl.checkpoint.manifest import verify_checkpoint
from verl.checkpoint.store import latest_step, load_checkpoint, save_checkpoint


# ---------------------------------------------------------------- code run in the spawned ranks

def _build(model_dir: str, critic_seed: int):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 4)  # warm-up
    torch.manual_seed(critic_seed)
    critic = fully_shard(torch.nn.Linear(8, 4))  # a second model, saved without optimizer
    return {"actor": (model, optimizer, scheduler), "critic": (critic, None, None)}


def _train_step(model, optimizer, scheduler, ids_BT=None):
    if ids_BT is None:  # from the global RNG: a restored RNG gives the same batch
        ids_BT = torch.randint(0, 1000, (2, 16))
    model(input_ids=ids_BT, labels=ids_BT).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return ids_BT


def _full_params(model) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def _draws():
    return {"torch": torch.rand(3), "python": random.random(), "numpy": np.random.rand()}


def _first_run(rank, model_dir, root, results):
    torch.manual_seed(100 + rank)
    random.seed(rank)
    np.random.seed(rank)
    models = _build(model_dir, critic_seed=1)
    actor = models["actor"]
    _train_step(*actor)
    save_checkpoint(root, 1, models, {"epoch": 0, "index_in_epoch": 4}, keep_last=2)
    _train_step(*actor)
    save_checkpoint(root, 2, models, {"epoch": 0, "index_in_epoch": 8}, keep_last=2)
    record = {"params_2": _full_params(actor[0]), "critic_2": _full_params(models["critic"][0]), "draws": _draws()}
    record["batch_3"] = _train_step(*actor)
    record["params_3"] = _full_params(actor[0])
    save_checkpoint(root, 3, models, {"epoch": 1, "index_in_epoch": 0}, keep_last=2)  # deletes step 1
    torch.save(record, f"{results}/first_rank{rank}.pt")


def _resume_same_world_size(rank, model_dir, root, results):
    torch.manual_seed(7)  # different from the first run: only load_checkpoint can make the draws match
    models = _build(model_dir, critic_seed=2)
    record = torch.load(f"{results}/first_rank{rank}.pt")
    assert load_checkpoint(root, 2, models) == {"epoch": 0, "index_in_epoch": 8}
    draws = _draws()
    assert torch.equal(draws.pop("torch"), record["draws"]["torch"])
    assert draws == {"python": record["draws"]["python"], "numpy": record["draws"]["numpy"]}
    _assert_equal(_full_params(models["critic"][0]), record["critic_2"])
    assert models["actor"][2].last_epoch == 2
    ids_BT = _train_step(*models["actor"])
    assert torch.equal(ids_BT, record["batch_3"])
    _assert_equal(_full_params(models["actor"][0]), record["params_3"])


def _resume_world_size_1(rank, model_dir, root, results):
    models = _build(model_dir, critic_seed=2)
    records = [torch.load(f"{results}/first_rank{r}.pt") for r in (0, 1)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(root, 2, models)
    assert any("world size 2, resuming at 1" in str(w.message) for w in caught), [str(w.message) for w in caught]
    _assert_equal(_full_params(models["actor"][0]), records[0]["params_2"])
    # Both ranks' batches in one: the same mean loss, so the same step up to float rounding, which
    # needs the resharded Adam moments.
    _train_step(*models["actor"], ids_BT=torch.cat([r["batch_3"] for r in records]))
    for name, p in _full_params(models["actor"][0]).items():
        torch.testing.assert_close(p, records[0]["params_3"][name], atol=1e-6, rtol=0, msg=name)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _worker(rank, world_size, store, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def _spawn(tmp: Path, world_size: int, fn, *args):
    # Fresh interpreters as with "spawn", but forked from one server that has imported this module and
    # transformers' Llama once: each spawned process would spend ~10 s importing them.
    multiprocessing.set_forkserver_preload([__name__, "transformers.models.llama.modeling_llama"])
    store = tmp / f"store_{fn.__name__}"
    mp.start_processes(_worker, args=(world_size, str(store), fn, args), nprocs=world_size, start_method="forkserver")


# ---------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def first_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpoint")
    root, results = tmp / "ckpts", tmp / "results"
    results.mkdir()
    _spawn(tmp, 2, _first_run, tiny_model_dir, str(root), str(results))
    return tmp, root, results, torch.load(results / "first_rank0.pt")


@pytest.mark.e2e  # first_run: two training processes
def test_layout_keep_last_and_crash_leftovers(first_run, tmp_path):
    _, root, _, _ = first_run
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", "global_step_3", "latest"]
    assert (root / "latest").read_text().strip() == "3"
    step_3 = root / "global_step_3"
    assert json.loads((step_3 / "trainer_state.json").read_text()) == {
        "step": 3, "world_size": 2, "models": ["actor", "critic"], "trainer": {"epoch": 1, "index_in_epoch": 0}}
    assert {p.name for p in (step_3 / "actor").iterdir()} == {"model", "optimizer", "scheduler.pt"}
    assert {p.name for p in (step_3 / "critic").iterdir()} == {"model"}
    assert {p.name for p in (step_3 / "rng").iterdir()} == {"rank_0.pt", "rank_1.pt"}
    assert latest_step(root) == 3
    # Both ranks' files are checksummed, each rank hashing a share.
    listed = json.loads((step_3 / "manifest.json").read_text())["files"]
    assert set(listed) == {str(p.relative_to(step_3)) for p in step_3.rglob("*")
                           if p.is_file() and p.name != "manifest.json"}
    assert {"rng/rank_0.pt", "rng/rank_1.pt", "actor/model/__0_0.distcp", "actor/model/__1_0.distcp"} <= set(listed)
    assert verify_checkpoint(step_3)

    # A crash while writing step 4 leaves a .tmp directory; without `latest`, directories are scanned.
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ["global_step_2", "global_step_3"]:
        (copy / name).symlink_to(root / name)
    (copy / "global_step_4.tmp" / "actor").mkdir(parents=True)
    assert latest_step(copy) == 3
    assert latest_step(tmp_path / "nothing") is None
    with pytest.raises(FileNotFoundError, match=r"steps \[2, 3\]"):
        load_checkpoint(root, 1, {})


@pytest.mark.e2e  # first_run: two training processes
def test_exact_resume(first_run, tiny_model_dir):
    tmp, root, results, _ = first_run
    _spawn(tmp, 2, _resume_same_world_size, tiny_model_dir, str(root), str(results))


@pytest.mark.e2e  # first_run: two training processes
def test_resume_at_other_world_size(first_run, tiny_model_dir):
    tmp, root, results, _ = first_run
    _spawn(tmp, 1, _resume_world_size_1, tiny_model_dir, str(root), str(results))


@pytest.mark.e2e  # first_run: two training processes
def test_export_hf(first_run, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _, root, _, record = first_run

    out = export_hf(root / "global_step_2", "actor", tmp_path / "hf", tiny_model_dir)
    assert sorted(p.name for p in Path(out).glob("*.safetensors")) == ["model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(out)
    _assert_equal({n: p.detach() for n, p in model.named_parameters()}, record["params_2"])
    assert AutoTokenizer.from_pretrained(out).chat_template

    # Several shards, bf16, through the CLI; the checkpoint root means its newest step.
    out = tmp_path / "hf_bf16"
    main(["export", "--checkpoint", str(root), "--model", "actor", "--config-source", tiny_model_dir,
          "--out", str(out), "--dtype", "bfloat16", "--max-shard-bytes", "50000"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding, as HF writes it
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    _assert_equal({n: p.detach() for n, p in model.named_parameters()},
                  {n: p.to(torch.bfloat16) for n, p in record["params_3"].items()})

    with pytest.raises(FileExistsError):
        export_hf(root, "actor", out, tiny_model_dir)
    export_hf(root / "global_step_2", "actor", out, tiny_model_dir, overwrite=True)  # as a trainer does each save
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf_bf16"]
    with pytest.raises(ValueError, match="original model"):
        export_hf(root, "actor", tiny_model_dir, tiny_model_dir, overwrite=True)
    with pytest.raises(FileNotFoundError, match=r"\['actor', 'critic'\]"):
        export_hf(root, "reward", tmp_path / "x", tiny_model_dir)


def test_single_process_and_saving_a_step_again(tmp_path):
    """No process group (a one-device trainer); a step saved twice keeps the second save."""
    def build():
        model = torch.nn.Linear(4, 2)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, optimizer = build()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path, 1, {"actor": (model, optimizer, None)}, {"saved": "first"})
    with torch.no_grad():
        model.weight.add_(1.0)
    save_checkpoint(tmp_path, 1, {"actor": (model, optimizer, None)}, {"saved": "second"})
    draw = torch.rand(3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "latest"]

    fresh, fresh_optimizer = build()
    assert load_checkpoint(tmp_path, 1, {"actor": (fresh, fresh_optimizer, None)}) == {"saved": "second"}
    assert torch.equal(torch.rand(3), draw)
    _assert_equal(dict(fresh.named_parameters()), dict(model.named_parameters()))
    exp_avg = [opt.state_dict()["state"][0]["exp_avg"] for opt in (fresh_optimizer, optimizer)]
    assert torch.equal(*exp_avg)
