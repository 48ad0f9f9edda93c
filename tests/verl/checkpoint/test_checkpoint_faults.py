"""Checkpoint faults from an operator's probe: a bit-flipped shard, a non-finite step or state, a
full disk. Each must stop the run or fall back with a message that says what happened; none may
leave a broken checkpoint behind or delete the last good one.

Single process with a tiny linear model, except one 2-rank gloo test of the checks that every rank
must agree on (one rank raising alone would leave the others waiting in a collective)."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import struct
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ray.exceptions import RayTaskError
from torch.distributed.checkpoint.api import CheckpointException

from test_checkpoint import _worker  # one gloo process of a test group
from verl.checkpoint.export import main as export_main
from verl.checkpoint.manifest import CheckpointCorrupt, verify_checkpoint
from verl.checkpoint.store import complete_steps, latest_step, load_checkpoint, save_checkpoint
from verl.config.schema import TrainerConfig
from verl.trainer.ppo_trainer import PPOTrainer
from verl.utils.dataset import Example, PromptSampler
from verl.utils.tracking import Tracker

# A weight whose bytes the tests look for in the shard: flipping the top bit of its exponent turns
# 0.99 into 3.4e38, finite, so nothing downstream notices (the probe's bit flip).
MARK = 0.99


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def _trained(seed: int = 0):
    model, optimizer, scheduler = _build(seed)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    with torch.no_grad():
        model.weight[0, 0] = MARK
    return model, optimizer, scheduler


def _flip_exponent_bit(ckpt: Path, name: str = "actor") -> Path:
    shard = next((ckpt / name / "model").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    at = data.find(struct.pack("<f", MARK))
    assert at >= 0, f"{MARK} not found in {shard}"
    data[at + 3] ^= 0x40  # little-endian float32: byte 3 holds the sign and the top exponent bits
    shard.write_bytes(bytes(data))
    assert struct.unpack("<f", bytes(data[at:at + 4]))[0] > 3e38
    return shard


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _disk_with_free(free_bytes):
    """A stand-in for shutil.disk_usage; free_bytes is a number or a callable giving one."""
    def disk_usage(path):
        free = free_bytes() if callable(free_bytes) else free_bytes
        return SimpleNamespace(total=10 * free + 1, used=9 * free, free=free)
    return disk_usage


# ---------------------------------------------------------------- checksums (finding 6 and 7)

def test_manifest_lists_every_file_with_its_checksum(tmp_path):
    save_checkpoint(tmp_path, 1, {"actor": _trained()}, {"n": 1})
    ckpt = tmp_path / "global_step_1"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    files = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert set(manifest["files"]) == files
    assert {"actor/model/.metadata", "actor/optimizer/.metadata", "actor/scheduler.pt", "trainer_state.json",
            "rng/rank_0.pt"} <= files
    for rel, entry in manifest["files"].items():
        data = (ckpt / rel).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert verify_checkpoint(ckpt) is True


def test_a_flipped_bit_is_refused_on_load_naming_the_file(tmp_path):
    save_checkpoint(tmp_path, 1, {"actor": _trained()}, {})
    shard = _flip_exponent_bit(tmp_path / "global_step_1")
    fresh = _build(seed=1)
    before = fresh[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match="checksum") as caught:
        load_checkpoint(tmp_path, 1, {"actor": fresh})
    assert str(shard) in str(caught.value)
    assert torch.equal(fresh[0].weight, before)  # checked before anything is read into the model


def _truncate(shard: Path) -> Path:
    shard.write_bytes(shard.read_bytes()[:len(shard.read_bytes()) // 2])
    return shard


def test_dcp_errors_come_out_as_could_not_load(tmp_path):
    # Why `except Exception` never saw DCP's failures: its exception is a BaseException.
    assert not issubclass(CheckpointException, Exception)
    save_checkpoint(tmp_path, 1, {"actor": _trained()}, {})
    # A verified checkpoint that does not fit the model built now: a mismatch, not a damaged file.
    with pytest.raises(RuntimeError, match=r"(?s)Could not load 'actor'.*built exactly as when saving") as caught:
        load_checkpoint(tmp_path, 1, {"actor": (torch.nn.Linear(4, 3), None, None)})
    assert not isinstance(caught.value, CheckpointCorrupt)


def test_a_checkpoint_without_manifest_is_refused_unless_asked(tmp_path):
    # A partial copy has no manifest: 152 doubled weights trained on with a warning only.
    save_checkpoint(tmp_path, 1, {"actor": _trained()}, {"n": 1})
    ckpt = tmp_path / "global_step_1"
    (ckpt / "manifest.json").unlink()
    fresh = _build(seed=1)
    before = fresh[0].weight.detach().clone()
    with pytest.raises(CheckpointCorrupt, match=r"manifest.json is missing.*"
                                                           r"trainer.allow_unverified_checkpoint=true") as caught:
        load_checkpoint(tmp_path, 1, {"actor": fresh})
    assert caught.value.file == str(ckpt / "manifest.json")
    assert torch.equal(fresh[0].weight, before)
    # A checkpoint from before manifests, by explicit choice: loaded, with a warning.
    with pytest.warns(UserWarning, match="without verification"):
        assert load_checkpoint(tmp_path, 1, {"actor": fresh}, allow_unverified=True) == {"n": 1}
    assert float(fresh[0].weight[0, 0].detach()) == pytest.approx(MARK)


def test_a_truncated_shard_is_corrupt_whether_verification_or_loading_finds_it(tmp_path):
    save_checkpoint(tmp_path, 1, {"actor": _trained()}, {})
    ckpt = tmp_path / "global_step_1"
    shard = _truncate(next((ckpt / "actor" / "model").glob("*.distcp")))
    with pytest.raises(CheckpointCorrupt, match=r"bytes where manifest.json recorded .* partial") as caught:
        load_checkpoint(tmp_path, 1, {"actor": _build(seed=1)})
    assert caught.value.file == str(shard)
    # Without a manifest (allowed), DCP's read fails instead: a damaged file is as likely as a
    # mismatched model, so it is CheckpointCorrupt too, naming what was being read.
    (ckpt / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="without verification"), \
            pytest.raises(CheckpointCorrupt, match="could not be loaded.*damaged file") as caught:
        load_checkpoint(tmp_path, 1, {"actor": _build(seed=1)}, allow_unverified=True)
    assert caught.value.file == str(ckpt / "actor" / "model")


# ---------------------------------------------------------------- non-finite state (finding 6)

@pytest.mark.parametrize("where", ["weights", "optimizer state"])
def test_a_non_finite_state_is_never_saved_and_the_last_good_one_stays(tmp_path, where):
    model, optimizer, scheduler = parts = _trained()
    save_checkpoint(tmp_path, 1, {"actor": parts}, {}, keep_last=1)
    with torch.no_grad():
        if where == "weights":
            model.weight[1, 1] = float("nan")
        else:
            optimizer.state[model.bias]["exp_avg_sq"][0] = float("inf")
    with pytest.raises(RuntimeError, match=rf"step 2.* not finite.*actor {where}"):
        save_checkpoint(tmp_path, 2, {"actor": parts}, {}, keep_last=1)
    assert _listing(tmp_path) == ["global_step_1", "latest"]
    assert latest_step(tmp_path) == 1
    assert verify_checkpoint(tmp_path / "global_step_1")


# ---------------------------------------------------------------- full disk (finding 8)

def test_the_first_save_checks_free_space_against_the_state_size(tmp_path, monkeypatch):
    parts = _trained()
    monkeypatch.setattr(shutil, "disk_usage", _disk_with_free(10))
    with pytest.raises(OSError, match=r"no space left on \S+ \(needs ~[\d.]+ kB, 0\.0 kB free\)") as caught:
        save_checkpoint(tmp_path / "ckpts", 1, {"actor": parts}, {})
    assert caught.value.errno == errno.ENOSPC
    assert _listing(tmp_path / "ckpts") == []  # refused before writing anything


def test_later_saves_check_free_space_against_the_last_checkpoint(tmp_path, monkeypatch):
    parts = _trained()
    save_checkpoint(tmp_path, 1, {"actor": parts}, {})
    size = sum(p.stat().st_size for p in (tmp_path / "global_step_1").rglob("*")
               if p.is_file() and p.name != "manifest.json")
    monkeypatch.setattr(shutil, "disk_usage", _disk_with_free(size - 1))
    with pytest.raises(OSError, match=rf"no space left on \S+ \(needs ~{size / 1e3:.1f} kB, "
                                      rf"{(size - 1) / 1e3:.1f} kB free\)"):
        save_checkpoint(tmp_path, 2, {"actor": parts}, {})
    assert _listing(tmp_path) == ["global_step_1", "latest"]
    monkeypatch.setattr(shutil, "disk_usage", _disk_with_free(size))
    save_checkpoint(tmp_path, 2, {"actor": parts}, {})
    assert latest_step(tmp_path) == 2


def test_a_disk_that_fills_up_while_saving_leaves_no_partial_directory(tmp_path, monkeypatch):
    parts = _trained()
    save_checkpoint(tmp_path, 1, {"actor": parts}, {}, keep_last=1)
    full = {"now": False}
    real_save = torch.save

    def save_on_a_full_disk(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            return real_save(obj, f, *args, **kwargs)
        f.write(b"PK\x03\x04 partial")
        full["now"] = True
        # what torch's zip writer says when a write fails for lack of space
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", save_on_a_full_disk)
    monkeypatch.setattr(shutil, "disk_usage", _disk_with_free(lambda: 0 if full["now"] else 10**12))
    with pytest.raises(OSError, match=r"no space left on \S+ \(needs ~[\d.]+ kB, [\d.]+ GB free\)"):
        save_checkpoint(tmp_path, 2, {"actor": parts}, {}, keep_last=1)
    assert _listing(tmp_path) == ["global_step_1", "latest"]  # no global_step_2.tmp, step 1 kept
    assert latest_step(tmp_path) == 1
    assert verify_checkpoint(tmp_path / "global_step_1")


# ---------------------------------------------------------------- the trainer (findings 6 and 7)

class _Group:
    """One worker with WorkerGroup's calling convention (`group.get([w.save.remote(…)], …)`, as
    PolicyWorker/CriticWorker save and load); what it raises comes back wrapped the way Ray wraps a
    worker's exception."""

    def __init__(self, name: str, parts, subdir: str = "", allow_unverified: bool = False):
        self.name, self.parts, self.subdir, self.allow_unverified = name, parts, subdir, allow_unverified
        self.workers = [SimpleNamespace(save=SimpleNamespace(remote=self._save),
                                        load=SimpleNamespace(remote=self._load))]

    def get(self, results, what: str, step: int | None = None):
        return list(results)

    def _save(self, root, step, trainer_state, keep_last):
        return self._wrapped("save", save_checkpoint, os.path.join(root, self.subdir), step, {self.name: self.parts},
                             trainer_state, keep_last)

    def _load(self, root, step):
        return self._wrapped("load", load_checkpoint, os.path.join(root, self.subdir), step, {self.name: self.parts},
                             self.allow_unverified)  # as the workers pass trainer.allow_unverified_checkpoint

    def _wrapped(self, method, fn, *args):
        try:
            return fn(*args)
        except Exception as error:
            raise RayTaskError(f"{self.name}.{method}", traceback.format_exc(), error, proctitle="worker",
                               pid=1, ip="127.0.0.1").as_instanceof_cause() from None


