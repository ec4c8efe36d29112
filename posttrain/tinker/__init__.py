"""A training service the Tinker SDK talks to: `posttrain serve-tinker` (server.py), its state (service.py),
a tenant's model (model.py) and the SDK's wire formats (wire.py)."""
