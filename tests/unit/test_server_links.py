"""The trainer's links to inference servers (relax_hpc.weights.server_links) announce one protocol: the c10d link
(SGLang) and vLLM's (relax_hpc.weights.vllm_transfer) differ only in their group's name, backend and the packing
geometry vLLM's receiver needs (the broadcasts themselves are tests/integration/test_engine_sglang.py's, and vLLM's
need CUDA)."""

from __future__ import annotations

import json
from typing import Any

import torch

from relax_hpc.fsio import wait_for
from relax_hpc.rundir import RunDir
from relax_hpc.weights.server_links import ServerLinks, link_file
from relax_hpc.weights.vllm_transfer import DEFAULT_BUFFER_BYTES, DEFAULT_NUM_BUFFERS, VLLMServerLinks


def _announced(rd: RunDir, links: ServerLinks, prefix: str) -> dict[str, Any]:
    path = link_file(rd, 0)
    try:
        links.update(3, {"a": torch.ones(3), "b": torch.zeros(2, 2, dtype=torch.bfloat16)})

        def read() -> dict[str, Any] | None:
            info = json.loads(path.read_text()) if path.exists() else None
            return info if info is not None and info["group_name"].startswith(prefix) else None

        return wait_for(read, what="the link's announcement", timeout_s=30)
    finally:
        links.close()
        path.unlink(missing_ok=True)


def test_the_c10d_and_the_vllm_link_announce_the_same_protocol(rd: RunDir) -> None:
    c10d = _announced(rd, ServerLinks(rd, 1, world_size=2, timeout_s=5), "relax_weights_")
    vllm = _announced(rd, VLLMServerLinks(rd, 1, world_size=2, timeout_s=5, device="cpu"), "relax_vllm_weights_")
    buckets = [[["b", "bfloat16", [2, 2]]], [["a", "float32", [3]]]]  # a bucket per dtype
    assert (c10d["group_name"], c10d["backend"], c10d["buckets"]) == ("relax_weights_0_1", "gloo", buckets)
    assert (vllm["group_name"], vllm["backend"], vllm["buckets"]) == ("relax_vllm_weights_0_1", "vllm-nccl", buckets)
    assert vllm["packed"] == {"packed": True, "buffer_size_bytes": DEFAULT_BUFFER_BYTES,
                              "num_buffers": DEFAULT_NUM_BUFFERS} and "packed" not in c10d
    common = {"host", "port", "control_port", "world_size", "generation", "pid", "time"}
    assert common <= c10d.keys() and common <= vllm.keys() and c10d["world_size"] == vllm["world_size"] == 2
