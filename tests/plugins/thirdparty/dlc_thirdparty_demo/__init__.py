"""A third-party dlcore plugin: one more rms_norm implementation and a brand-new op."""
