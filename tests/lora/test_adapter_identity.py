"""An adapter's blocks are keyed by its weights, not by its name (issue 66, item 2).

The prefix cache may hand a request only KV computed with the same weights. A name is
a label a client chooses: ``LoRARequest("sql", 1, pathA)`` then ``("sql", 2, pathB)`` (an
unload and a load under the same name) are two adapters, and so are the same folder
before and after its files were replaced. Keyed by the name, the second reused 32
tokens of the first's KV and its greedy tokens differed from transformers + peft's.
Keyed by the digest of the adapter's files, they never share a block, while the same
files under another id or another name still do (their KV is the same).
"""

from __future__ import annotations

import shutil

import pytest

from microvllm import LLM, SamplingParams
from microvllm.lora.peft_helper import adapter_digest
from microvllm.lora.request import AdapterDigests, LoRARequest
from tests.engine.conftest import varied_prompts
from tests.lora.conftest import ADAPTER_CONFIGS, hf_peft_greedy, make_adapter

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(llm: LLM, prompt: list[int], lora: LoRARequest) -> tuple[tuple[int, ...], int]:
    """(its greedy tokens, its prefix-cache hit tokens at admission)."""
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=lora)[0]
    return tuple(out.outputs[0].token_ids), out.num_cached_tokens


@pytest.fixture(scope="module")
def two_sql_folders(lora_models, tmp_path_factory):
    """The tiny llama, and two "sql" adapters: the same config, other weights."""
    folder, requests = lora_models["llama"]
    root = tmp_path_factory.mktemp("sql_v2")
    second = make_adapter(folder, root / "sql_v2", seed=11, **ADAPTER_CONFIGS["sql"])
    return folder, requests["sql"].lora_path, str(second)


def test_one_name_two_folders_share_no_block(two_sql_folders):
    folder, path_a, path_b = two_sql_folders
    prompt = varied_prompts(512, count=2, seed=31)[0] + list(range(3, 43))   # > 2 blocks of 16
    llm = LLM(str(folder), enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256)
    first_tokens, first_hits = run(llm, prompt, LoRARequest("sql", 1, path_a))
    second_tokens, second_hits = run(llm, prompt, LoRARequest("sql", 2, path_b))   # unload, load elsewhere
    assert first_hits == 0 and second_hits == 0, f"the second folder reused {second_hits} tokens of the first's KV"
    assert first_tokens == hf_peft_greedy(str(folder), path_a, tuple(prompt), MAX_TOKENS)
    assert second_tokens == hf_peft_greedy(str(folder), path_b, tuple(prompt), MAX_TOKENS)
    assert first_tokens != second_tokens, "the two adapters should answer differently"
    # The same files under another id and another name: the same KV, so a hit.
    again_tokens, again_hits = run(llm, prompt, LoRARequest("sql-copy", 3, path_a))
    assert again_hits >= 32 and again_tokens == first_tokens


def test_a_folder_whose_files_were_replaced_shares_no_block(two_sql_folders, tmp_path):
    """Same name, same path, new files (written over the old, then loaded again under a
    new id): a key of name and path would still hit the old KV; the digest does not."""
    folder, path_a, path_b = two_sql_folders
    replaced = tmp_path / "sql"
    shutil.copytree(path_a, replaced)
    prompt = varied_prompts(512, count=2, seed=32)[0] + list(range(3, 43))
    llm = LLM(str(folder), enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256)
    before_tokens, _ = run(llm, prompt, LoRARequest("sql", 1, str(replaced)))
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(f"{path_b}/{name}", replaced / name)
    after_tokens, after_hits = run(llm, prompt, LoRARequest("sql", 2, str(replaced)))
    assert after_hits == 0, f"the replaced files reused {after_hits} tokens of the old files' KV"
    assert after_tokens == hf_peft_greedy(str(folder), path_b, tuple(prompt), MAX_TOKENS) != before_tokens


def test_a_digest_per_id_and_an_id_for_one_folder(two_sql_folders, tmp_path):
    """The front end takes an id's digest once; the same id with another folder is refused
    (the worker would run the first folder's weights under it)."""
    _, path_a, path_b = two_sql_folders
    digests = AdapterDigests()
    first = digests.with_digest(LoRARequest("sql", 1, path_a))
    assert first.lora_digest == adapter_digest(path_a) != adapter_digest(path_b)
    assert first == LoRARequest("sql", 1, path_a)   # the digest is not part of equality
    assert digests.with_digest(LoRARequest("sql", 1, path_a)).lora_digest == first.lora_digest
    with pytest.raises(ValueError, match="give each adapter folder its own lora_int_id"):
        digests.with_digest(LoRARequest("sql", 1, path_b))
    copy = tmp_path / "copy"
    shutil.copytree(path_a, copy)
    assert adapter_digest(copy) == first.lora_digest   # the files, not where they are
