"""The tiny model of the integration tests, one spec: keyword arguments of `ModelFromConfig`, and the same
model as a run's `policy.model.from_config` override."""

TINY = dict(hidden_size=32, num_layers=2, num_attention_heads=2, intermediate_size=64)


def tiny_from_config(**changes) -> str:
    """The `policy.model.from_config` override (a YAML flow mapping) of `changes` and TINY's fields."""
    fields = {**changes, **{key: value for key, value in TINY.items() if key not in changes}}
    text = {key: str(value).lower() if isinstance(value, bool) else value for key, value in fields.items()}
    return "{" + ", ".join(f"{key}: {value}" for key, value in text.items()) + "}"
