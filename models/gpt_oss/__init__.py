"""gpt-oss (``model_type`` gpt_oss)."""
