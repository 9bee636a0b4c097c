"""The Hugging Face folder format: weights as ``from_pretrained`` loads them (safetensors or ``pytorch_model.bin``,
sharded with an index, config and tokenizer files beside them); :mod:`zckpt.hf.writer` plans and writes it."""