def unused_reward(data_source, response, ground_truth):
    """The trainer loads a reward; these tests give each step's metrics (`_run`), so it is never called."""
    return 0.0


def _trainer(out_dir: Path, policy, critic=None, total_steps: int = 3) -> PPOTrainer:
    cfg = TrainerConfig()
    cfg.reward.function = "test_checkpoint_faults:unused_reward"
    run = cfg.trainer
    run.default_local_dir, run.save_freq, run.test_freq, run.val_before_train = str(out_dir), 1, -1, False
    run.export_hf_on_save, run.keep_last_checkpoints = False, 2
    sampler = PromptSampler([Example([1, 2], "demo", "a", i) for i in range(8)], batch_size=2, shuffle=False,
                            seed=0)
    tracker = Tracker(["jsonl"], str(out_dir), "test", "run", {})
    return PPOTrainer(cfg, None, policy, critic, sampler, None, tracker, total_steps, "cpu")


def _logged_steps(out_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


GOOD = {"reward/mean": 0.5, "pg_loss": 0.1, "grad_norm": 1.0}


def _run(trainer: PPOTrainer, monkeypatch, steps=None) -> PPOTrainer:
    """trainer.fit() with each step's metrics from `steps` (callables of the step number give them
    too, for something to happen between two steps); GOOD by default."""
    rows = iter(steps or [])
    monkeypatch.setattr(trainer, "train_step", lambda examples: dict(
        row(trainer.step + 1) if callable(row := next(rows, GOOD)) else row))
    trainer.fit()
    return trainer


def _two_saves(out_dir: Path, critic: bool = False):
    trainer = _trainer(out_dir, _Group("actor", _trained()),
                       _Group("critic", _trained(seed=2), subdir="critic") if critic else None)
    for _ in range(2):
        trainer.sampler.next_batch()
        trainer.step += 1
        trainer.save()
    return trainer


def test_resume_falls_back_from_a_corrupted_checkpoint(tmp_path, caplog):
    _two_saves(tmp_path)
    root = tmp_path / "checkpoints"
    shard = _flip_exponent_bit(root / "global_step_2")
    policy = _Group("actor", _build(seed=1))
    trainer = _trainer(tmp_path, policy)
    with caplog.at_level(logging.WARNING, logger="verl.trainer.resume"):
        trainer.resume()
    assert trainer.step == 1 and trainer.sampler.state() == {"epoch": 0, "position": 1}
    assert float(policy.parts[0].weight[0, 0].detach()) == pytest.approx(MARK)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(shard) in w and "checksum" in w for w in warnings), warnings


