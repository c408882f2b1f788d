"""``python -m megacpp`` (also what ``torchrun -m megacpp ...`` runs)."""

from megacpp.cli.main import main

main()
