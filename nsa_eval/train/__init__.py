"""The recipe that trains the bundled `nsa-tiny` and `full-tiny` checkpoints (docs/training.md).

data.py: offline corpus + synthetic NIAH retrieval mix; tokenizer.py: byte-level BPE;
recipe.py: model configurations, the training loop, checkpoints.
"""
