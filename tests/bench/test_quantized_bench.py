"""``bench throughput --workload quantization`` (bench/quantized.py) and bench/quality.py on a tiny model."""

import math

import pytest

from microvllm import LLM
from microvllm.bench import quality
from microvllm.cli.main import main as cli_main
from microvllm.models.tiny import make_tiny_model
from microvllm.models.tiny_gguf import write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("hf") / "llama", "llama", seed=5)
    return folder, write_gguf(folder, folder.parent / "tiny.gguf", weight_type="Q8_0")


def test_the_cli_routes_the_quantization_workload(capsys):
    assert cli_main(["bench", "throughput", "--workload", "quantization", "--model", "somewhere"]) == 0
    assert "compares the embedded model's three forms; drop --model" in capsys.readouterr().out


def test_greedy_agreement_and_perplexity(tiny):
    folder, gguf_file = tiny
    reference, native = LLM(model=str(folder)), LLM(model=str(gguf_file))
    prompts = ["the cache", "a model reads", "tokens and blocks"]
    same, divergences = quality.greedy_agreement(reference, reference, prompts, max_tokens=8)
    assert (same, divergences) == (3, [])
    same, divergences = quality.greedy_agreement(reference, native, prompts, max_tokens=8)
    assert same + len(divergences) == 3
    for d in divergences:   # every divergence is reported where the two outputs part
        assert 0 <= d.position < 8 and d.reference_margin >= 0
    text = quality.describe("Q8_0", same, divergences, 3)
    assert text.startswith(f"Q8_0: {same}/3 greedy outputs identical to f32")
    ppl = quality.perplexity(reference, ["the model reads the cache and the blocks"])
    assert math.isfinite(ppl) and ppl > 1
    assert quality.perplexity(native, ["the model reads the cache and the blocks"]) == pytest.approx(ppl, rel=0.05)
