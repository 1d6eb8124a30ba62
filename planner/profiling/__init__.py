"""The machine in numbers: the hardware profile the planner plans against, its presets, measuring this machine,
and the constants fitted from real training steps.

Modules: ``hardware.py`` (``HardwareProfile``: the measured or preset figures), ``hardware_presets.py`` (GPUs and
hosts by name, with their figures' sources), ``profiler.py`` (this machine measured into a profile, or detected
quickly), ``host_rates.py`` (the CPU's own rates, measured with torch: AdamW, the shadow and bf16-state passes,
memory bandwidth), ``compiled_speedup.py`` (a decoder layer compiled against eager, timed by the runtime's probe in
a child process), ``host_probe.py`` (the host's figures read without torch: memory and its limits, the spill
disk's speed, a GPU driver), ``disk_profile.py`` (the spill disk's figures in a profile, measured in a folder),
``disk_contention.py`` (the compute the cores lose for each GB the disk moves), ``disk_space.py`` (the free space
of the disk spill files go to), ``profile_checks.py`` (whether a measured figure is plausible against the others,
and measuring again until it is), ``calibration.py`` (constants fitted from real steps: the data a profile stores
and the fit).

May import: the standard library, psutil, ``megatrain.errors``, the plan contract and ``shapes/``; torch only
inside ``profiler.py`` and ``host_rates.py``, in the functions that measure a device.
"""
