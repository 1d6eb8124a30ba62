"""The mixtral family: its config rules, parameter table and presets (family.py), its blocks (blocks.py)."""
