"""The megatron backend's packed core attention on a GPU: torch's flash varlen kernel (one call per micro-batch,
bfloat16) gives the per-sequence SDPA loop's output and gradients within bfloat16 rounding. Marked ``gpu``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_varlen_kernel_matches_the_per_sequence_loop() -> None:
    from relax_hpc.trainer.megatron.layers import sdpa_per_sequence, varlen_causal

    torch.manual_seed(0)
    lengths = [37, 300, 1, 129, 512]
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    t = sum(lengths)
    q = torch.randn(t, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fast = varlen_causal(q, k, v, cu, None)
    assert fast is not None, "torch >= 2.10 on CUDA has the varlen kernel"
    slow = sdpa_per_sequence(q, k, v, cu, None)
    assert fast.shape == slow.shape == (t, 16, 128)
    torch.testing.assert_close(fast, slow, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(fast)
    grads_fast = torch.autograd.grad(fast, (q, k, v), g)
    grads_slow = torch.autograd.grad(slow, (q, k, v), g)
    for a, b in zip(grads_fast, grads_slow, strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
    assert varlen_causal(q.float(), k.float(), v.float(), cu, None) is None  # float32: the loop