def test_resume_falls_back_when_only_the_critic_is_corrupted(tmp_path, caplog):
    _two_saves(tmp_path, critic=True)
    shard = _flip_exponent_bit(tmp_path / "checkpoints" / "critic" / "global_step_2", "critic")
    trainer = _trainer(tmp_path, _Group("actor", _build(seed=1)), _Group("critic", _build(seed=3), subdir="critic"))
    with caplog.at_level(logging.WARNING, logger="verl.trainer.resume"):
        trainer.resume()
    assert trainer.step == 1
    assert str(shard) in caplog.text


def test_resume_stops_when_no_checkpoint_verifies(tmp_path):
    _two_saves(tmp_path)
    for step in (1, 2):
        _flip_exponent_bit(tmp_path / "checkpoints" / f"global_step_{step}")
    trainer = _trainer(tmp_path, _Group("actor", _build(seed=1)))
    with pytest.raises(RuntimeError, match=r"(?s)No checkpoint .* verifies.*global_step_1.*"
                                           r"trainer.resume_mode=disable.*trainer.default_local_dir"):
        trainer.resume()


@pytest.mark.parametrize("bad", [{"pg_loss": float("nan")}, {"grad_norm": float("inf")},
                                 {"vf_loss": float("-inf")}])
def test_a_non_finite_step_stops_the_run_before_saving(tmp_path, monkeypatch, bad):
    trainer = _trainer(tmp_path, _Group("actor", _trained()), total_steps=4)
    good = {"reward/mean": 0.5, "pg_loss": 0.1, "grad_norm": 1.0, "vf_loss": 0.2}
    steps = iter([good, good | bad, good, good])
    monkeypatch.setattr(trainer, "train_step", lambda examples: dict(next(steps)))
    (name, value), = bad.items()
    with pytest.raises(RuntimeError, match=rf"step 2: {name}={value}.*newest checkpoint that verifies is step 1"):
        trainer.fit()
    assert complete_steps(tmp_path / "checkpoints") == [1]
    assert _logged_steps(tmp_path) == [1, 2]  # the bad step's metrics are in the logs


