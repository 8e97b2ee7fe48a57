"""Pipeline parallelism of the megatron backend: the stages of one model replica, the transfers between them, and
the 1F1B schedule over the micro-batches of a step.

Stage ``s`` of ``pp`` holds layers ``[s*L/pp, (s+1)*L/pp)`` (:func:`~relax_hpc.trainer.megatron.mapping.stage_layers`),
the embedding on the first stage and the final norm and output layer on the last (megatron's ``pre_process`` /
``post_process``); with tied embeddings the last stage holds a copy of the embedding, loaded from the same HF tensor
and kept equal by ``finalize_model_grads`` (it sums the two copies' gradients over megatron's embedding group). Every
rank of one data-parallel replica packs the same micro-batches from the same items, so the activation crossing a
stage boundary, [tokens, 1, hidden] (one packed row), has a shape both sides know without sending it; a stage that is
not the first gets it through ``GPTModel.set_input_tensor``.

megatron-core's own schedules (``pipeline_parallel/schedules.py``) make their buffers with ``device="cuda"`` and do
not run without CUDA. The schedules here are written over ``torch.distributed``'s ``batch_isend_irecv`` on megatron's
pipeline group:

- :func:`train` (1F1B): stage ``s`` runs ``min(pp - s - 1, M)`` warm-up forwards of its ``M`` micro-batches, then
  alternates one forward and one backward (micro-batch ``k``'s activation goes out in the same batch of transfers
  that brings back the gradient of the oldest micro-batch in flight), then the cool-down backwards, so at most
  ``pp - s`` micro-batches' activations are alive on stage ``s``. The last stage's output is the micro-batch's loss,
  back-propagated there; every other stage back-propagates the gradient the next stage sent and sends its input's
  gradient back. The pipeline drains at the end of each call (one ``accumulate`` of the backend): the micro-batches
  of one call interleave, those of two calls do not.
- :func:`forward_only`: log-probs without gradients (old/proximal log-probs; :func:`forward_logprobs`) and full
  logits (:func:`logits`); the results exist on the last stage.

Transfers: a gloo group carries CPU tensors (CUDA tensors go through CPU copies: ranks sharing one GPU), NCCL the
device's own. Every wait is bounded by the pipeline group's timeout and names what it waited for.

Weights leave a pipelined model a layer at a time (:meth:`Stage.hand_over`): the stage holding a layer sends its
HF-named tensors (a JSON header of names, shapes and dtypes, then the tensors) to the first stage, whose TP rank 0
of data-parallel replica 0 is global rank 0; or broadcasts them to every stage where every rank needs the model.

Not done: interleaved (virtual) stages; freeing the storage of an activation once sent (megatron keeps only its
autograd node); overlapping transfers with compute (each transfer is waited for before the next compute).
"""

from __future__ import annotations

import contextlib
import json
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from relax_hpc.trainer.batch import MicroBatch
    from relax_hpc.trainer.megatron.host import PipelineHost

Shape = tuple[int, ...]
Run = Callable[[int, "torch.Tensor | None"], Any]
"""``run(k, input)``: micro-batch ``k`` on this stage, ``input`` the previous stage's activation (None on the first
stage); returns the activation for the next stage, or on the last stage the loss (training) or the result."""


class PipelineError(RuntimeError):
    """A transfer between pipeline stages failed or did not complete within the group's timeout."""


