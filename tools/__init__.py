"""The user-facing commands other than the planner's own: ``megatrain-train`` (a training run: data, plan, loop,
checkpoints, metrics), ``megatrain-export`` (a run as a Hugging Face directory) and ``megatrain-plan calibrate``
(the planner's constants fitted from real steps), with trace summaries.

Modules: ``bf16_state_probe.py`` (the bf16-state AdamW update timed against fp32 AdamW, for ``megatrain-plan
profile``), ``compiled_layer_probe.py`` (a decoder layer timed eager against compiled, for ``megatrain-plan
profile --compiled-layers``), ``calibration_runs.py`` (the models ``megatrain-plan calibrate`` runs),
``kernel_categories.py`` (a trace's kernels by category: gemm, attention, norm, copy, ...), the training command: ``train.py`` (``megatrain-train``), ``train_options.py`` (its options and ``--config``),
``train_config.py`` (its configuration, one frozen dataclass), ``training_loop.py`` (the steps of one run),
``run_plan.py`` (the plan a run executes), ``run_limits.py`` (a run's sizes checked against the machine),
``run_dir.py`` (the run directory), ``run_inputs.py`` (what a run reads kept out of what ``--overwrite`` deletes),
``resume.py`` (``--resume``), ``restart.py`` (``--resume-or-start``), ``world_change.py`` (a run resumed at another
world size), ``ranks.py`` (the command under torchrun), ``interrupt.py`` (Ctrl-C), ``divergence.py`` (a diverged
run), ``io_failure.py`` (a disk failing under a command), ``warning_lines.py`` (warnings as one line each),
``lr_schedule.py`` (warmup and cosine decay), ``evaluation.py`` (held-out evaluation); its data: ``data.py`` (where
documents come from), ``data_order.py`` (the held-out split and the epochs' shuffle), ``packing.py`` (documents into
fixed-length rows), ``bin_packing.py`` (whole-document packing), ``chat_data.py`` (chat records as documents),
``tokenizer.py`` (byte-level or a Hugging Face tokenizer), ``tokenizer_check.py`` (the tokenizer against
transformers'), ``model_source.py`` (``--model``), ``hub_models.py`` (a Hugging Face Hub model); what a run reports:
``metrics.py`` (one JSON line per step, the summary), ``metrics_routing.py`` (the experts' load),
``metric_sinks.py`` (TensorBoard, Weights & Biases), ``progress.py`` (the live display), ``plot.py`` (the end-of-run
figure), ``trace.py`` (``--trace``), ``trace_anatomy.py`` (where traced steps spent their time); the other commands:
``export.py`` (``megatrain-export``), ``export_staging.py`` (an export's staging folders), ``calibrate.py``
(``megatrain-plan calibrate``), ``profile_repair.py`` (a saved profile's figures measured again).

May import: the standard library and third-party packages (tokenizers, huggingface_hub, tensorboard, wandb,
matplotlib, pyarrow), ``megatrain.errors``, ``megatrain.models``, the plan contract, the planner and the runtime.
"""
