"""The saved profile's figures a calibration relies on, measured again where they are off.

``megatrain-plan calibrate`` reads the hardware profile ``megatrain-plan profile`` saved: one figure of it
taken while another process ran through its samples (causal attention 44x below the matmul rate, say)
would turn every run's fit absurd. Before the runs, each figure the fit uses that is implausible against
the others (``planner/profiling/profile_checks.py``) is measured again on this machine; after them, a figure the
runs contradict (``ProfileFigureError``: a run's attention at the profile's rate longer than its whole
compute) is measured again and the fit repeated once. A figure still off after that is left out (the fit
then holds the attention inside the layers' rate) and a warning names it with the command that measures it:
one bad figure never fails the calibration.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")


def checked_profile(hw: Any, dtype: str, log: Callable[[str], None]) -> Any:
    """``hw`` with its causal-attention rate for ``dtype`` (fp32, bf16) measured again where it is implausible
    against the matmul rate, ``log`` saying so; unchanged when plausible or not measured."""
    from megatrain.planner.profiling.profile_checks import attention_findings

    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
    mine = {name: hw.attention_tflops[name]} if name in hw.attention_tflops else {}
    for finding in attention_findings(dict(hw.matmul_tflops), mine):
        log(f"the profile's {finding.line()}: measuring it again before the runs")
        hw = remeasured(hw, finding.dtype, log)
    return hw


def remeasured(hw: Any, dtype: str, log: Callable[[str], None]) -> Any:
    """``hw`` with the causal-attention rate of ``dtype`` (the profile's name: float32) measured again on this
    machine, itself checked against the matmul rate and measured again while implausible (``profiler``)."""
    from megatrain.planner.profiling import profiler

    on_gpu = hw.gpu_mem_bytes > 0
    fresh = {**hw.attention_tflops, **profiler.attention_rates(on_gpu, (dtype,), log)}
    attention, _ = profiler.plausible_attention(dict(hw.matmul_tflops), fresh, on_gpu, log)
    return hw.replace(attention_tflops=attention)


def fit_checked(fit_once: Callable[[Any], T], hw: Any, log: Callable[[str], None]) -> tuple[T, Any, list[str]]:
    """``fit_once(hw)``, the profile it used, and warnings. A figure the runs contradict is measured again and
    the fit repeated; still contradicted, the figure is left out (the attention then counts with the layers'
    rate, which the fit is then of) and a warning names it and the command that measures it."""
    from megatrain.planner.profiling.calibration import ProfileFigureError

    try:
        return fit_once(hw), hw, []
    except ProfileFigureError as e:
        log(f"{e.finding.line()}: measuring it again and fitting once more")
        hw = remeasured(hw, e.finding.dtype, log)
    try:
        return fit_once(hw), hw, []
    except ProfileFigureError as e:
        off = e.finding
    hw = hw.replace(attention_tflops={k: v for k, v in hw.attention_tflops.items() if k != off.dtype})
    warning = (f"the profile's {off.line()}, measured twice here (a busy machine?): fitted with the attention "
               f"inside the layers' rate and {off.figure} left out of the profile; measure it again with "
               "megatrain-plan profile on a quiet machine, then calibrate again")
    log(warning)
    return fit_once(hw), hw, [warning]