def test_a_non_finite_stop_points_at_the_newest_checkpoint_that_verifies(tmp_path, monkeypatch):
    def corrupted_then_nan(step):  # step 2's checkpoint changes on disk while step 3 runs
        _flip_exponent_bit(tmp_path / "checkpoints" / "global_step_2")
        return GOOD | {"pg_loss": float("nan")}

    trainer = _trainer(tmp_path, _Group("actor", _trained()), total_steps=4)
    with pytest.raises(RuntimeError, match=r"(?s)step 3: pg_loss=nan.*The newest checkpoint that verifies is step 1 "
                                           r".*newer ones fail verification: .*global_step_2.*checksum"):
        _run(trainer, monkeypatch, [GOOD, GOOD, corrupted_then_nan])

    def nothing_verifies(step):
        for ckpt in (tmp_path / "again" / "checkpoints").glob("global_step_*"):
            (ckpt / "manifest.json").unlink()
        return GOOD | {"grad_norm": float("inf")}

    trainer = _trainer(tmp_path / "again", _Group("actor", _trained()), total_steps=4)
    with pytest.raises(RuntimeError, match=r"(?s)step 3: grad_norm=inf.*No checkpoint under .* verifies "
                                           r".*manifest.json is missing"):
        _run(trainer, monkeypatch, [GOOD, GOOD, nothing_verifies])


