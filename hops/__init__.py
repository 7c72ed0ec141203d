"""HOPs torch lacks on some supported versions, and user-facing op helpers (torch_ext.hops)."""
