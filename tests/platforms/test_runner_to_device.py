"""``ModelRunner._to_device`` (worker/model_runner.py): on a CPU it returns the inputs as
they are; elsewhere it moves every step tensor and makes a seeded request's generator
on the device once. "Elsewhere" is played here by torch's ``meta`` device."""

from types import SimpleNamespace

import torch

from microvllm.attention.metadata import AttentionMetadata
from microvllm.worker import model_runner
from microvllm.worker.model_runner import ModelRunner


def step_inputs():
    metadata = AttentionMetadata(
        num_actual_tokens=2, max_query_len=1, max_seq_len=5,
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([5, 3], dtype=torch.int32),
        block_table=torch.tensor([[1], [2]], dtype=torch.int32),
        slot_mapping=torch.tensor([20, 34]), query_start_loc_cpu=[0, 1, 2], seq_lens_cpu=[5, 3])
    states = [SimpleNamespace(generator=torch.Generator().manual_seed(4),
                              sampling_params=SimpleNamespace(seed=4)),
              SimpleNamespace(generator=None, sampling_params=SimpleNamespace(seed=None))]
    return (["a", "b"], states, torch.tensor([7, 8]), torch.tensor([4, 2]), [metadata], [0, 1],
            torch.tensor([0, 1]))


def runner_on(device):
    runner = object.__new__(ModelRunner)
    runner.device = torch.device(device)
    return runner


def test_on_a_cpu_nothing_moves():
    inputs = step_inputs()
    assert all(a is b for a, b in zip(runner_on("cpu")._to_device(*inputs), inputs))


def test_elsewhere_every_step_tensor_moves_and_generators_are_made_there_once(monkeypatch):
    made = []

    def make_generator(seed, device):
        made.append((seed, torch.device(device)))
        return SimpleNamespace(device=torch.device(device))

    monkeypatch.setattr(model_runner, "make_generator", make_generator)
    runner = runner_on("meta")
    req_ids, states, input_ids, positions, (metadata,), sampling, logits_indices = \
        runner._to_device(*step_inputs())
    for tensor in (input_ids, positions, logits_indices, metadata.query_start_loc, metadata.seq_lens,
                   metadata.block_table, metadata.slot_mapping):
        assert tensor.device.type == "meta"
    assert metadata.seq_lens_cpu == [5, 3] and req_ids == ["a", "b"] and sampling == [0, 1]
    assert made == [(4, torch.device("meta"))] and states[1].generator is None
    runner._to_device(*step_inputs()[:1], states, *step_inputs()[2:])  # the next step
    assert len(made) == 1  # already on the device: kept, its state goes on
