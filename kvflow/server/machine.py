"""What this machine allows the served model, for the page's "decode at 78% of what memory bandwidth allows".

Decode cannot beat bandwidth / (bytes of weights a step reads + the K/V of the sequence's context), and
prefill cannot beat matmul rate / FLOPs per prompt token (kvflow/machine/roofline.py). The model's side is
known once it is loaded; the machine's side comes from the probe (`kvflow bench probe`), saved on disk,
or measured on request (POST /kvflow/probe, about 20 seconds, during which serving slows down).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from kvflow.executors.model_setup import ModelSummary
from kvflow.kernels import cpu_features
from kvflow.machine import probe as probes
from kvflow.machine.roofline import ModelShape

log = logging.getLogger("kvflow")


class MachineLimits:
    def __init__(self, model: ModelSummary, kv_dtype_bytes: float) -> None:
        shape = ModelShape.from_hf_config(model.arch.raw)
        self.device = model.device.type
        self.model = {
            "weight_bytes_per_step": model.weight_bytes_per_step,
            "kv_bytes_per_token": shape.kv_bytes_per_token(kv_dtype_bytes),
            # A prompt token's FLOPs: 2 per layer weight it runs through, plus 4 per head dimension per
            # earlier token it attends to (the output projection runs for the last token only).
            "flops_per_token": 2 * shape.active_layer_matmul_params,
            "attention_flops_per_context_token": 4 * shape.num_layers * shape.num_heads * shape.head_dim,
        }
        self.prefill_matmuls = model.prefill_matmuls
        self._lock = threading.Lock()
        self._probing = False
        self._error: str | None = None
        self._probe = self._matching(probes.load_probe())

    def _matching(self, probe: dict | None) -> dict | None:
        """The probe if it was taken on this machine and device (a copied cache dir may hold another's)."""
        if probe is None or probe.get("device", "cpu") != self.device:
            return None
        if self.device == "cpu" and probe.get("machine", {}).get("cpu_model") != cpu_features.cpu_name():
            return None
        return probe

    def start_probe(self) -> bool:
        """Measure the machine on a thread of its own; False when a probe is already running."""
        with self._lock:
            if self._probing:
                return False
            self._probing, self._error = True, None
        threading.Thread(target=self._run_probe, name="kvflow-probe", daemon=True).start()
        return True

    def _run_probe(self) -> None:
        try:
            probe = probes.run_probe(threads=[torch.get_num_threads()], device=self.device)
            probes.save_probe(probe)
            self._probe = probe
        except Exception as exc:  # noqa: BLE001 - reported on the page, the server goes on
            log.exception("the machine probe failed")
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._probing = False

    def as_dict(self) -> dict[str, Any]:
        limits: dict[str, Any] = {"model": self.model, "probing": self._probing, "probe_error": self._error,
                                  "machine": None}
        probe = self._probe
        if probe is not None:
            threads = torch.get_num_threads()
            rows = {r["threads"] for r in probe["results"]}
            at = threads if threads in rows else None
            flops = probes.matmul_flop_per_s(probe, self.prefill_matmuls, at) or probes.matmul_flop_per_s(
                probe, "f32", at)
            machine = probe.get("machine", {})
            limits["machine"] = {
                "cpu": machine.get("cpu_model"), "tier": machine.get("cpu_tier"), "date": machine.get("date"),
                "threads": at or max(rows), "bandwidth_bytes_per_s": probes.bandwidth_bytes_per_s(probe, at),
                "matmul_flop_per_s": flops, "matmul_kind": self.prefill_matmuls,
            }
        return limits
