"""Newton-Schulz's polynomial a I + b A + c A A: ``reference.py`` (baddbmm), ``triton.py`` (the
symmetric one-launch kernel), ``configs.py`` (its launch setting), ``spec.py`` (its catalog
entry)."""
