"""The ``OffloadingConnector``'s file tier (``kv_connector_extra_config`` ``"path"``),
against a hostile or small filesystem: a symlink at the path is refused, the file is
created 0600 (an existing one is set to 0600), a filesystem too small for the store fails
at start with what to change (never SIGBUS on a later save), and a save that fails turns
the tier off with one warning while generation goes on with the same greedy tokens."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import uuid

import pytest

from microvllm import LLM, SamplingParams
from microvllm.distributed.kv_transfer.kv_connector.file_store import open_store_file
from microvllm.distributed.kv_transfer.kv_connector.offloading_connector import OffloadingConnector
from microvllm.models.tiny import make_tiny_model
from tests.engine.test_kv_connector import shared_prefix_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BLOCK_BYTES = 2 * 8 * 2 * 16 * 4 * 2   # K and V, block_size 8, 2 KV heads x 16, float32, 2 layers: 4 KB


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kv_tier_file") / "llama", "llama", seed=3)


@pytest.fixture
def small_fs(tmp_path):
    """A 10 MB tmpfs (root only), unmounted afterwards."""
    folder = tmp_path / "small"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 10 MB tmpfs: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def tier(path, num_cpu_blocks: int = 40) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_cpu_blocks": num_cpu_blocks, "path": str(path)}}


def make_llm(model, transfer):
    return LLM(str(model), block_size=8, num_kv_blocks=20, max_num_seqs=2, kv_transfer_config=transfer,
               debug_invariants=True)


def test_a_symlink_at_the_path_is_refused(model, tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("not a KV store")
    link = tmp_path / "tier.bin"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="is a symbolic link: refused"):
        make_llm(model, tier(link))
    assert target.read_text() == "not a KV store"
    dangling = tmp_path / "dangling.bin"
    dangling.symlink_to(tmp_path / "would-be-created")
    with pytest.raises(ValueError, match="symbolic link"):
        open_store_file(str(dangling), 4096)
    assert not (tmp_path / "would-be-created").exists()


def test_the_file_is_created_0600_and_an_existing_one_set_to_0600(model, tmp_path):
    path = tmp_path / "tier.bin"
    old_umask = os.umask(0)   # the mode must not depend on the umask
    try:
        llm = make_llm(model, tier(path))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == 40 * BLOCK_BYTES
    assert path.stat().st_blocks * 512 >= 40 * BLOCK_BYTES, "the file's space is reserved, not sparse"
    llm.shutdown()
    del llm
    existing = tmp_path / "existing.bin"
    existing.write_bytes(b"x" * 100)
    existing.chmod(0o644)
    make_llm(model, tier(existing))
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600
    assert existing.stat().st_size == 40 * BLOCK_BYTES


def test_a_second_engine_on_the_same_path_is_refused_until_the_first_is_gone(model, tmp_path):
    import gc

    path = tmp_path / "tier.bin"
    first = open_store_file(str(path), 8192)
    with pytest.raises(ValueError, match="in use by another engine"):
        open_store_file(str(path), 8192)
    first.close()
    llm = make_llm(model, tier(path))
    with pytest.raises(ValueError, match="in use by another engine"):
        make_llm(model, tier(path))
    llm.shutdown()
    del llm
    gc.collect()
    assert make_llm(model, tier(path)).generate(shared_prefix_prompts(1), GREEDY, use_tqdm=False)


def test_a_filesystem_too_small_fails_at_start_and_says_what_to_change(model, small_fs):
    path = small_fs / "tier.bin"
    with pytest.raises(ValueError, match=r"needs 16\.4 MB.*num_cpu_blocks.*path on a filesystem with room"):
        make_llm(model, tier(path, num_cpu_blocks=4000))     # 4000 x 4 KB on a 10 MB tmpfs
    assert not path.exists(), "the file it created is removed"
    llm = make_llm(model, tier(path, num_cpu_blocks=2000))   # 8.2 MB: fits, and is reserved
    assert path.stat().st_blocks * 512 >= 2000 * BLOCK_BYTES
    assert llm.generate(shared_prefix_prompts(2), GREEDY, use_tqdm=False)


def test_serve_with_a_tier_larger_than_its_filesystem_refuses_to_start_with_the_message(model, small_fs, tmp_path):
    """A real ``microvllm serve``: it exits at start with the message (before the fix it
    started on a sparse file and died of SIGBUS on the first save past 10 MB)."""
    import json

    from tests.support import ROOT, free_port

    config = json.dumps(tier(small_fs / "tier.bin", num_cpu_blocks=20_000))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "microvllm", "serve", str(model), "--port", str(free_port()), "--block-size", "8",
         "--max-model-len", "256", "--num-kv-blocks", "40", "--kv-transfer-config", config],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode not in (0, -7), done.stderr[-3000:]   # -7: SIGBUS
    assert "num_cpu_blocks" in done.stderr and "filesystem" in done.stderr, done.stderr[-3000:]


def test_a_failed_save_turns_the_tier_off_with_one_warning_and_tokens_stay_the_same(model, tmp_path, monkeypatch,
                                                                                     caplog):
    prompts = shared_prefix_prompts(12)
    plain = make_llm(model, None)
    want = [o.outputs[0].token_ids for p in prompts for o in plain.generate([p], GREEDY, use_tqdm=False)]
    calls = []
    real_copy = OffloadingConnector._copy_to_store

    def failing_copy(self, block_ids, slots):
        calls.append(len(slots))
        if len(calls) >= 3:
            raise OSError(28, "No space left on device")
        real_copy(self, block_ids, slots)

    monkeypatch.setattr(OffloadingConnector, "_copy_to_store", failing_copy)
    llm = make_llm(model, tier(tmp_path / f"tier-{uuid.uuid4().hex}.bin"))
    with caplog.at_level(logging.WARNING):
        got = [o.outputs[0].token_ids for p in prompts for o in llm.generate([p], GREEDY, use_tqdm=False)]
    assert got == want
    warnings = [r for r in caplog.records if "KV tier" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "failed to save" in warnings[0].getMessage() and "No space left" in warnings[0].getMessage()
    assert len(calls) == 3, "after the failure no save is tried"
    engine = llm.llm_engine
    scheduler_side = engine.scheduler.connector
    assert scheduler_side.disabled and not scheduler_side.stored
    assert not engine.scheduler.kv_sending and not engine.scheduler.kv_pinned
    loaded = scheduler_side.num_blocks_loaded
    more = llm.generate(prompts[:4], GREEDY, use_tqdm=False)   # still serving, nothing loaded from the tier
    assert [o.outputs[0].token_ids for o in more] == want[:4]
    assert scheduler_side.num_blocks_loaded == loaded


def test_a_failed_load_turns_the_tier_off_and_the_request_computes_instead(model, tmp_path, monkeypatch, caplog):
    prompts = shared_prefix_prompts(12)
    plain = make_llm(model, None)
    want = [o.outputs[0].token_ids for p in prompts for o in plain.generate([p], GREEDY, use_tqdm=False)]

    def failing_load(self, block_ids, slots):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(OffloadingConnector, "_copy_from_store", failing_load)
    llm = make_llm(model, tier(tmp_path / "tier.bin"))
    with caplog.at_level(logging.WARNING):
        got = [o.outputs[0].token_ids for p in prompts for o in llm.generate([p], GREEDY, use_tqdm=False)]
    assert got == want
    assert len([r for r in caplog.records if "KV tier" in r.getMessage()]) == 1
    scheduler = llm.llm_engine.scheduler
    assert not scheduler.kv_sending and not scheduler.kv_pinned and not scheduler.waiting_for_remote_kvs
    shutil.rmtree(tmp_path, ignore_errors=True)
