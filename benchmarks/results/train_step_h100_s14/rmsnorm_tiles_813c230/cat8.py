"""benchmarks/train_step.py with the regional compile's cat option at Inductor's default (8):
the new tree without its compile-option change (isolates the RMSNorm tile change)."""
import runpy, sys
import megacpp.train.parallelize as p
p._CAT_INPUTS = 8
sys.argv = ["benchmarks/train_step.py", *sys.argv[1:]]
runpy.run_path("benchmarks/train_step.py", run_name="__main__")
