"""saved_bytes / charged count each storage saved for backward once, by identity held for the whole count."""

import torch
from approxbp.kernels.ops.saved import charged, saved_bytes


def test_a_storage_freed_during_the_forward_does_not_hide_a_later_one():
    """Fifty graphs, each saving a fresh 256-byte input and dropped at once: a freed StorageImpl's address is
    reused by the next one, which an address-keyed count would skip (it gave 7168 of 12800 bytes)."""
    w = torch.randn(64, requires_grad=True)

    def forward():
        for _ in range(50):
            x = torch.randn(64)
            (x * w).sum()  # mul saves x (and w, excluded); the graph and x are freed on the next line

    assert saved_bytes(forward, exclude=[w]) == 50 * 64 * 4


def test_views_of_one_storage_count_once_and_parameters_not_at_all():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8)

    def forward():
        return (x[:4] @ w).sum() + (x[4:] @ w).sum() + (x * w).sum()  # three saves of x's one storage

    assert saved_bytes(forward, exclude=[w]) == x.untyped_storage().nbytes()


def test_the_count_holds_what_it_saw_until_it_ends():
    """A saved storage freed inside the count stays alive until the count ends (so its identity is not reused),
    and is released then (measuring keeps no memory)."""
    w = torch.randn(16, requires_grad=True)
    into: dict[str, int] = {}
    with charged(into, [w]):
        x = torch.randn(16)
        y = (x * w).sum()
        ref = x.untyped_storage()._weak_ref()
        del x, y
        alive_inside = not torch.UntypedStorage._expired(ref)
    freed_after = torch.UntypedStorage._expired(ref)
    torch.UntypedStorage._free_weak_ref(ref)
    assert into == {"": 64} and alive_inside and freed_after
