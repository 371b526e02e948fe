"""The Mimi codec wing: the model (mimi/) and the batched codec stage (stage.py) the encoder and decoder
services run."""
