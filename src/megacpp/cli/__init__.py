"""Thin typer commands: parse arguments, call the library, print. Nothing imports cli."""
