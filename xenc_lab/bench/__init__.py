"""Benchmarks: xenc_lab beside sentence-transformers in one process (``run``), reports, memory probes, workloads."""
from .flops import attention_heads, encoder_dims, gemm_rate, model_gflop, projection_shapes
from .memory import memory_facts, memory_note, peak_memory_mb
from .report import ReportFacts, as_dicts, goals, machine, machine_slug, plot, report_facts, write_report
from .timing import BenchRow, cpu_has_fast_bf16, device_name, run, set_error_ratios

__all__ = [
    "BenchRow", "ReportFacts", "as_dicts", "attention_heads", "cpu_has_fast_bf16", "device_name", "encoder_dims",
    "gemm_rate", "machine", "memory_facts", "memory_note", "model_gflop", "peak_memory_mb", "plot", "projection_shapes",
    "report_facts", "run", "set_error_ratios", "write_report",
]
