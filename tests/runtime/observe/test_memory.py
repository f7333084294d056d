"""Peak tensor memory on CPU from the allocator's events."""

import torch

from runtime.observe.memory import live_tensor_bytes, peak_growth_during


def test_peak_growth_sees_a_temporary_that_is_freed():
    def work():
        big = torch.ones(1024, 1024)  # 4 MiB, freed before returning
        small = torch.ones(256, 1024)  # 1 MiB, returned
        return small + big[:256]

    result, growth = peak_growth_during(work, torch.device("cpu"))
    assert result.shape == (256, 1024)
    # big (4 MiB) + small (1 MiB) + the result (1 MiB) were live at once.
    assert 6 * 2**20 <= growth < 7 * 2**20


def test_live_bytes_count_shared_storage_once():
    base = torch.zeros(1000)
    assert live_tensor_bytes([base, base[:10], base.view(10, 100), None]) == 4000


def test_live_bytes_take_a_packed_batch_of_tokens_and_positions():
    """With --document-mask a batch's inputs are a (tokens, positions) pair; the step's starting bytes count both."""
    tokens, positions, targets = torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8)
    assert live_tensor_bytes([(tokens, positions), targets]) == 2 * 128 + 64


def test_live_bytes_count_an_fp8_all_gather_weight_by_its_shard():
    """--fp8-all-gather's parameters wrap their fp32 shard (a wrapper subclass has no storage of its own: reading
    it raised "invalid python storage" under --profile-memory)."""
    from compiler.fp8 import RECIPES
    from compiler.fp8.fsdp_all_gather import Fp8AllGatherWeight

    shard = torch.zeros(4, 8)
    weight = torch.nn.Parameter(Fp8AllGatherWeight(shard, RECIPES["tensorwise"]))
    assert live_tensor_bytes([weight, shard]) == 4 * 8 * 4
