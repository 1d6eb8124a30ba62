"""``megatrain-plan``'s commands, one module each: its options (``add_parser``) and what it computes (``run``);
what it prints is in the matching ``planner/report_*.py``."""
