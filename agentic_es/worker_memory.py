"""What an engine's workers hold (es_memory), for the benchmarks and tests: a worker method (vLLM sends a worker call
by name; a function would need its insecure serialization), kept out of common.py, whose ESWorker mixes it in.
Called as engine.rpc(worker_memory.es_memory), one report per rank.
"""

from __future__ import annotations

import torch


class WorkerMemory:
    """Mixed into common.ESWorker: reads the state it keeps (es_params, es_copy, es_patch)."""

    def es_memory(self) -> dict:
        """Bytes of the ES parameters, of the exact-restore copy or patch (and the patch's values recorded for the
        last perturbation), and the device's free/total memory."""
        device = self.es_params[0][1].device
        free, total = torch.cuda.mem_get_info(device) if device.type == "cuda" else (None, None)
        return {"rank": self.es_rank, "params": sum(t.numel() for _, t in self.es_params),
                "param_bytes": sum(t.numel() * t.element_size() for _, t in self.es_params),
                "copy_bytes": sum(c.numel() * c.element_size() for c in self.es_copy or []),
                "copy_device": str(self.es_copy[0].device) if self.es_copy else None,
                "patch_bytes": self.es_patch.nbytes if self.es_patch else 0,
                "patch_used": sum(self.es_patch.used.values()) if self.es_patch else 0,
                "device_free_bytes": free, "device_total_bytes": total}


es_memory = WorkerMemory.es_memory  # engine.rpc(worker_memory.es_memory): sent by its name (engine.worker_call)
