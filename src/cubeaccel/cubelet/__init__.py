"""Cubelet: the node-local owner of every accelerator."""
