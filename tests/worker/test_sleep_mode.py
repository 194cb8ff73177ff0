"""WeightArena and the CPU host backup: parameters packed into one storage keep their
values and their sharing, and survive being freed and restored."""

from __future__ import annotations

import torch

from tokenmill.worker.sleep_mode import HostBackup, WeightArena


def make_module() -> torch.nn.Module:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=True))
    module[1].weight = module[0].weight  # tied, as tied embeddings are
    return module.requires_grad_(False)


def test_arena_packs_parameters_and_keeps_tied_ones_tied():
    module = make_module()
    before = {n: p.clone() for n, p in module.named_parameters()}
    arena = WeightArena(list(module.parameters()))
    for name, p in module.named_parameters():
        assert torch.equal(p, before[name])
        assert p.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
    assert module[1].weight.data_ptr() == module[0].weight.data_ptr()
    # Each storage is aligned; the tied one is counted once.
    assert arena.nbytes < 2 * sum(p.numel() * 4 for p in module.parameters())
    out = module(torch.tensor([1, 2]))
    assert out.shape == (2, 10)


def test_release_backup_restore_on_cpu():
    module = make_module()
    arena = WeightArena(list(module.parameters()))
    expected = module(torch.tensor([3, 4]))
    backup = HostBackup()
    backup.save(arena.buffer)
    arena.release()
    assert not arena.resident
    assert arena.buffer.untyped_storage().nbytes() == 0
    arena.restore()
    backup.load(arena.buffer)
    assert torch.equal(module(torch.tensor([3, 4])), expected)
    backup.discard()
