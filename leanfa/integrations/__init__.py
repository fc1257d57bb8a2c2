"""Framework integrations: :mod:`leanfa.integrations.transformers` (Hugging Face)."""