def group_timeout(group: Any, device: torch.device) -> timedelta:
    """The timeout ``group`` was made with (megatron's ``distributed_timeout_minutes``), else torch's default."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


@dataclass(frozen=True)
class Stage:
    """This rank's place in its pipeline: stage ``rank`` of ``size``, the pipeline group (``ranks``: its global ranks
    in stage order), where the model's tensors live (``device``) and where they cross the group (``wire``)."""

    rank: int
    size: int
    ranks: tuple[int, ...]
    group: Any
    device: torch.device
    wire: torch.device
    timeout: timedelta

    @classmethod
    def of_this_rank(cls, device: str) -> Stage:
        """This rank's stage in megatron's parallel state (one stage without pipeline parallelism). With several
        stages, one broadcast over the group first: an NCCL group builds its communicator there, with every stage
        taking part (a first point-to-point call would build it on two ranks of a larger group)."""
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        ranks = tuple(dist.get_process_group_ranks(group))
        dev = torch.device(device)
        wire = torch.device("cpu") if dist.get_backend(group) == "gloo" else dev
        stage = cls(rank=ps.get_pipeline_model_parallel_rank(), size=len(ranks), ranks=ranks, group=group,
                    device=dev, wire=wire, timeout=group_timeout(group, wire))
        stage.from_last(torch.zeros(1), "the pipeline group's first broadcast")
        return stage

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    # ------------------------------------------------------------------ transfers
    def _wait(self, works: list[Any], what: str) -> None:
        for work in works:
            try:
                done = work.wait(self.timeout)
            except RuntimeError as exc:
                raise PipelineError(f"pipeline stage {self.rank}/{self.size}: {what} failed or did not complete "
                                    f"within {self.timeout}: {exc}") from exc
            if done is False:
                raise PipelineError(f"pipeline stage {self.rank}/{self.size}: {what} did not complete within "
                                    f"{self.timeout}")

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[Shape, torch.dtype, int]],
                 what: str) -> list[torch.Tensor]:
        """Send each ``(tensor, stage)`` and receive each ``(shape, dtype, stage)`` in one batch; the received
        tensors, on the wire's device."""
        ops = [dist.P2POp(dist.isend, t.detach().to(self.wire).contiguous(), self.ranks[s], self.group)
               for t, s in sends]
        bufs = [torch.empty(shape, dtype=dtype, device=self.wire) for shape, dtype, _ in recvs]
        ops += [dist.P2POp(dist.irecv, b, self.ranks[s], self.group) for b, (_, _, s) in zip(bufs, recvs, strict=True)]
        if ops:
            self._wait(dist.batch_isend_irecv(ops), what)
        return bufs

    def from_last(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` as the last stage holds it (a broadcast over the pipeline group; every stage calls)."""
        if self.size == 1:
            return t
        buf = t.detach().to(self.wire).clone()
        self._wait([dist.broadcast(buf, src=self.ranks[-1], group=self.group, async_op=True)], what)
        return buf.to(t.device)

    # ------------------------------------------------------------------ the schedule's transfers
    def recv_forward(self, k: int, shape: Shape, dtype: torch.dtype, *, grad: bool) -> torch.Tensor | None:
        """Micro-batch ``k``'s input from the previous stage (None on the first)."""
        if self.first:
            return None
        (t,) = self.exchange([], [(shape, dtype, self.rank - 1)], f"micro-batch {k}'s activation from the previous "
                                                                  "stage")
        return t.to(self.device).requires_grad_(grad)

    def send_forward(self, k: int, out: torch.Tensor) -> None:
        """Micro-batch ``k``'s activation to the next stage (nothing on the last)."""
        if not self.last:
            self.exchange([(out, self.rank + 1)], [], f"micro-batch {k}'s activation to the next stage")

    def send_forward_recv_backward(self, k: int, out: torch.Tensor, j: int, shape: Shape,
                                   dtype: torch.dtype) -> torch.Tensor | None:
        """Micro-batch ``k``'s activation out, micro-batch ``j``'s output gradient in (None on the last stage)."""
        if self.last:
            return None
        (g,) = self.exchange([(out, self.rank + 1)], [(shape, dtype, self.rank + 1)],
                             f"micro-batch {k}'s activation to the next stage and micro-batch {j}'s gradient from it")
        return g.to(self.device)

    def send_backward_recv_forward(self, j: int, grad: torch.Tensor | None, k: int, shape: Shape,
                                   dtype: torch.dtype) -> torch.Tensor | None:
        """Micro-batch ``j``'s input gradient out, micro-batch ``k``'s input in (None on the first stage)."""
        if self.first:
            return None
        assert grad is not None
        (t,) = self.exchange([(grad, self.rank - 1)], [(shape, dtype, self.rank - 1)],
                             f"micro-batch {j}'s gradient to the previous stage and micro-batch {k}'s activation "
                             "from it")
        return t.to(self.device).requires_grad_(True)

    def recv_backward(self, j: int, shape: Shape, dtype: torch.dtype) -> torch.Tensor | None:
        """Micro-batch ``j``'s output gradient from the next stage (None on the last)."""
        if self.last:
            return None
        (g,) = self.exchange([], [(shape, dtype, self.rank + 1)], f"micro-batch {j}'s gradient from the next stage")
        return g.to(self.device)

    def send_backward(self, j: int, grad: torch.Tensor | None) -> None:
        """Micro-batch ``j``'s input gradient to the previous stage (nothing on the first)."""
        if not self.first:
            assert grad is not None
            self.exchange([(grad, self.rank - 1)], [], f"micro-batch {j}'s gradient to the previous stage")

    # ------------------------------------------------------------------ weights out
    def hand_over(self, part: dict[str, torch.Tensor], owner: int, *, every: bool,
                  to_first: bool) -> dict[str, torch.Tensor]:
        """The HF-named CPU tensors ``part`` of one unit (a layer) that stage ``owner`` holds: with ``every`` on
        every stage (a broadcast; every rank calls), else on the first stage for the ranks with ``to_first`` (its
        global rank 0 and the owner's matching rank call; others get back what they gave)."""
        if self.size == 1:
            return part
        if every:
            return self._broadcast_part(part, owner)
        if to_first and owner != 0 and self.rank == owner:
            self._send_part(part, owner)
        elif to_first and owner != 0 and self.first:
            return self._recv_part(owner)
        return part

    def _send_part(self, part: dict[str, torch.Tensor], owner: int) -> None:
        """``part`` to the first stage: the header's length, the header, the tensors (in the receiver's batches)."""
        head = _header(part)
        what = f"layer unit from stage {owner} to the first stage"
        self.exchange([(torch.tensor([head.numel()]), 0)], [], what)
        self.exchange([(head, 0)], [], what)
        self.exchange([(part[n], 0) for n in sorted(part)], [], what)

    def _recv_part(self, owner: int) -> dict[str, torch.Tensor]:
        """What :meth:`_send_part` of stage ``owner`` sends, as CPU tensors."""
        what = f"layer unit from stage {owner} to the first stage"
        (size,) = self.exchange([], [((1,), torch.int64, owner)], what)
        (head,) = self.exchange([], [((int(size),), torch.uint8, owner)], what)
        layout = _layout(head)
        got = self.exchange([], [(tuple(s), d, owner) for _, s, d in layout], what)
        return {name: t.cpu() for (name, _, _), t in zip(layout, got, strict=True)}

    def _broadcast_part(self, part: dict[str, torch.Tensor], owner: int) -> dict[str, torch.Tensor]:
        """``part`` of stage ``owner`` on every stage (CPU tensors): the header's length, the header, the tensors."""
        src, mine = self.ranks[owner], self.rank == owner
        what = f"layer unit from stage {owner} to every stage"
        head = _header(part) if mine else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([head.numel()]).to(self.wire)
        self._wait([dist.broadcast(size, src=src, group=self.group, async_op=True)], what)
        head = (head if mine else torch.empty(int(size), dtype=torch.uint8)).to(self.wire)
        self._wait([dist.broadcast(head, src=src, group=self.group, async_op=True)], what)
        layout = _layout(head)
        bufs = [part[n].to(self.wire).contiguous() if mine else torch.empty(tuple(s), dtype=d, device=self.wire)
                for n, s, d in layout]
        self._wait([dist.broadcast(b, src=src, group=self.group, async_op=True) for b in bufs], what)
        return part if mine else {n: b.cpu() for (n, _, _), b in zip(layout, bufs, strict=True)}


def _header(part: dict[str, torch.Tensor]) -> torch.Tensor:
    """The JSON header (uint8) of a unit: [name, shape, dtype] of each tensor, by name."""
    rows = [[n, list(part[n].shape), str(part[n].dtype)] for n in sorted(part)]
    return torch.frombuffer(bytearray(json.dumps(rows).encode()), dtype=torch.uint8)


def _layout(head: torch.Tensor) -> list[tuple[str, list[int], torch.dtype]]:
    """(name, shape, dtype) of each tensor of a unit, from its JSON header (uint8)."""
    rows = json.loads(bytes(head.cpu().tolist()).decode())
    return [(n, s, getattr(torch, d.removeprefix("torch."))) for n, s, d in rows]


# ---------------------------------------------------------------------------------------------------- schedules
def _backward(inp: torch.Tensor | None, out: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
    """Back-propagate ``out`` (the loss on the last stage, else with the next stage's gradient ``grad``); the
    gradient of this stage's input (None on the first stage)."""
    if grad is None:
        out.backward()
    else:
        torch.autograd.backward(out, grad_tensors=grad)
    if inp is None:
        return None
    return inp.grad if inp.grad is not None else torch.zeros_like(inp)


def _checked(stage: Stage, out: Any, shape: Shape, dtype: torch.dtype) -> Any:
    """``out``; a stage's activation must have the shape and dtype the next stage receives into."""
    if not stage.last:
        assert tuple(out.shape) == shape and out.dtype == dtype, (tuple(out.shape), out.dtype, shape, dtype)
    return out


def one_f_one_b(stage: Stage, shapes: Sequence[Shape], dtype: torch.dtype, run: Run) -> None:
    """Forward and backward of micro-batches ``0 .. len(shapes) - 1`` in 1F1B order (module docstring); ``shapes``
    are the activations' shapes, the same on every stage."""
    n = len(shapes)
    warm = min(stage.size - stage.rank - 1, n)
    alive: deque[tuple[int, torch.Tensor | None, torch.Tensor]] = deque()
    for k in range(warm):
        inp = stage.recv_forward(k, shapes[k], dtype, grad=True)
        out = _checked(stage, run(k, inp), shapes[k], dtype)
        stage.send_forward(k, out)
        alive.append((k, inp, out))
    inp = stage.recv_forward(warm, shapes[warm], dtype, grad=True) if warm < n else None
    for k in range(warm, n):
        out = _checked(stage, run(k, inp), shapes[k], dtype)
        j = k - warm  # the oldest micro-batch in flight: its gradient comes back now
        grad = stage.send_forward_recv_backward(k, out, j, shapes[j], dtype)
        alive.append((k, inp, out))
        oldest, b_inp, b_out = alive.popleft()
        assert oldest == j, (oldest, j)
        g_in = _backward(b_inp, b_out, grad)
        if k + 1 < n:
            inp = stage.send_backward_recv_forward(j, g_in, k + 1, shapes[k + 1], dtype)
        else:
            stage.send_backward(j, g_in)
    while alive:
        j, b_inp, b_out = alive.popleft()
        grad = stage.recv_backward(j, shapes[j], dtype)
        stage.send_backward(j, _backward(b_inp, b_out, grad))


def forward_only(stage: Stage, shapes: Sequence[Shape], dtype: torch.dtype, run: Run) -> list[Any]:
    """Micro-batches ``0 .. len(shapes) - 1`` forward through the stages; the last stage's results (None on the
    other stages)."""
    results: list[Any] = []
    for k, shape in enumerate(shapes):
        out = _checked(stage, run(k, stage.recv_forward(k, shape, dtype, grad=False)), shape, dtype)
        if not stage.last:
            stage.send_forward(k, out)
            out = None
        results.append(out)
    return results


# ---------------------------------------------------------------------------------------------------- the backend's
def _shape(backend: PipelineHost, tokens: int) -> Shape:
    """The activation crossing a stage boundary: [tokens, 1, hidden] (one packed row)."""
    return (tokens, 1, backend.shape.hidden_size)


@contextlib.contextmanager
def _input(backend: PipelineHost, inp: torch.Tensor | None) -> Iterator[None]:
    """The GPT's decoder reads ``inp`` (the previous stage's activation) in this block; None after it."""
    backend.gpt.set_input_tensor(inp)
    try:
        yield
    finally:
        backend.gpt.set_input_tensor(None)


def _hidden(backend: PipelineHost, mb: MicroBatch) -> torch.Tensor:
    """A stage that is not the last: its output hidden states [T, 1, H] for micro-batch ``mb`` (one packed row; the
    sequences' boundaries are the GPT's ``attention_mask``, as in the backend's ``_forward``)."""
    with backend.packing.use([it.num_tokens for it in mb.items], mb.position_ids[0]) as cu:
        return backend.model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=cu)


def train(backend: PipelineHost, mbs: Sequence[MicroBatch], loss_of: Callable[[int, MicroBatch], Any]) -> None:
    """Forward and backward of ``mbs`` through the pipeline (1F1B); ``loss_of(k, mb)`` is called on the last stage
    only, where the GPT's input is set, and gives micro-batch ``k``'s loss."""
    stage = backend.stage

    def run(k: int, inp: torch.Tensor | None) -> Any:
        with _input(backend, inp):
            if stage.last:
                return loss_of(k, mbs[k])
            with backend.compiled_ctx():
                return _hidden(backend, mbs[k])

    one_f_one_b(stage, [_shape(backend, mb.input_ids.shape[1]) for mb in mbs], backend.dtype, run)


def forward_logprobs(backend: PipelineHost, mbs: Sequence[MicroBatch], *,
                     with_entropy: bool = False) -> list[tuple[torch.Tensor, torch.Tensor | None] | None]:
    """Per micro-batch, the log-probs [T] (and entropies [T]) of the response tokens without gradients, as
    ``sequence_logprobs`` computes them: on the last stage; None on the others."""
    stage = backend.stage

    def run(k: int, inp: torch.Tensor | None) -> Any:
        with _input(backend, inp):
            if stage.last:
                return backend.sequence_logprobs(backend.model, mbs[k], with_entropy=with_entropy)
            return _hidden(backend, mbs[k])

    with torch.no_grad():
        return forward_only(stage, [_shape(backend, mb.input_ids.shape[1]) for mb in mbs], backend.dtype, run)


def logits(backend: PipelineHost, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [B, S, V] of unpacked ``input_ids`` [B, S] through the pipeline (each row one
    micro-batch), on every rank (broadcast from the last stage)."""
    stage = backend.stage
    rows, length = input_ids.shape

    def run(k: int, inp: torch.Tensor | None) -> Any:
        pos = torch.arange(length, device=input_ids.device)[None]
        with _input(backend, inp):
            out = backend.model(input_ids=input_ids[k][None], position_ids=pos, attention_mask=None)
        return backend.gather_vocab(out[0])[:, : backend.shape.vocab_size] if stage.last else out

    with torch.no_grad():
        outs = forward_only(stage, [_shape(backend, length)] * rows, backend.dtype, run)
        shape = (rows, length, backend.shape.vocab_size)
        full = (torch.stack(outs).to(backend.dtype) if stage.last
                else torch.empty(shape, dtype=backend.dtype, device=input_ids.device))
    return stage.from_last(full, "the logits from the last stage")


@contextlib.contextmanager
def cuda_is_cpu() -> Iterator[None]:
    """Where torch has no CUDA: ``Tensor.cuda()`` returns the tensor itself inside this block. Building a GPT's
    last stage with tied embeddings moves its copy of the embedding to CUDA before summing it with the first
    stage's (megatron-core's ``setup_embeddings_and_output_layer``); the backend loads both from the HF weights
    afterwards."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]
