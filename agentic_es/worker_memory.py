"""What an engine's workers hold (es_memory): run in each TP worker by engine.rpc(worker_memory.es_memory), one
report per rank; the benchmarks and tests read it. Not part of the algorithm: common.ESWorker only keeps the state
it reports.
"""

from __future__ import annotations

import torch


def es_memory(worker) -> dict:
    """Bytes of the ES parameters, of the exact-restore copy or patch (and the patch's values recorded for the
    last perturbation), and the device's free/total memory."""
    device = worker.es_params[0][1].device
    free, total = torch.cuda.mem_get_info(device) if device.type == "cuda" else (None, None)
    return {"rank": worker.es_rank, "params": sum(t.numel() for _, t in worker.es_params),
            "param_bytes": sum(t.numel() * t.element_size() for _, t in worker.es_params),
            "copy_bytes": sum(c.numel() * c.element_size() for c in worker.es_copy or []),
            "copy_device": str(worker.es_copy[0].device) if worker.es_copy else None,
            "patch_bytes": worker.es_patch.nbytes if worker.es_patch else 0,
            "patch_used": sum(worker.es_patch.used.values()) if worker.es_patch else 0,
            "device_free_bytes": free, "device_total_bytes": total}
