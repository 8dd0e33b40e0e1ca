"""Helpers the tools share (tools/cli.py); the stages use none of them."""