# ---------------------------------------------------------------- missing manifests, truncated shards

@pytest.mark.parametrize("damage", ["manifest removed", "shard truncated", "shard truncated, unverified allowed"])
def test_resume_falls_back_from_a_partial_checkpoint(tmp_path, caplog, damage):
    _two_saves(tmp_path)
    ckpt = tmp_path / "checkpoints" / "global_step_2"
    shard = next((ckpt / "actor" / "model").glob("*.distcp"))
    if damage == "manifest removed":
        (ckpt / "manifest.json").unlink()
        named = ckpt / "manifest.json"
    else:
        _truncate(shard)
        named = shard
    allow = damage.endswith("allowed")
    if allow:  # a checkpoint from before manifests: the truncation shows only when DCP reads it
        for step in (1, 2):
            (tmp_path / "checkpoints" / f"global_step_{step}" / "manifest.json").unlink()
        named = ckpt / "actor" / "model"
    policy = _Group("actor", _build(seed=1), allow_unverified=allow)
    trainer = _trainer(tmp_path, policy)
    trainer.cfg.trainer.allow_unverified_checkpoint = allow
    with caplog.at_level(logging.WARNING, logger="verl.trainer.resume"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without verification")
        trainer.resume()
    assert trainer.step == 1 and trainer.sampler.state() == {"epoch": 0, "position": 1}
    assert float(policy.parts[0].weight[0, 0].detach()) == pytest.approx(MARK)
    assert f"{named} " in caplog.text and "trying the checkpoint before it" in caplog.text


# ---------------------------------------------------------------- every reader verifies: the export

@pytest.fixture
def saved_model(tiny_model_dir, tmp_path):
    """A checkpoint of the tiny Llama as the trainer saves its actor (weights only here)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_checkpoint(tmp_path / "ckpts", 3, {"actor": (model, None, None)}, {"step": 3})
    return tmp_path / "ckpts" / "global_step_3"


def _export(ckpt: Path, source: str, out: Path, *flags: str) -> None:
    export_main(["export", "--checkpoint", str(ckpt), "--config-source", source, "--out", str(out), *flags])


def test_the_export_refuses_a_corrupted_checkpoint_naming_the_file(saved_model, tiny_model_dir, tmp_path, capsys):
    shard = saved_model / "actor" / "model" / "__0_0.distcp"
    with open(shard, "r+b") as f:  # the probe: 4 KiB overwritten inside the shard, its size unchanged
        f.seek(len(shard.read_bytes()) // 2)
        f.write(b"\x7f" * 4096)
    with pytest.raises(SystemExit) as exited:
        _export(saved_model, tiny_model_dir, tmp_path / "hf")
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert str(shard) in err and "sha256 checksum" in err and "Nothing was exported" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def test_the_export_of_a_checkpoint_without_manifest_needs_the_flag(saved_model, tiny_model_dir, tmp_path, capsys):
    (saved_model / "manifest.json").unlink()
    with pytest.raises(SystemExit) as exited:
        _export(saved_model, tiny_model_dir, tmp_path / "hf")
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert f"{saved_model / 'manifest.json'} is missing" in err and "--allow-unverified-checkpoint" in err
    assert not (tmp_path / "hf").exists()
    with pytest.warns(UserWarning, match="without verification"):
        _export(saved_model, tiny_model_dir, tmp_path / "hf", "--allow-unverified-checkpoint")
    assert (tmp_path / "hf" / "model.safetensors").is_file()


# ---------------------------------------------------------------- the run's logs after a fallback, a failed save

def test_resume_drops_the_metrics_rows_of_the_steps_it_trains_again(tmp_path, monkeypatch, caplog):
    _run(_trainer(tmp_path, _Group("actor", _trained())), monkeypatch)
    assert _logged_steps(tmp_path) == [1, 2, 3]
    _flip_exponent_bit(tmp_path / "checkpoints" / "global_step_3")  # resume falls back to step 2
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # and a row cut off by the crash
    with caplog.at_level(logging.WARNING):
        trainer = _run(_trainer(tmp_path, _Group("actor", _build(seed=1)), total_steps=4), monkeypatch)
    assert trainer.step == 4
    assert _logged_steps(tmp_path) == [1, 2, 3, 4]  # not 1, 2, 3, 3, 4
    assert "dropped 1 row(s) of steps after step 2" in caplog.text and "1 unreadable row(s)" in caplog.text
    data_order = [json.loads(line)["step"] for line in (tmp_path / "data_order.jsonl").read_text().splitlines()]
    assert data_order == [1, 2, 3, 4]


def test_a_step_whose_save_fails_keeps_its_metrics_row(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, _Group("actor", _trained()))
    full = {"now": False}

    def disk_full_from_step_2(step):
        full["now"] = True
        return GOOD

    monkeypatch.setattr(shutil, "disk_usage", _disk_with_free(lambda: 0 if full["now"] else 10**12))
    with pytest.raises(RayTaskError, match="no space left on"):
        _run(trainer, monkeypatch, [GOOD, disk_full_from_step_2])
    assert complete_steps(tmp_path / "checkpoints") == [1]
    assert _logged_steps(tmp_path) == [1, 2]


# ---------------------------------------------------------------- every rank agrees (2 ranks, gloo)

def _ranks_agree(rank, root, results):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    models = {"actor": (model, optimizer, None)}
    save_checkpoint(root, 1, models, {}, keep_last=1)
    outcomes = {}

    with torch.no_grad():  # rank 1's shard only
        saved = model.weight.to_local().clone()
        if rank == 1:
            model.weight.to_local().fill_(float("nan"))
    try:
        save_checkpoint(root, 2, models, {}, keep_last=1)
    except RuntimeError as error:
        outcomes["non_finite"] = str(error)
    with torch.no_grad():
        model.weight.to_local().copy_(saved)

    real_disk_usage = shutil.disk_usage
    if rank == 1:  # this rank's view of the disk is full
        shutil.disk_usage = _disk_with_free(0)
    try:
        save_checkpoint(root, 2, models, {}, keep_last=1)
    except OSError as error:
        outcomes["disk"] = str(error)
    shutil.disk_usage = real_disk_usage

    if rank == 0:  # the other rank's shard: whichever rank checks it, both must raise
        shard = Path(root, "global_step_1", "actor", "model", "__1_0.distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    try:
        load_checkpoint(root, 1, models)
    except CheckpointCorrupt as error:
        outcomes["corrupt"] = str(error)
    outcomes["listing"] = sorted(os.listdir(root))
    Path(results, f"rank{rank}.json").write_text(json.dumps(outcomes))


@pytest.mark.e2e  # two processes
@pytest.mark.timeout(180)  # a rank that raised alone would leave the other waiting: a hang, not a pass
def test_every_rank_raises_when_one_rank_fails_a_check(tmp_path):
    multiprocessing.set_forkserver_preload([__name__])
    results = tmp_path / "results"
    results.mkdir()
    args = (2, str(tmp_path / "store"), _ranks_agree, (str(tmp_path / "ckpts"), str(results)))
    mp.start_processes(_worker, args=args, nprocs=2, start_method="forkserver")
    for rank in (0, 1):
        outcomes = json.loads((results / f"rank{rank}.json").read_text())
        assert "not finite" in outcomes.get("non_finite", ""), (rank, outcomes)
        assert "no space left on" in outcomes.get("disk", ""), (rank, outcomes)
        assert "__1_0.distcp" in outcomes.get("corrupt", ""), (rank, outcomes)
        assert outcomes["listing"] == ["global_step_1", "latest"]
