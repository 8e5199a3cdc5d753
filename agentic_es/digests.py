"""Weight digests: sha256 over each tensor's name, shape, dtype and bytes, and one digest per TP rank of them all.
Exactness is checked with these everywhere: each generation's record, resume, export, replay.
A GPU tensor streams through pinned host buffers while threads hash; the same bytes in the same order, so the same
digest, on every device."""

import concurrent.futures
import hashlib
import os
import queue

import torch

def tensor_digest(name: str, t: torch.Tensor, staging: "DigestStaging | None" = None) -> str:
    """sha256 over name, shape, dtype and the tensor's bytes. A CPU tensor is hashed in place; a GPU tensor streams
    through `staging` (pinned host buffers) chunk by chunk, or without it is copied whole: the same bytes in the
    same order either way, so the same digest."""
    h = hashlib.sha256()
    h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
    data = t.detach().contiguous().view(-1).view(torch.uint8)
    if data.device.type != "cpu" and staging is not None:
        staging.hash_into(h, data)
    else:
        h.update(data.cpu().numpy())  # on the CPU: the buffer itself, no extra copy
    return h.hexdigest()


class DigestStaging:
    """Two pinned host buffers and a copy stream: while chunk k is hashed on the CPU, chunk k+1 is copied off the
    GPU. Pageable copies of whole tensors would fault in fresh host pages on every call; these buffers are pinned
    once and reused every generation."""

    def __init__(self, device, chunk_bytes: int = 0):
        self.device = torch.device(device)
        self.chunk = chunk_bytes or DIGEST_CHUNK_BYTES
        self.buffers = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.stream = torch.cuda.Stream(device=self.device)
        self.copied = [torch.cuda.Event() for _ in range(2)]

    def hash_into(self, h, data: torch.Tensor) -> None:
        with torch.cuda.device(self.device):
            # the copies may start only after every write to the weights queued on the current stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            pending = None  # (buffer index, bytes) of the chunk copied last, not yet hashed
            for k, start in enumerate(range(0, data.numel(), self.chunk)):
                piece = data[start : start + self.chunk]
                with torch.cuda.stream(self.stream):  # buffer k % 2 held chunk k-2, hashed already
                    self.buffers[k % 2][: piece.numel()].copy_(piece, non_blocking=True)
                    self.copied[k % 2].record(self.stream)
                if pending:
                    self._hash(h, *pending)
                pending = (k % 2, piece.numel())
            if pending:
                self._hash(h, *pending)

    def _hash(self, h, index: int, size: int) -> None:
        self.copied[index].synchronize()
        h.update(self.buffers[index][:size].numpy())


def tensor_digests(named_tensors: list[tuple[str, torch.Tensor]], threads: int,
                   staging: list[DigestStaging] | None = None) -> list[tuple[str, str]]:
    """(name, tensor_digest) for each tensor, hashed in `threads` threads (hashlib releases the GIL on large
    buffers), largest tensors first so that no thread is left with a big one at the end. GPU tensors go through
    `staging` (one per thread, kept by the caller: ESWorker pins them once); without it they are copied whole. The
    same digests, in the same order, as one thread."""
    threads = max(1, min(threads, len(named_tensors)))
    slots = list(staging[:threads]) if staging else [None] * threads  # each thread holds one slot while it hashes
    threads = len(slots)
    free = queue.SimpleQueue()
    for s in slots:
        free.put(s)

    def digest(name_and_tensor):
        s = free.get()
        try:
            return tensor_digest(*name_and_tensor, staging=s)
        finally:
            free.put(s)

    largest_first = sorted(range(len(named_tensors)), key=lambda i: -named_tensors[i][1].numel())
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="digest") as pool:
        done = dict(zip(largest_first, pool.map(digest, (named_tensors[i] for i in largest_first))))
    return [(name, done[i]) for i, (name, _) in enumerate(named_tensors)]


# threads hashing one rank's tensors: the node's cores shared by its TP ranks, at most 16 (sha256 runs at 1-2 GB/s
# per core; a rank of Qwen3-30B-A3B holds 30.5 GB)
DIGEST_THREADS_PER_RANK = max(1, min(16, len(os.sched_getaffinity(0)) // 2))
DIGEST_CHUNK_BYTES = 32 << 20  # bytes per pinned staging buffer (two per thread)


def combine_digests(named_digests: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, d in named_digests:
        h.update(f"{name}={d}\n".encode())
    return h.hexdigest()
