"""The qwen2_moe family: its config rules, parameter table and presets (family.py), its blocks (blocks.py)."""
