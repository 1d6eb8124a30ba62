"""megatrain against the systems users would pick instead, side by side in one run.

``python benchmarks/peers.py`` is the command; this package is its parts:

| file | owns |
|---|---|
| ``spec.py`` | what one run is asked to do (``RunSpec``), the model shapes, the batches |
| ``weights.py`` | the same initial weights in every system, and the Hugging Face model the peers train |
| ``memory.py`` | host memory readings: peak RSS, its reset, what the machine has left |
| ``probe.py`` | the machine's description and its measured matmul peak (a subprocess) |
| ``child.py`` | one system's run in a fresh subprocess: setup, timed steps, peaks, status |
| ``fits.py`` | what fits in device memory: which setting each peer runs at its best (checkpointing, no-sync, ZeRO-Offload) |
| ``trainer.py`` | what the peers' trainers answer alike after their steps: drain the device, no breakdown, pinned bytes |
| ``run_megatrain.py``, ``run_pytorch.py``, ``run_fsdp2.py``, ``run_deepspeed.py``, ``run_zero_offload.py`` | one system each |
| ``launcher.py`` | the parent's side of a run: start it, watch host memory and time, read its result |
| ``sweep.py`` | which runs, in what order, within a time budget; DeepSpeed's micro-batch sweep; growing the model until it fails |
| ``report.py`` | derived figures (tokens/s, model TFLOP/s by ``../flop_figures.py``, MFU, loss agreement, best of a sweep) and the JSON, Markdown and PNG, each run under its own machine header |
| ``cli.py`` | the command line |
"""
