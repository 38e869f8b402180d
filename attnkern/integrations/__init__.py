"""attnkern in other libraries' attention slots: transformers (attnkern.integrations.transformers)."""
