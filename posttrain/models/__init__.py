"""Models as weights: building a model directory from an architecture config, tokenizers, LoRA adapters,
vision-language processors and GGUF conversion. The workers that train and sample them live in
`posttrain.workers`."""
