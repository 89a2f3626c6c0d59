"""Quantized weights: checkpoints in the published FP8, AWQ, GPTQ, compressed-tensors, AutoRound
layouts loaded as they are, float checkpoints quantized at load (--quantization), all held in one
layout (qtensor.py) and multiplied without a float copy of the model."""
