"""A step's inputs off the CPU (worker/model_runner.py): ``ModelInputs.to(device)`` moves
every step tensor (on a CPU nothing is copied), and the runner makes a seeded request's
generator on the device once. "Elsewhere" is played here by torch's ``meta`` device."""

from types import SimpleNamespace

import torch

from microvllm.attention.metadata import AttentionMetadata
from microvllm.worker import model_runner
from microvllm.worker.model_runner import ModelInputs, ModelRunner


def step_inputs() -> ModelInputs:
    metadata = AttentionMetadata(
        num_actual_tokens=2, max_query_len=1, max_seq_len=5,
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([5, 3], dtype=torch.int32),
        block_table=torch.tensor([[1], [2]], dtype=torch.int32),
        slot_mapping=torch.tensor([20, 34]), query_start_loc_cpu=[0, 1, 2], seq_lens_cpu=[5, 3])
    states = [SimpleNamespace(generator=torch.Generator().manual_seed(4),
                              sampling_params=SimpleNamespace(seed=4)),
              SimpleNamespace(generator=None, sampling_params=SimpleNamespace(seed=None))]
    return ModelInputs(req_ids=["a", "b"], states=states, input_ids=torch.tensor([7, 8]),
                       positions=torch.tensor([4, 2]), attn_metadata=[metadata], sampling_req_indices=[0, 1],
                       logits_indices=torch.tensor([0, 1]))


def tensors(inputs: ModelInputs) -> list[torch.Tensor]:
    (m,) = inputs.attn_metadata
    return [inputs.input_ids, inputs.positions, inputs.logits_indices, m.query_start_loc, m.seq_lens,
            m.block_table, m.slot_mapping]


def test_on_a_cpu_nothing_moves():
    inputs = step_inputs()
    before = tensors(inputs)
    assert all(a is b for a, b in zip(tensors(inputs.to(torch.device("cpu"))), before))


def test_elsewhere_every_step_tensor_moves():
    moved = step_inputs().to(torch.device("meta"))
    assert all(t.device.type == "meta" for t in tensors(moved))
    assert moved.attn_metadata[0].seq_lens_cpu == [5, 3] and moved.req_ids == ["a", "b"]
    assert moved.sampling_req_indices == [0, 1]


def test_generators_are_made_on_the_device_once(monkeypatch):
    made = []

    def make_generator(seed, device):
        made.append((seed, torch.device(device)))
        return SimpleNamespace(device=torch.device(device))

    monkeypatch.setattr(model_runner, "make_generator", make_generator)
    runner = object.__new__(ModelRunner)
    runner.device = torch.device("meta")
    states = step_inputs().states
    runner._make_generators_on_device(states)
    assert made == [(4, torch.device("meta"))] and states[1].generator is None
    runner._make_generators_on_device(states)  # the next step
    assert len(made) == 1  # already on the device: kept, its state goes on
